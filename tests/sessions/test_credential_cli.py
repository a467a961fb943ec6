"""`buzz-broker credential ...` against a real keystore (SoftHSM token) and a real
credential database: the token appears once on stdout and nowhere else."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from custody import Custody
from daemon.cli import credential
from daemon.cli._common import CliError
from buzzwire.contract import ACTIONS
from daemon.state.sessions import TOKEN_PREFIX, SessionStore

HUMAN = "22" * 32  # a curve point: custody refuses an owner that is not one
CHANNEL = "123e4567-e89b-12d3-a456-426614174000"


def cli(config: Path, argv: Sequence[str]) -> int:
    """The credential command as `buzz-broker --config FILE credential ...` runs it."""
    parser = argparse.ArgumentParser(prog="buzz-broker credential")
    parser.add_argument("--config")
    credential.add_arguments(parser)
    args = parser.parse_args(["--config", str(config), *argv])
    return credential.run(args)


@pytest.fixture
def config_file(tmp_path: Path, custody: Custody) -> Path:
    # The custody fixture keeps its keystore in tmp_path/"state"; the CLI reads the same.
    path = tmp_path / "broker.toml"
    path.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n')
    return path


async def test_issue_list_revoke(
    custody: Custody, config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = await custody.mint_agent(owner=HUMAN, mint_ref=None)
    seen: list[str] = []  # everything the CLI printed, except the one issue stdout

    # All nine actions, no expiry, both said explicitly; the channel is normalized.
    assert cli(config_file, ["issue", "--agent", agent.pubkey.upper(), "--channel",
                             CHANNEL.upper().replace("-", ""), "--all-actions",
                             "--ttl", "never", "--any-uid"]) == 0
    out, err = capsys.readouterr()
    token = out.removesuffix("\n")
    assert out == token + "\n" and token.startswith(TOKEN_PREFIX) and "\n" not in token
    seen.append(err)

    store = SessionStore.open(tmp_path / "state")
    try:
        p = store.authenticate(f"Bearer {token}", None, int(time.time()))
        assert p is not None and p.agent == agent.pubkey
        assert p.channels == frozenset({CHANNEL}) and p.actions == frozenset(ACTIONS)
        assert p.expires_at is None and p.uid is None

        # Scoped: one action, 30 minutes, a uid.
        before = int(time.time())
        assert cli(config_file, ["issue", "--agent", agent.pubkey, "--channel", CHANNEL,
                                 "--action", "message.post", "--ttl", "30m", "--uid", "1000"]) == 0
        out, err = capsys.readouterr()
        scoped = out.strip()
        seen.append(err)
        q = store.authenticate(f"Bearer {scoped}", 1000, before)
        assert q is not None and q.actions == frozenset({"message.post"}) and q.uid == 1000
        assert q.expires_at is not None and before + 1800 <= q.expires_at <= before + 1800 + 60

        assert cli(config_file, ["list"]) == 0
        out, err = capsys.readouterr()
        seen += [out, err]
        assert p.credential_id in out and q.credential_id in out
        assert cli(config_file, ["list", "--json"]) == 0
        out, err = capsys.readouterr()
        seen += [out, err]
        rows = [json.loads(line) for line in out.splitlines()]
        assert [r["id"] for r in rows] == [p.credential_id, q.credential_id]
        assert rows[1]["actions"] == ["message.post"] and rows[0]["state"] == "active"

        assert cli(config_file, ["revoke", p.credential_id]) == 0
        seen += list(capsys.readouterr())
        # The running store sees the revocation at once, without reload().
        assert store.authenticate(f"Bearer {token}", None, int(time.time())) is None
        with pytest.raises(CliError):
            cli(config_file, ["revoke", p.credential_id])
        # An operator pasting the token where the id goes does not see it printed back.
        with pytest.raises(CliError) as pasted:
            cli(config_file, ["revoke", token])
        seen.append(str(pasted.value))
        assert cli(config_file, ["list", "--json"]) == 0
        out, err = capsys.readouterr()
        seen += [out, err]
        assert json.loads(out.splitlines()[0])["state"] == "revoked"
    finally:
        store.close()

    for text in seen:
        for t in (token, scoped):
            assert t not in text and t[len(TOKEN_PREFIX):] not in text
    blob = b"".join(f.read_bytes() for f in (tmp_path / "state").iterdir() if f.is_file())
    for t in (token, scoped):
        assert t.encode() not in blob and t[len(TOKEN_PREFIX):].encode() not in blob


#: argv after `issue --agent <live agent>`, each refused with one line.
BAD_ISSUES: dict[str, list[str]] = {
    "no channel uuid": ["--channel", "not-a-uuid", "--all-actions", "--any-uid"],
    "unknown action": ["--channel", CHANNEL, "--action", "sign", "--any-uid"],
    "bad ttl": ["--channel", CHANNEL, "--all-actions", "--ttl", "5y", "--any-uid"],
    "zero ttl": ["--channel", CHANNEL, "--all-actions", "--ttl", "0m", "--any-uid"],
    "negative uid": ["--channel", CHANNEL, "--all-actions", "--uid", "-1"],
    "unknown user": ["--channel", CHANNEL, "--all-actions", "--uid", "no-such-user-here"],
    "unprintable label": ["--channel", CHANNEL, "--all-actions", "--label", "a\x1b[2Jb",
                          "--any-uid"],
}


async def test_issue_refusals(
    custody: Custody, config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    live = await custody.mint_agent(owner=HUMAN, mint_ref=None)
    dead = await custody.mint_agent(owner=HUMAN, mint_ref=None)
    await custody.destroy_agent(dead.pubkey)
    for name, rest in BAD_ISSUES.items():
        with pytest.raises(CliError) as refused:
            cli(config_file, ["issue", "--agent", live.pubkey, *rest])
        assert "\n" not in str(refused.value), name
    for agent in ("22" * 32, dead.pubkey, "xyz"):
        with pytest.raises(CliError) as refused:
            cli(config_file, ["issue", "--agent", agent, "--channel", CHANNEL, "--all-actions",
                              "--any-uid"])
    out, _ = capsys.readouterr()
    assert out == ""  # nothing was issued, so nothing reached stdout
    store = SessionStore.open(tmp_path / "state")
    try:
        assert store.list() == []
    finally:
        store.close()


@pytest.mark.parametrize(("text", "seconds"), [("45s", 45), ("30m", 1800), ("12h", 43200),
                                                 ("7d", 604800)])
def test_durations(text: str, seconds: int) -> None:
    assert credential.parse_duration(text) == seconds


async def test_grant_adds_actions_to_a_live_credential_and_nothing_else(
    custody: Custody, config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = await custody.mint_agent(owner=HUMAN, mint_ref=None)
    # `--all-actions` stores the actions this build offers, as an explicit list: the row
    # holds names, never "all", so a later release's actions cannot reach it by themselves.
    assert cli(config_file, ["issue", "--agent", agent.pubkey, "--channel", CHANNEL,
                             "--all-actions", "--any-uid"]) == 0
    everything = capsys.readouterr().out.strip()
    assert cli(config_file, ["issue", "--agent", agent.pubkey, "--channel", CHANNEL,
                             "--action", "channel.read", "--any-uid"]) == 0
    narrow = capsys.readouterr().out.strip()

    store = SessionStore.open(tmp_path / "state")  # the daemon's view, open throughout
    try:
        now = int(time.time())
        wide = store.authenticate(f"Bearer {everything}", None, now)
        assert wide is not None and wide.actions == frozenset(ACTIONS)
        rows = {i.credential_id: i for i in store.list()}
        assert list(rows[wide.credential_id].actions) == sorted(ACTIONS)
        p = store.authenticate(f"Bearer {narrow}", None, now)
        assert p is not None and p.actions == frozenset({"channel.read"})

        assert cli(config_file, ["grant", p.credential_id, "--preset", "buzz-runtime"]) == 0
        err = capsys.readouterr().err
        offered = frozenset(a for a in credential.PRESETS["buzz-runtime"] if a in ACTIONS)
        missing = [a for a in credential.PRESETS["buzz-runtime"] if a not in ACTIONS]
        assert f"granted {p.credential_id}: " + ", ".join(sorted(offered - {"channel.read"})) in err
        assert ("left out: " + ", ".join(missing) in err) == bool(missing)
        # The daemon's store sees the grant on its next authentication, no restart.
        q = store.authenticate(f"Bearer {narrow}", None, now)
        assert q is not None and q.actions == offered | {"channel.read"}

        assert cli(config_file, ["grant", p.credential_id, "--action", "profile.set"]) == 0
        assert "granted" in capsys.readouterr().err
        r = store.authenticate(f"Bearer {narrow}", None, now)
        assert r is not None and r.actions == offered | {"channel.read", "profile.set"}
        assert cli(config_file, ["grant", p.credential_id, "--action", "profile.set"]) == 0
        assert "already held" in capsys.readouterr().err

        for argv, says in (
            (["grant", p.credential_id, "--action", "sign"], "unknown action"),
            (["grant", narrow, "--action", "channel.read"], "expected a credential id"),
            (["grant", "cred_" + "0" * 16, "--all-actions"], "no active credential"),
        ):
            with pytest.raises(CliError) as refused:
                cli(config_file, argv)
            assert says in str(refused.value) and narrow not in str(refused.value)
        store.revoke(p.credential_id)
        with pytest.raises(CliError):
            cli(config_file, ["grant", p.credential_id, "--action", "message.post"])
        assert store.authenticate(f"Bearer {narrow}", None, now) is None
    finally:
        store.close()


def test_list_before_any_credential_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`credential list` on a host where nothing is installed yet (root, before the state
    directory is the daemon's) must not leave a root-owned credential store behind there:
    the daemon's user could not open it later. It lists nothing, as `status` counts none."""
    state = tmp_path / "state"
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    assert cli(config, ["list"]) == 0
    assert cli(config, ["list", "--json"]) == 0
    assert capsys.readouterr() == ("", "")
    assert not state.exists()


def test_a_store_that_cannot_be_opened_is_named_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one line says why (the system's or SQLite's reason), not an exception's type."""
    state = tmp_path / "state"
    (state / "sessions.db").mkdir(parents=True)  # a directory where the file should be
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    with pytest.raises(CliError) as refused:
        cli(config, ["list"])
    said = str(refused.value)
    assert "cannot open the credential store" in said and "got a directory" in said, said
    assert "ValueError" not in said and capsys.readouterr() == ("", "")
