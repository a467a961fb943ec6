"""The operator's commands where a custodian holds the keys: `agent create` and `agent
remove` run as the pipeline's uid (no PIN, no token in their configuration) and go through
the custodian's table; `check-config --deep` asks the custodian instead of logging in.
Under one uid here (the test's): the configuration simply names no PIN and no token to show
the commands never need them."""

from __future__ import annotations

import json
import os
import re
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


def _through(custodian: CustodianProcess, state_dir: Path, relay: str, tmp_path: Path) -> Path:
    """The daemon's file with a custodian and no [pkcs11]: every key command goes through it."""
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path / "broker.sock"}"\n[state]\ndir = "{state_dir}"\n'
        f'[custody]\ncustodian_socket = "{custodian.socket}"\n[relay]\nurl = "{relay}"\n')
    return config


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
    held = re.search(r"; (\d+) live agent key(s?)\)", deep.stdout)
    assert held and (held[2] == "s") == (held[1] != "1"), deep.stdout  # "1 live agent key"
    assert "pin: none here: the custodian holds the keys" in deep.stdout
    removed = _cli(config, "agent", "remove", agent, "--yes")
    assert removed.returncode == 0, removed.stderr
    custodian.kill()
    down = _cli(config, "check-config", "--deep")
    said = down.stdout + down.stderr
    assert down.returncode != 0 and f"custodian at {custodian.socket}" in said, said


def test_attach_auth_goes_through_the_custodian(
        custodian: CustodianProcess, custody_state: tuple[TokenConfig, Path], local_relay: str,
        tmp_path: Path) -> None:
    """`agent attach-auth` with a custodian and no [pkcs11] in the daemon's file: the tag is
    checked and stored by the custodian's `attach_auth` row, the profile republished through
    its `sign` row; a tag that does not verify is one line, and nothing is stored."""
    from buzzwire.nostr import owner_tag_digest

    _, state_dir = custody_state
    config = _through(custodian, state_dir, local_relay, tmp_path)
    owner = coincurve.PrivateKey()
    owner_pub = owner.public_key_xonly.format().hex()
    made = _cli(config, "agent", "create", "--owner", owner_pub, "--name", "tag-me")
    assert made.returncode == 0, made.stderr
    agent = made.stdout.strip()

    def listed() -> dict[str, object]:
        done = _cli(config, "agent", "list", "--json")
        assert done.returncode == 0, done.stderr
        return next(json.loads(line) for line in done.stdout.splitlines()
                    if json.loads(line)["pubkey"] == agent)

    assert listed()["authTagMissing"] is True
    stranger = coincurve.PrivateKey().sign_schnorr(owner_tag_digest(agent, "")).hex()
    bad = _cli(config, "agent", "attach-auth", "--agent", agent, "--sig", stranger)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert listed()["authTagMissing"] is True  # nothing stored

    sig = owner.sign_schnorr(owner_tag_digest(agent, "")).hex()
    done = _cli(config, "agent", "attach-auth", "--agent", agent, "--sig", sig)
    assert done.returncode == 0, done.stderr
    assert f"attached the owner's tag to {agent}; republished its profile" in done.stderr
    record = listed()
    assert record["authTagMissing"] is False
    assert record["authTag"] == ["auth", owner_pub, "", sig], record
    log = [json.loads(line) for line in
           (state_dir / "custodian" / "signed.jsonl").read_text().splitlines()]
    assert any(e.get("op") == "attach_auth" and e.get("agent") == agent for e in log)
    assert any(e.get("agent") == agent and e.get("kind") == 0 for e in log), log[-3:]


def _custodian_command(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "custody.custodian", str(config), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_agent_remove_says_the_custodian_keeps_a_copy_and_how_to_end_it(
        custodian: CustodianProcess, custody_state: tuple[TokenConfig, Path], local_relay: str,
        tmp_path: Path) -> None:
    """Under a custodian `agent remove` asked "its key is destroyed for good", and the key
    came back with the custodian's `--recover` right after. The question and the result
    line now say a sealed copy is kept for the grace period and name the command that
    deletes it; both halves are then shown true: `--recover` brings the key back, and after
    the command named, `--recover` finds nothing."""
    _, state_dir = custody_state
    config = _through(custodian, state_dir, local_relay, tmp_path)
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    made = _cli(config, "agent", "create", "--owner", owner, "--name", "comes-back")
    assert made.returncode == 0, made.stderr
    agent = made.stdout.strip()
    forget = f"--forget-destroyed {agent}"

    removed = _cli(config, "agent", "remove", agent, stdin="yes\n")
    assert removed.returncode == 0, removed.stderr
    question, result = removed.stderr.strip().splitlines()
    for said in (question, result):
        assert "for good" not in said and "grace period" in said, said
        assert f"--recover {agent}" in said and forget in said, said
    assert f"buzz-custodian-admin {forget}" in question, question

    back = _custodian_command(custodian.config, "--recover", agent)
    assert back.returncode == 0, back.stderr
    assert agent in _cli(config, "agent", "list", "--json").stdout  # live again

    again = _cli(config, "agent", "remove", agent, "--yes")
    assert again.returncode == 0 and forget in again.stderr, again.stderr
    forgotten = _custodian_command(custodian.config, *forget.split())
    assert forgotten.returncode == 0, forgotten.stderr
    gone = _custodian_command(custodian.config, "--recover", agent)
    assert gone.returncode != 0, gone.stdout + gone.stderr
    assert agent not in _cli(config, "agent", "list", "--json").stdout
