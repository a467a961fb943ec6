"""Several processes on one token and one state directory at once: the daemon beside CLI
commands, two backups at the same moment (docs/install.md allows both).

What was measured (SoftHSM 2.6.1): every C_Login rewrites the token's `token.object` (its
PIN-retry flags), and SoftHSM unlocks that file before its rewrite reaches the disk. A
process reading it in that window (C_GetTokenInfo, C_Login, C_Initialize) fails with
GeneralError or lists no such token, and can be left with the token marked invalid until
its module is started over. Before custody retried logins (`_token.LOGIN_RETRY_ERRORS`),
about one `Custody.open` in ten failed with several processes re-opening in a loop, some
as a raw pkcs11 traceback (this test failed on that code in every run). The unseals
themselves never failed: the KEK's own object file is never rewritten, so a key already
found keeps working.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import custody._token as token_module
from custody import Custody, CustodyError, TokenConfig
from tests.fixtures.token import REPO, SoftHsmToken

#: Processes at once, and the rounds each runs (open, unseal every agent, close).
PROCESSES = 3
ROUNDS = 60
AGENTS = 3
OWNER = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"


async def _mint(config: TokenConfig, state_dir: Path) -> None:
    async with await Custody.open(config, state_dir) as custody:
        for _ in range(AGENTS):
            await custody.mint_agent(owner=OWNER)


@pytest.mark.token_unseals(PROCESSES * ROUNDS * AGENTS)
def test_processes_opening_and_unsealing_at_once_all_succeed(
    custody_state: tuple[TokenConfig, Path],
) -> None:
    config, state_dir = custody_state
    trio.run(_mint, config, state_dir)
    assert config.pin_file is not None
    args = [config.module, config.token_label, config.pin_file, config.kek_label,
            str(state_dir), str(ROUNDS)]
    children = [
        subprocess.Popen([sys.executable, "-m", "tests.custody.login_churn", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=REPO, env=dict(os.environ))
        for _ in range(PROCESSES)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert "Traceback" not in err, err
        assert child.returncode == 0, err
        results.append(json.loads(out))
    for result in results:
        assert result["faults"] == {}, results
        assert result["opened"] == ROUNDS
        assert result["unsealed"] == ROUNDS * AGENTS


def test_a_wrong_pin_is_tried_once(
    softhsm_token: SoftHsmToken, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Only a transient token fault is retried: a token may count failed logins, and
    # retrying a wrong PIN would spend an operator's tries (LOGIN_RETRY_ERRORS).
    assert not token_module._PROCESS.sessions  # so C_Login runs, not the PIN comparison
    wrong = tmp_path / "wrong-pin"
    wrong.write_text("not-the-pin\n")
    wrong.chmod(0o600)
    caplog.set_level(logging.INFO, logger="buzz_broker.custody")
    with pytest.raises(CustodyError, match="wrong PIN"):
        trio.run(Custody.open, softhsm_token.config(pin_file=str(wrong)), tmp_path / "state")
    assert not [r for r in caplog.records if "login attempt" in r.getMessage()]
