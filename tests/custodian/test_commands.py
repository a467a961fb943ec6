"""The operator's commands where a custodian holds the keys: `agent create` and `agent
remove` run as the pipeline's uid (no PIN, no token in their configuration) and go through
the custodian's table; `check-config --deep` asks the custodian instead of logging in.
Under one uid here (the test's): the configuration simply names no PIN and no token to show
the commands never need them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import coincurve

from custody import TokenConfig
from tests.fixtures.custodian import CustodianProcess

REPO = Path(__file__).resolve().parents[2]


def _cli(config: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SOFTHSM2_CONF", "CREDENTIALS_DIRECTORY", "BUZZ_BROKER_CONFIG")}
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config), *args],
                          cwd=REPO, env=env, input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_agent_create_remove_and_check_config_go_through_the_custodian(
        custodian: CustodianProcess, custody_state: tuple[TokenConfig, Path], local_relay: str,
        tmp_path: Path) -> None:
    _, state_dir = custody_state
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path / "broker.sock"}"\n[state]\ndir = "{state_dir}"\n'
        f'[custody]\ncustodian_socket = "{custodian.socket}"\n'
        '[pkcs11]\nmodule = "/nonexistent/libpkcs11.so"\ntoken_label = "none-here"\n'
        f'[relay]\nurl = "{local_relay}"\n')
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    made = _cli(config, "agent", "create", "--owner", owner, "--name", "through-custodian")
    assert made.returncode == 0, made.stderr
    agent = made.stdout.strip()
    log = (state_dir / "custodian" / "signed.jsonl").read_text().splitlines()
    assert any(json.loads(line).get("op") == "mint" and json.loads(line).get("agent") == agent
               for line in log), log[-3:]
    listed = _cli(config, "agent", "list", "--json")
    assert agent in listed.stdout
    deep = _cli(config, "check-config", "--deep")
    assert deep.returncode == 0, deep.stdout + deep.stderr
    assert f"the custodian at {custodian.socket} answers" in deep.stdout
    assert "pin: none here: the custodian holds the keys" in deep.stdout
    removed = _cli(config, "agent", "remove", agent, "--yes")
    assert removed.returncode == 0, removed.stderr
    custodian.kill()
    down = _cli(config, "check-config", "--deep")
    said = down.stdout + down.stderr
    assert down.returncode != 0 and f"custodian at {custodian.socket}" in said, said
