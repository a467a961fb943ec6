"""The public agent directory (daemon/state/directory.py) and custody that holds keys only.

Custody keeps each key's owner, NIP-OA tag and mint reference; names, creators and depth
are the directory's (its own file), depth derived from the owner chain by the one rule.
A keystore written before the move (schema version 1) is read as it is, upgraded in one
transaction when custody opens it, and its names are carried into the directory.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import custody
from custody import Custody, KeyRecord, TokenConfig
from custody._keystore import Keystore
from custody.custodian.forget import forget_named
from daemon.state.directory import (
    DIRECTORY_FILE,
    HUMAN_OWNED_DEPTH,
    PRUNE_AFTER_SECONDS,
    AgentDirectory,
    AgentRecord,
    child_depth,
)

REPO = Path(__file__).resolve().parents[1]
HUMAN = "a" * 64
NOBODY = 65534
SECRET = "11" * 32
#: What only the directory may hold; custody's record and table must have none of it.
PUBLIC_ONLY = {"name", "creator", "depth"}


def _placed(depth: int) -> AgentRecord:
    return AgentRecord(pubkey="b" * 64, owner=HUMAN, name="n", auth_tag=None, creator=None,
                       depth=depth, created_at=1, deleted_at=None)


#: owner record (None: not held here) -> the depth of an agent it owns
DEPTHS: list[tuple[AgentRecord | None, int]] = [
    (None, HUMAN_OWNED_DEPTH),
    (_placed(1), 2),
    (_placed(3), 4),
]


@pytest.mark.parametrize(("owner", "depth"), DEPTHS)
def test_child_depth_is_the_one_rule(owner: AgentRecord | None, depth: int) -> None:
    assert child_depth(owner) == depth


def test_custody_holds_no_name_creator_or_depth() -> None:
    assert not PUBLIC_ONLY & {f.name for f in dataclasses.fields(KeyRecord)}
    for call in (Custody.mint_agent, Custody.import_agent):
        assert not PUBLIC_ONLY & set(inspect.signature(call).parameters)
    assert not hasattr(custody, "AgentRecord") and not hasattr(Custody, "rename_agent")


async def test_names_and_depth_live_in_the_directory(
    custody_state: tuple[TokenConfig, Path],
) -> None:
    config, state_dir = custody_state
    opened = await Custody.open(config, state_dir)
    directory = AgentDirectory.open(state_dir)
    try:
        owner = await opened.import_agent(bytearray(SECRET.encode()), owner=HUMAN)
        kid = await opened.mint_agent(owner=owner.pubkey, mint_ref="ref-1")
        grandkid = await opened.mint_agent(owner=kid.pubkey, mint_ref="ref-2")
        columns = {row[1] for row in sqlite3.connect(state_dir / "keystore.db").execute(
            "PRAGMA table_info(keys)")}
        assert not PUBLIC_ONLY & columns and "sealed" in columns

        # Unnamed: listed under its pubkey's first 12 hex digits; named by enroll.
        assert directory.agent(owner.pubkey).name == owner.pubkey[:12]  # type: ignore[union-attr]
        assert directory.enroll(kid.pubkey, "kid", creator=owner.pubkey) is not None
        assert directory.enroll(kid.pubkey, "again") is not None  # a replay keeps the name
        listed = {r.pubkey: r for r in directory.agents()}
        assert [listed[p].depth for p in (owner.pubkey, kid.pubkey, grandkid.pubkey)] == [1, 2, 3]
        assert (listed[kid.pubkey].name, listed[kid.pubkey].creator) == ("kid", owner.pubkey)
        assert directory.by_mint_ref("ref-2") == listed[grandkid.pubkey]
        assert [r.pubkey for r in directory.agents()] == [r.pubkey for r in opened.agents()]

        # A rename touches only the directory's file: custody's records do not change.
        version, blob = opened.records_version(), _blob(state_dir, kid.pubkey)
        renamed = directory.rename(kid.pubkey, "kid-2")
        assert renamed is not None and renamed.name == "kid-2"
        assert opened.records_version() == version and _blob(state_dir, kid.pubkey) == blob
        assert (await opened.memory_address(kid.pubkey, "core")).author_pubkey == kid.pubkey

        # Depth never changes after an agent is made: removing its owner leaves it in place.
        await opened.destroy_agent(owner.pubkey)
        assert directory.agent(kid.pubkey).depth == 2  # type: ignore[union-attr]
        assert directory.agent(owner.pubkey) is None and directory.get(owner.pubkey) is not None
        assert directory.rename(owner.pubkey, "ghost") is None
        assert directory.enroll(owner.pubkey, "ghost") is None
        with pytest.raises(ValueError):
            directory.rename(kid.pubkey, "")
        with pytest.raises(ValueError):
            directory.rename("not-a-key", "x")
        with pytest.raises(ValueError):
            directory.enroll(kid.pubkey, "x", creator="nope")
    finally:
        directory.close()
        await opened.aclose()


def _names(state_dir: Path) -> set[str]:
    db = sqlite3.connect(state_dir / DIRECTORY_FILE)
    try:
        return {pubkey for (pubkey,) in db.execute("SELECT pubkey FROM names")}
    finally:
        db.close()


async def test_a_name_stays_with_its_record_and_goes_once_custody_has_none(
    custody_state: tuple[TokenConfig, Path],
) -> None:
    """A removed agent keeps its name (its tombstone is listed by it); a key whose record
    custody no longer has (a custodian's `--forget-destroyed`, beside the daemon) loses it
    at the next prune, unless the name is too recent for a custodian's records to be sure."""
    config, state_dir = custody_state
    opened = await Custody.open(config, state_dir)
    directory = AgentDirectory.open(state_dir)
    try:
        live, removed, forgotten, young = [
            (await opened.mint_agent(owner=HUMAN)).pubkey for _ in range(4)]
        now = 1_900_000_000
        for pubkey in (live, removed, forgotten):
            directory.enroll(pubkey, "n", now=now - PRUNE_AFTER_SECONDS - 1)
        directory.enroll(young, "n", now=now)
        for pubkey in (removed, forgotten, young):
            await opened.destroy_agent(pubkey)
        keystore = Keystore.open(state_dir)
        try:
            assert sorted(forget_named(keystore, [forgotten, young])) == sorted(
                [forgotten, young])
        finally:
            keystore.close()
        assert directory.prune(now) == 1
        assert _names(state_dir) == {live, removed, young}
        assert directory.get(removed).name == "n"  # type: ignore[union-attr]
        assert directory.prune(now + PRUNE_AFTER_SECONDS + 1) == 1
        assert _names(state_dir) == {live, removed}
    finally:
        directory.close()
        await opened.aclose()


def _blob(state_dir: Path, pubkey: str) -> bytes:
    db = sqlite3.connect(state_dir / "keystore.db")
    try:
        return bytes(db.execute("SELECT sealed FROM keys WHERE pubkey = ?", (pubkey,)).fetchone()[0])
    finally:
        db.close()


def test_a_missing_state_directory_reads_as_empty_and_is_not_created(tmp_path: Path) -> None:
    empty = AgentDirectory.open(tmp_path / "none")
    try:
        assert empty.agents(include_deleted=True) == [] and empty.get(HUMAN) is None
        assert empty.rename("b" * 64, "x") is None
    finally:
        empty.close()
    assert not (tmp_path / "none").exists()


#: A version-1 keystore as the release before the move wrote it (`agents` held the names),
#: made here from a real version-2 file so its sealed blobs are real.
TO_VERSION_1 = """
CREATE TABLE agents (
    pubkey TEXT PRIMARY KEY, owner TEXT NOT NULL, name TEXT NOT NULL, auth_tag TEXT,
    creator TEXT, depth INTEGER NOT NULL CHECK (depth >= 1), mint_ref TEXT UNIQUE,
    created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, deleted_at INTEGER,
    sealed BLOB, CHECK (owner <> pubkey), CHECK ((deleted_at IS NULL) = (sealed IS NOT NULL))
) STRICT;
CREATE INDEX agents_by_owner ON agents (owner, name);
INSERT INTO agents SELECT pubkey, owner, 'old-' || substr(pubkey, 1, 4), auth_tag, NULL, 1,
    mint_ref, created_at, updated_at, deleted_at, sealed FROM keys;
DROP TABLE reseal;
CREATE TABLE reseal (pubkey TEXT PRIMARY KEY REFERENCES agents (pubkey), sealed BLOB NOT NULL) STRICT;
DROP TABLE keys;
PRAGMA user_version=1;
"""


async def _version_1_keystore(config: TokenConfig, state_dir: Path) -> str:
    """A version-1 keystore in `state_dir` holding one agent named `old-<4 hex>`; its pubkey."""
    async with await Custody.open(config, state_dir) as opened:
        agent = (await opened.import_agent(bytearray(SECRET.encode()), owner=HUMAN)).pubkey
    db = sqlite3.connect(state_dir / "keystore.db", isolation_level=None)
    db.executescript(TO_VERSION_1)
    db.close()
    return agent


def _directory_rows(state_dir: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(state_dir / DIRECTORY_FILE)
    try:
        return db.execute("SELECT pubkey, name FROM names").fetchall()
    finally:
        db.close()


async def test_a_version_1_keystore_is_read_upgraded_and_its_names_carried_over(
    custody_state: tuple[TokenConfig, Path],
) -> None:
    config, state_dir = custody_state
    agent = await _version_1_keystore(config, state_dir)
    old_name = f"old-{agent[:4]}"

    # Before custody upgrades it: the directory reads the old table, and takes its names
    # into its own file at once (`AgentDirectory.open`).
    directory = AgentDirectory.open(state_dir)
    try:
        assert [(r.pubkey, r.name, r.depth) for r in directory.agents()] == [(agent, old_name, 1)]
    finally:
        directory.close()
    assert _directory_rows(state_dir) == [(agent, old_name)]
    (state_dir / DIRECTORY_FILE).unlink()  # as a host whose directory was never opened

    async with await Custody.open(config, state_dir) as opened:  # upgrades, in one transaction
        tables = {row[0] for row in sqlite3.connect(state_dir / "keystore.db").execute(
            "SELECT name FROM sqlite_schema WHERE type = 'table'")}
        assert {"keys", "v1_names", "custody_meta", "reseal"} <= tables and "agents" not in tables
        assert (await opened.memory_address(agent, "core")).author_pubkey == agent  # still opens
        version = sqlite3.connect(state_dir / "keystore.db").execute(
            "PRAGMA user_version").fetchone()[0]
        assert version == 2

    directory = AgentDirectory.open(state_dir)
    try:
        assert directory.agent(agent).name == old_name  # type: ignore[union-attr]
        # The directory's first write makes its file and takes the old names with it.
        renamed = directory.rename(agent, "new")
        assert renamed is not None and renamed.name == "new"
        assert _directory_rows(state_dir) == [(agent, "new")]
        assert (state_dir / DIRECTORY_FILE).stat().st_mode & 0o777 == 0o600
    finally:
        directory.close()


async def test_an_unreadable_directory_stops_the_start_with_one_line(
    custody_state: tuple[TokenConfig, Path], tmp_path: Path
) -> None:
    from daemon.config import load_config
    from daemon.wiring import StartupError, running
    from tests.fixtures.broker import write_config

    token, state_dir = custody_state
    state_dir.mkdir(mode=0o700, exist_ok=True)
    (state_dir / DIRECTORY_FILE).write_bytes(b"not a database, " * 512)
    config = load_config(str(write_config(
        tmp_path / "broker.toml", token=token, state_dir=state_dir,
        socket=tmp_path / "broker.sock", relay_url="ws://127.0.0.1:9")))
    with pytest.raises(StartupError) as raised:
        async with running(config):
            pass
    message = str(raised.value)
    assert message.startswith("agent directory: ") and DIRECTORY_FILE in message
    assert "\n" not in message


async def test_the_daemon_takes_a_version_1_keystores_names_into_the_directory_at_start(
    custody_state: tuple[TokenConfig, Path], tmp_path: Path
) -> None:
    """Opened the way serve opens it, a state directory from before names left custody has
    its directory file at once, names copied: it no longer waits for a first name written,
    which a host moving its keystore to a custodian (docs/install.md 6b) might never have."""
    from daemon.config import load_config
    from daemon.wiring import running
    from tests.fixtures.broker import write_config

    token, state_dir = custody_state
    agent = await _version_1_keystore(token, state_dir)
    config = load_config(str(write_config(
        tmp_path / "broker.toml", token=token, state_dir=state_dir,
        socket=tmp_path / "broker.sock", relay_url="ws://127.0.0.1:9")))
    async with running(config):
        assert _directory_rows(state_dir) == [(agent, f"old-{agent[:4]}")]
    assert (state_dir / DIRECTORY_FILE).stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="the rule is about commands run as root")
async def test_root_opening_the_daemons_directory_creates_nothing(
    custody_state: tuple[TokenConfig, Path],
) -> None:
    """The names are taken only by the state directory's owner (the daemon's user): root's
    `agent list` on the daemon's directory must not leave a file, root's 0600, that the
    daemon could not open; it reads them from the keystore, as before."""
    token, state_dir = custody_state
    agent = await _version_1_keystore(token, state_dir)
    os.chown(state_dir, NOBODY, NOBODY)
    directory = AgentDirectory.open(state_dir)
    try:
        assert directory.agent(agent).name == f"old-{agent[:4]}"  # type: ignore[union-attr]
    finally:
        directory.close()
    assert not (state_dir / DIRECTORY_FILE).exists()


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CREDENTIALS_DIRECTORY", "BUZZ_BROKER_CONFIG")}
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


async def test_names_from_before_version_2_survive_the_move_to_a_custodian(
    custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path
) -> None:
    """docs/install.md 6b on a host whose keystore is still version 1 (today's daemon never
    started there): the move block's first line, `agent list` as the daemon's user, takes
    the names into directory.db; the keystore then moves to a custodian, whose records
    carry no names, and `agent list` through it still shows them. The block itself runs on
    real systemd in tests/nspawn/test_real_systemd.py::
    test_a_host_that_ran_custody_in_the_daemon_moves_its_keys."""
    from tests.fixtures.broker import write_config
    from tests.fixtures.custodian import running_custodian

    token, state_dir = custody_state
    agent = await _version_1_keystore(token, state_dir)
    old_name = f"old-{agent[:4]}"
    in_process = write_config(tmp_path / "broker.toml", token=token, state_dir=state_dir,
                              socket=tmp_path / "broker.sock", relay_url=local_relay)
    before = _cli(in_process, "agent", "list")
    assert before.returncode == 0 and before.stdout.split()[-1] == old_name, before.stderr

    keys = tmp_path / "custodian" / "keys"
    keys.mkdir(mode=0o700, parents=True)
    for moved in state_dir.glob("keystore.db*"):  # the block's mv
        moved.rename(keys / moved.name)
    through = tmp_path / "through.toml"
    with running_custodian((token, keys), local_relay, tmp_path / "custodian") as custodian:
        through.write_text(
            f'[server]\nsocket = "{tmp_path / "broker.sock"}"\n[state]\ndir = "{state_dir}"\n'
            f'[custody]\ncustodian_socket = "{custodian.socket}"\n[relay]\nurl = "{local_relay}"\n')
        after = _cli(through, "agent", "list", "--json")
    assert after.returncode == 0, after.stderr
    assert [(r["pubkey"], r["name"]) for r in map(json.loads, after.stdout.splitlines())] == [
        (agent, old_name)]
