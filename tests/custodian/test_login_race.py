"""The SoftHSM login race (../shared/design.md, tests/custody/test_concurrent_processes.py)
with the custodian: key commands open the token from their own processes while the
custodian, restarted again and again (what systemd's Restart=always does after a crash),
logs in beside them. Every custodian start must come up and answer a request that unseals,
and every key command's open must succeed: the bounded find-and-login retry in custody's
token module is what the custodian and the commands share.

Each start and each command is a C_Login, which SoftHSM 2.6.1 answers by rewriting
token.object; a process reading it meanwhile sees GeneralError or no token. The test prints
how many login attempts were retried (the race happening), which varies from run to run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from custody import Custody, TokenConfig
from tests.custodian.test_refusals import ask
from tests.fixtures.custodian import CustodianProcess, write_custodian_config
from tests.fixtures.token import REPO

#: Key-command processes at once, the opens each makes, and the custodian's restarts meanwhile.
COMMANDS = 1
ROUNDS = 200
RESTARTS = 8
#: A key command with custody's log lines on stderr (the retries are logged at info).
_COMMAND = ("import logging, runpy, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
            "sys.argv = ['login_churn', *sys.argv[1:]]\n"
            "runpy.run_module('tests.custody.login_churn', run_name='__main__')\n")
OWNER = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"


async def _mint(config: TokenConfig, state_dir: Path) -> str:
    async with await Custody.open(config, state_dir) as custody:
        return (await custody.mint_agent(owner=OWNER)).pubkey


@pytest.mark.token_unseals(COMMANDS * ROUNDS + RESTARTS)
def test_the_custodian_and_key_commands_log_in_at_once(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    config, state_dir = custody_state
    agent = trio.run(_mint, config, state_dir)
    socket_path = tmp_path / "custodian.sock"
    custodian = CustodianProcess(
        write_custodian_config(tmp_path / "custodian.toml", token=config, state_dir=state_dir,
                               socket=socket_path, relay_url=local_relay), socket_path)
    assert config.pin_file is not None
    args = [config.module, config.token_label, config.pin_file, config.kek_label,
            str(state_dir), str(ROUNDS)]
    commands = [
        subprocess.Popen([sys.executable, "-c", _COMMAND, *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         env=dict(os.environ))
        for _ in range(COMMANDS)]
    try:
        answered = 0
        for _ in range(RESTARTS):
            custodian.start()  # raises unless it logged in and is listening
            ok, value = ask(socket_path, "memory_address", agent=agent, slug="core")
            assert ok, value
            answered += 1
            custodian.kill()
        results, retried_by_commands = [], 0
        for command in commands:
            out, err = command.communicate(timeout=300)
            retried_by_commands += err.count("login attempt")
            assert "Traceback" not in err, err
            assert command.returncode == 0, err
            results.append(json.loads(out))
    finally:
        for command in commands:
            if command.poll() is None:
                command.kill()
                command.communicate()
        stderr = custodian.stop()
    assert answered == RESTARTS
    for result in results:
        assert result["faults"] == {}, results
        assert result["opened"] == ROUNDS and result["unsealed"] == ROUNDS
    print(f"\ncustodian starts: {RESTARTS}, key-command opens: {COMMANDS * ROUNDS}; login "
          f"attempts retried: custodian {stderr.count('login attempt')}, key command "
          f"{retried_by_commands}")
