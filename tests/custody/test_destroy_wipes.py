"""Destroying an agent leaves none of its sealed blob in the keystore's files.

Security finding 2: the tombstone's UPDATE left the old blob in keystore.db-wal and in the
page's free space. The keystore now runs with secure_delete and truncates the WAL after a
destroy; a reader that blocks the truncation gets a warning, never a failed destroy.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import coincurve
import pytest

from custody import Custody, TokenConfig, UnknownAgent, UnsignedEvent, verify_event
from tests.security._support import raw_files, sealed_blob

HUMAN = coincurve.PrivateKey(b"\x02" * 32).public_key_xonly.format().hex()


async def _import(c: Custody, name: str) -> str:
    text = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
    return (await c.import_agent(text, owner=HUMAN)).pubkey


async def test_destroying_one_agent_among_many_leaves_only_its_blob_gone(
    custody: Custody, custody_state: tuple[TokenConfig, Path]
) -> None:
    _, state_dir = custody_state
    agents = [await _import(custody, f"a{i}") for i in range(6)]
    blobs = {a: sealed_blob(state_dir, a) for a in agents}
    victim = agents[2]  # a row in the middle of the page, neighbours on both sides
    await custody.destroy_agent(victim)
    files = raw_files(state_dir)
    victim_blob = blobs[victim]
    assert victim_blob is not None and victim_blob[13:] not in files
    assert (state_dir / "keystore.db-wal").stat().st_size == 0  # truncated by the checkpoint
    for agent in agents:
        if agent == victim:
            with pytest.raises(UnknownAgent):
                await custody.sign_event(agent, UnsignedEvent(agent, 1, 1, (), "x"))
            continue
        blob = blobs[agent]
        assert blob is not None and blob[13:] in files  # the neighbours are untouched
        signed = await custody.sign_event(agent, UnsignedEvent(agent, 1, 1, (), "x"))
        assert verify_event(signed.to_json_obj())


async def test_a_reader_blocking_the_checkpoint_is_logged_and_the_destroy_holds(
    custody: Custody, custody_state: tuple[TokenConfig, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, state_dir = custody_state
    agent = await _import(custody, "held")
    other = await _import(custody, "other")
    reader = sqlite3.connect(state_dir / "keystore.db", isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM keys").fetchone()  # holds an old snapshot
        with caplog.at_level(logging.WARNING, logger="buzz_broker.custody"):
            record = await custody.destroy_agent(agent)
        assert record.deleted_at is not None
        assert any("checkpoint" in r.getMessage() for r in caplog.records)
    finally:
        reader.close()
    assert sealed_blob(state_dir, agent) is None
    # The next destroy, with no reader in the way, truncates the WAL as usual.
    blob = sealed_blob(state_dir, other)
    await custody.destroy_agent(other)
    assert blob is not None and blob[13:] not in raw_files(state_dir)
