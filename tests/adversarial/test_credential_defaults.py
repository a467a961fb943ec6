"""`credential issue` defaults that fail safe (issue 13, item 7).

Attack: an operator's shortest command. `credential issue --agent A --channel C` used to
grant all nine actions, forever, to any local uid, silently. Now:
- the scope is said out loud: `--action NAME` (repeatable) or `--all-actions`; neither (or
  both) is refused and nothing is issued;
- a credential expires after `DEFAULT_TTL` (30 days) unless `--ttl` says otherwise, and a
  credential that never expires takes `--ttl never`;
- the uid is said out loud as well (issue 22): `--uid UID` (or a user name) or
  `--any-uid`, never neither; `--any-uid` warns on stderr (the token alone is then enough);
- `--label` names a credential, and `credential list` shows label, agent, actions,
  channels, uid, expiry and last use;
- last use costs no write per request: it is noted in memory and written by
  `flush_last_use` (the daemon's minute timer, and close).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from buzzwire.contract import ACTIONS
from custody import Custody
from daemon.cli import credential
from daemon.cli._common import CliError
from daemon.state.sessions import SessionStore

HUMAN = "22" * 32
CHANNEL = "123e4567-e89b-12d3-a456-426614174000"
DAY = 86400


def cli(config: Path, argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="buzz-broker credential")
    parser.add_argument("--config")
    credential.add_arguments(parser)
    return credential.run(parser.parse_args(["--config", str(config), *argv]))


@pytest.fixture
def config_file(tmp_path: Path, custody: Custody) -> Path:
    path = tmp_path / "broker.toml"
    path.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n')
    return path


@pytest.fixture
async def agent(custody: Custody) -> str:
    record = await custody.mint_agent(owner=HUMAN, mint_ref=None)
    return record.pubkey


def _issued(config_file: Path, tmp_path: Path, argv: Sequence[str],
            capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    assert cli(config_file, ["issue", *argv]) == 0
    out, err = capsys.readouterr()
    return out.strip(), err


def _rows(config_file: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    assert cli(config_file, ["list", "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


async def test_the_scope_must_be_explicit(
    config_file: Path, agent: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in ([], ["--action", "message.post", "--all-actions"]):
        with pytest.raises(SystemExit) as refused:
            cli(config_file, ["issue", "--agent", agent, "--channel", CHANNEL, "--any-uid",
                              *argv])
        assert refused.value.code == 2
        out, err = capsys.readouterr()
        assert out == "" and "--action" in err and "--all-actions" in err
    assert _rows(config_file, capsys) == []

    token, _ = _issued(config_file, tmp_path, ["--agent", agent, "--channel", CHANNEL,
                                               "--action", "message.post", "--any-uid",
                                               "--action", "channel.read"], capsys)
    assert _rows(config_file, capsys)[0]["actions"] == ["channel.read", "message.post"]
    _issued(config_file, tmp_path, ["--agent", agent, "--channel", CHANNEL, "--all-actions",
                                    "--any-uid"], capsys)
    # every action this build offers, as the explicit list (not a wildcard)
    assert _rows(config_file, capsys)[1]["actions"] == sorted(ACTIONS)


async def test_the_uid_must_be_explicit(
    config_file: Path, agent: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 22 L3: without a uid, a token read from another process's environment or
    file works from any uid; so binding is the default and the opt-out is named."""
    for argv in ([], ["--uid", "1000", "--any-uid"]):
        with pytest.raises(SystemExit) as refused:
            cli(config_file, ["issue", "--agent", agent, "--channel", CHANNEL,
                              "--all-actions", *argv])
        assert refused.value.code == 2
        out, err = capsys.readouterr()
        assert out == "" and "--uid" in err and "--any-uid" in err
    assert _rows(config_file, capsys) == []
    _issued(config_file, tmp_path, ["--agent", agent, "--channel", CHANNEL, "--all-actions",
                                    "--uid", "root"], capsys)
    _issued(config_file, tmp_path, ["--agent", agent, "--channel", CHANNEL, "--all-actions",
                                    "--uid", " 1000 "], capsys)
    assert [row["uid"] for row in _rows(config_file, capsys)] == [0, 1000]


