"""The relay the custodian signs AUTH for and the daemon's `[relay] url` are two files'
keys: edited apart, every AUTH was refused, which a relay that asks for AUTH showed only as
publishes refused ("AUTH not signed: IntentRefused"), while `check-config --deep` and
`status` said all was well and only the custodian's journal said why (a review of an
operator's first hour). The custodian now answers its relay (the `relay` row); the daemon
refuses to start against another, and the deep check fails, each in one line naming both.
A `relay_url` the custodian could never match (user information, no host, not ws/wss) is
refused when its file is read, and never said: a password would be in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from custody import CustodyError, TokenConfig
from custody.custodian.client import CustodianClient
from tests.custodian.test_config_faults import ENTRY_POINTS, _one_line, _run
from tests.custodian.test_refusals import ask
from tests.fixtures.custodian import CustodianProcess, write_custodian_config

REPO = Path(__file__).resolve().parents[2]
OTHER = "ws://127.0.0.1:9"


def _daemon(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("BUZZ_BROKER_CONFIG", "CREDENTIALS_DIRECTORY")}
    return subprocess.run([sys.executable, "-m", "daemon.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _config(tmp_path: Path, custodian: CustodianProcess, relay: str) -> Path:
    config = tmp_path / "broker.toml"
    config.write_text(f'[server]\nsocket = "{tmp_path / "b.sock"}"\n'
                      f'[state]\ndir = "{tmp_path / "daemon-state"}"\n'
                      f'[custody]\ncustodian_socket = "{custodian.socket}"\n'
                      f'[relay]\nurl = "{relay}"\n')
    return config


def test_a_daemon_of_another_relay_is_refused_at_start_and_by_the_deep_check(
        custodian: CustodianProcess, local_relay: str, tmp_path: Path) -> None:
    config = _config(tmp_path, custodian, OTHER)
    deep = _daemon("--config", str(config), "check-config", "--deep")
    assert deep.returncode == 1 and deep.stderr.startswith(
        f"buzz-broker: check-config --deep: token: custodian at {custodian.socket}: "), deep
    assert local_relay in deep.stderr and OTHER in deep.stderr, deep.stderr
    status = _daemon("--config", str(config), "status")
    [token] = [line for line in status.stdout.splitlines() if line.startswith("token:")]
    assert status.returncode != 0 and "FAILED" in token and local_relay in token and OTHER in token
    served = _daemon("--config", str(config), "serve")
    fault = served.stderr.strip().splitlines()[-1]
    assert served.returncode == 1 and "Traceback" not in served.stderr, served.stderr
    assert fault.startswith(f"buzz-broker: custodian at {custodian.socket}: "), fault
    assert local_relay in fault and OTHER in fault, fault
    # The same files with one relay: the deep check passes (the relay check included).
    agreed = _daemon("--config", str(_config(tmp_path, custodian, local_relay)),
                     "check-config", "--deep")
    assert agreed.returncode == 0, agreed.stdout + agreed.stderr


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("relay", ["wss://operator:hunter2@relay.example", "wss://@relay.example",
                                   "https://relay.example", "wss://", " wss://relay.example",
                                   "wss://[zz]/", "relay.example"])
def test_a_relay_url_the_custodian_could_never_match_is_one_line_at_load(
        tmp_path: Path, entry: str, relay: str) -> None:
    config = write_custodian_config(tmp_path / "custodian.toml",
                                    token=TokenConfig("m", "t", None), state_dir=tmp_path,
                                    socket=tmp_path / "s", relay_url=relay)
    done = _run(entry, config)
    _one_line(done, str(config), "[custodian] relay_url must be a ws:// or wss:// URL")
    assert "hunter2" not in done.stderr


async def test_the_relay_agreement_is_the_exact_url_sign_auth_compares(
        custodian: CustodianProcess, local_relay: str) -> None:
    """The start's check agrees with sign_auth, which compares the URL as written: one
    differing by a trailing slash alone is refused at the start too, since every AUTH
    for it would be."""
    other = local_relay.rstrip("/") + "/"
    assert other != local_relay
    refused = ask(custodian.socket, "sign_auth", agent="a" * 64, relay_url=other,
                  challenge="c", created_at=1_700_000_000)
    assert refused[0] is False and refused[1][0] == "refused", refused
    client = await CustodianClient.open(custodian.socket)
    try:
        await client.require_relay(local_relay)
        with pytest.raises(CustodyError, match="every AUTH would be refused"):
            await client.require_relay(other)
    finally:
        await client.aclose()
