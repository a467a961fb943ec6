"""The public agent directory (daemon/state/directory.py): out of custody, the depth rule
stated once, renames that never touch a sealed key, and keystores written before it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import custody
from custody import Custody, TokenConfig
from custody._keystore import AgentRecord, Keystore
from daemon.state.directory import HUMAN_OWNED_DEPTH, AgentDirectory, child_depth

HUMAN = "a" * 64
#: The keystore's schema as written before the directory left custody (schema version 1),
#: frozen here: the directory must read and rename such a file in place.
BEFORE_THE_MOVE = """
PRAGMA journal_mode=WAL;
CREATE TABLE agents (
    pubkey TEXT PRIMARY KEY, owner TEXT NOT NULL, name TEXT NOT NULL, auth_tag TEXT,
    creator TEXT, depth INTEGER NOT NULL CHECK (depth >= 1), mint_ref TEXT UNIQUE,
    created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, deleted_at INTEGER,
    sealed BLOB, CHECK (owner <> pubkey), CHECK ((deleted_at IS NULL) = (sealed IS NOT NULL))
) STRICT;
CREATE INDEX agents_by_owner ON agents (owner, name);
CREATE TABLE custody_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT;
CREATE TABLE reseal (pubkey TEXT PRIMARY KEY REFERENCES agents (pubkey), sealed BLOB NOT NULL) STRICT;
PRAGMA user_version=1;
"""
SECRET = "11" * 32


def _record(depth: int, deleted_at: int | None) -> AgentRecord:
    return AgentRecord(pubkey="b" * 64, owner=HUMAN, name="n", auth_tag=None, creator=None,
                       depth=depth, created_at=1, deleted_at=deleted_at)


#: owner record -> the depth of an agent it owns
DEPTHS: list[tuple[AgentRecord | None, int]] = [
    (None, HUMAN_OWNED_DEPTH),          # owner not held here: a person
    (_record(1, None), 2),              # owned by a human-owned agent
    (_record(3, None), 4),
    (_record(2, 1_700_000_000), HUMAN_OWNED_DEPTH),  # a removed owner holds no place
]


@pytest.mark.parametrize(("owner", "depth"), DEPTHS)
def test_child_depth_is_the_one_rule(owner: AgentRecord | None, depth: int) -> None:
    assert child_depth(owner) == depth


def test_custody_offers_no_directory_and_derives_no_depth() -> None:
    """Names, renames and listing without the token left custody's surface; import takes
    the depth it is told (a missing one is a caller's bug, not a default)."""
    assert not hasattr(custody, "PublicDirectory")
    assert not hasattr(Custody, "rename_agent")
    assert not hasattr(Keystore, "rename")


async def test_directory_reads_and_renames_what_custody_wrote(
    custody_state: tuple[TokenConfig, Path],
) -> None:
    config, state_dir = custody_state
    opened = await Custody.open(config, state_dir)
    directory = AgentDirectory.open(state_dir)
    try:
        owner = await opened.import_agent(bytearray(SECRET.encode()), owner=HUMAN,
                                          depth=child_depth(directory.agent(HUMAN)), name="o")
        kid = await opened.mint_agent(owner=owner.pubkey, name="kid", creator=owner.pubkey,
                                      depth=child_depth(directory.agent(owner.pubkey)),
                                      mint_ref="ref-1")
        assert (owner.depth, kid.depth) == (1, 2)
        assert [r.pubkey for r in directory.agents()] == [r.pubkey for r in opened.agents()]
        assert directory.by_mint_ref("ref-1") == kid

        blob = sqlite3.connect(state_dir / "keystore.db").execute(
            "SELECT sealed FROM agents WHERE pubkey = ?", (kid.pubkey,)).fetchone()[0]
        version = opened.records_version()
        renamed = directory.rename(kid.pubkey, "kid-2")
        assert renamed is not None and renamed.name == "kid-2"
        # Custody sees the rename at once (the broker's liveness cache keys on this) ...
        assert opened.records_version() != version
        assert opened.agent(kid.pubkey) is not None
        assert opened.agent(kid.pubkey).name == "kid-2"  # type: ignore[union-attr]
        # ... and the sealed key is untouched: the agent still signs.
        assert sqlite3.connect(state_dir / "keystore.db").execute(
            "SELECT sealed FROM agents WHERE pubkey = ?", (kid.pubkey,)).fetchone()[0] == blob
        assert (await opened.memory_address(kid.pubkey, "core")).author_pubkey == kid.pubkey

        await opened.destroy_agent(kid.pubkey)
        assert directory.rename(kid.pubkey, "ghost") is None
        tomb = directory.get(kid.pubkey)
        assert tomb is not None and tomb.name == "kid-2" and not tomb.live
        assert directory.agent(kid.pubkey) is None
        assert {r.pubkey for r in directory.agents(include_deleted=True)} == {owner.pubkey, kid.pubkey}
        with pytest.raises(ValueError):
            directory.rename(owner.pubkey, "")
        with pytest.raises(ValueError):
            directory.rename("not-a-key", "x")
    finally:
        directory.close()
        await opened.aclose()


def test_a_keystore_from_before_the_directory_opens_unchanged(tmp_path: Path) -> None:
    """State directories written before the move: the same `agents` table, read and renamed
    in place (no migration), and a missing keystore reads as empty and is not created."""
    empty = AgentDirectory.open(tmp_path / "none")
    assert empty.agents(include_deleted=True) == [] and empty.get(HUMAN) is None
    assert empty.rename("b" * 64, "x") is None
    assert not (tmp_path / "none").exists()

    state = tmp_path / "state"
    state.mkdir()
    record = _record(1, None)
    db = sqlite3.connect(state / "keystore.db", isolation_level=None)
    db.executescript(BEFORE_THE_MOVE)
    db.execute("INSERT INTO agents (pubkey, owner, name, auth_tag, creator, depth, mint_ref,"
               " created_at, updated_at, deleted_at, sealed)"
               " VALUES (?, ?, 'n', NULL, NULL, 1, NULL, 1, 1, NULL, ?)",
               (record.pubkey, HUMAN, b"sealed-bytes"))
    db.close()
    directory = AgentDirectory.open(state)
    try:
        assert directory.agents() == [record]
        assert directory.rename(record.pubkey, "renamed") == AgentRecord(
            pubkey=record.pubkey, owner=HUMAN, name="renamed", auth_tag=None, creator=None,
            depth=1, created_at=1, deleted_at=None)
    finally:
        directory.close()
    sealed = sqlite3.connect(state / "keystore.db").execute("SELECT sealed FROM agents").fetchone()
    assert sealed == (b"sealed-bytes",)