def test_a_uid_no_process_can_have_is_one_clear_line() -> None:
    """A number past what SQLite or a uid_t holds, and a digit that is not ASCII, were an
    "internal error" (OverflowError, ValueError); (uid_t) -1 was stored, a uid no process
    can have. Each is now the option's one line."""
    from daemon.cli._common import CliError

    for text, said in (("99999999999999999999", "at most 4294967294"),
                       ("4294967295", "at most 4294967294"),
                       ("\u00b2", "expected a non-negative uid")):
        with pytest.raises(CliError, match=said):
            credential.parse_uid(text)
    assert credential.parse_uid("4294967294") == 2**32 - 2


async def test_default_ttl_never_and_the_uid_warning(
    config_file: Path, agent: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = int(time.time())
    _, err = _issued(config_file, tmp_path, ["--agent", agent, "--channel", CHANNEL,
                                             "--all-actions", "--any-uid"], capsys)
    assert credential.NO_UID_WARNING in err
    _, err = _issued(config_file, tmp_path, ["--agent", agent, "--channel", CHANNEL,
                                             "--all-actions", "--ttl", "never", "--uid", "1000"],
                     capsys)
    assert "warning" not in err
    defaulted, forever = _rows(config_file, capsys)
    assert credential.DEFAULT_TTL == "30d"
    expires = defaulted["expiresAt"]
    assert isinstance(expires, int) and before + 30 * DAY <= expires <= int(time.time()) + 30 * DAY
    assert forever["expiresAt"] is None and forever["uid"] == 1000
    with pytest.raises(CliError):
        cli(config_file, ["issue", "--agent", agent, "--channel", CHANNEL, "--all-actions",
                          "--ttl", "forever", "--any-uid"])


async def test_list_shows_label_scope_and_last_use_written_cheaply(
    config_file: Path, agent: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token, _ = _issued(config_file, tmp_path, ["--agent", agent, "--channel", CHANNEL,
                                               "--action", "message.post", "--uid", "1000",
                                               "--label", "ci runner #2"], capsys)
    assert cli(config_file, ["list"]) == 0
    line = capsys.readouterr().out.strip()
    for shown in ('label="ci runner #2"', f"agent={agent}", "actions=message.post",
                  f"channels={CHANNEL}", "uid=1000", "expires=20", "last-used=never"):
        assert shown in line, (shown, line)
    assert token not in line

    store = SessionStore.open(tmp_path / "state")
    reader = sqlite3.connect(tmp_path / "state" / "sessions.db")
    try:
        used_at = int(time.time())
        for _ in range(100):
            assert store.authenticate(f"Bearer {token}", 1000, used_at) is not None
        # Not one write for those 100 requests: the database still says never.
        assert reader.execute("SELECT last_used_at FROM credentials").fetchall() == [(None,)]
        assert store.flush_last_use() == 1
        assert reader.execute("SELECT last_used_at FROM credentials").fetchall() == [(used_at,)]
        store.authenticate(f"Bearer {token}", 1000, used_at + 5)
    finally:
        store.close()  # writes what is still noted
        reader.close()
    [row] = _rows(config_file, capsys)
    assert (row["label"], row["lastUsedAt"]) == ("ci runner #2", used_at + 5)
    assert cli(config_file, ["list"]) == 0
    assert "last-used=never" not in capsys.readouterr().out


def test_an_older_credential_database_gains_the_new_columns(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    old = sqlite3.connect(state / "sessions.db")
    old.executescript("""
        CREATE TABLE credentials (credential_id TEXT PRIMARY KEY, token_sha256 BLOB NOT NULL
          UNIQUE, agent TEXT NOT NULL, channels TEXT NOT NULL, actions TEXT NOT NULL,
          created_at INTEGER NOT NULL, expires_at INTEGER, uid INTEGER, revoked_at INTEGER);
        INSERT INTO credentials VALUES ('cred_0000000000000000', x'00', '""" + "ab" * 32 + """',
          '[]', '["message.post"]', 1, NULL, NULL, NULL);
    """)
    old.close()
    store = SessionStore.open(state)
    try:
        [info] = store.list()
        assert (info.label, info.last_used_at) == (None, None)
        store.issue(agent="ab" * 32, channels=frozenset({CHANNEL}),
                    actions=frozenset({"message.post"}), ttl_seconds=60, uid=None,
                    now=int(time.time()), label="new")
        assert [i.label for i in store.list()] == [None, "new"]
    finally:
        store.close()
