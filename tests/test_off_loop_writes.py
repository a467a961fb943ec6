"""The runtime record, the revocation of a removed agent's credentials and the watermark of
each replaceable event published are written off the event loop (issue 22, L6).

Each write commits with `synchronous=FULL`, so it blocks for an fsync: on the loop it
stalls every connection the daemon serves for as long as the disk takes. Proven against
the daemon in this process (real token, real LocalRelay, real socket) by recording which
thread each write ran in, for every path that makes one: agents.create (the runtime, after
publishing), agents.update with only a new runtime (written by the operation itself),
agents.update with a new name and runtime (after publishing), and agents.delete (the
revocation, and the deleted key's watermarks dropped), with the watermark of every kind 0
and 30177 they publish. Then each write is
checked to have happened. And the minute's last-use write, with the database locked by
another writer: the loop goes on answering while it waits. And the watermark write with
watermarks.db locked: storage.put and profile.set answer `succeeded` (the relay took the
event), the lost write is logged, and the next profile.set builds on the version it missed.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon import wiring
from daemon.state import _sqlite
from daemon.state.runtimes import RuntimeStore
from daemon.state.sessions import SessionStore
from daemon.state.sign_watermarks import WATERMARKS_DB, SignWatermarks, Watermark
from tests.fixtures.broker import BrokerHarness


async def test_runtime_and_revocation_writes_run_in_worker_threads(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()
    writes: list[tuple[str, bool]] = []
    real_set, real_revoke = RuntimeStore.set, SessionStore.revoke_agent

    def set_spy(self: RuntimeStore, *args: Any) -> None:
        writes.append(("runtime", threading.get_ident() == loop_thread))
        real_set(self, *args)

    def revoke_spy(self: SessionStore, *args: Any, **kwargs: Any) -> int:
        writes.append(("revoke", threading.get_ident() == loop_thread))
        return real_revoke(self, *args, **kwargs)

    marks: list[tuple[str, int, bool]] = []
    real_record = SignWatermarks.record

    def record_spy(self: SignWatermarks, agent: str, kind: int, *args: Any) -> None:
        marks.append((agent, kind, threading.get_ident() == loop_thread))
        real_record(self, agent, kind, *args)

    real_prune = SignWatermarks.prune

    def prune_spy(self: SignWatermarks, *args: Any) -> int:
        writes.append(("prune", threading.get_ident() == loop_thread))
        return real_prune(self, *args)

    monkeypatch.setattr(RuntimeStore, "set", set_spy)
    monkeypatch.setattr(SessionStore, "revoke_agent", revoke_spy)
    monkeypatch.setattr(SignWatermarks, "record", record_spy)
    monkeypatch.setattr(SignWatermarks, "prune", prune_spy)

    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])

    async def ok(action: str, args: dict[str, Any]) -> dict[str, Any]:
        answer = await broker.call(cred, action, args)
        assert answer["status"] == "succeeded", answer
        return answer

    made = await ok("agents.create", {"channelId": channel, "displayName": "kid",
                                      "systemPrompt": "p", "runtime": "goose"})
    kid = made["outcome"]["agentPubkey"]
    kid_cred = broker.credential(kid, [channel], actions=["storage.address"])
    await ok("agents.update", {"target": {"pubkey": kid}, "runtime": "codex"})
    assert broker.app.runtimes.get(kid) == "codex"
    await ok("agents.update", {"target": {"pubkey": kid}, "displayName": "kid2",
                               "runtime": "goose"})
    assert broker.app.runtimes.get(kid) == "goose"
    store = broker.app._relay.watermarks
    assert store is not None and store.get(owner, 30177, kid) is not None
    await ok("agents.delete", {"target": {"pubkey": kid}})

    # agents.delete: the revocation, then the kid's watermarks go with its key (`prune`).
    assert [name for name, _ in writes] == ["runtime", "runtime", "runtime", "revoke",
                                            "prune"]
    assert [on_loop for _, on_loop in writes] == [False] * 5, writes
    # create: the kid's kind 0 and the owner's 30177; update with a name: both again.
    assert sorted((a, k) for a, k, _ in marks) == sorted(
        [(kid, 0), (owner, 30177)] * 2), marks
    assert not any(on_loop for _, _, on_loop in marks), marks
    assert store.get(owner, 30177, kid) is None and store.get(kid, 0, "") is None
    # The revocation, written on another connection, holds from the next request on.
    refused = await broker.call(kid_cred, "storage.address", {"slug": "core"})
    assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthenticated")


async def test_last_use_is_written_in_a_worker_thread_and_a_locked_database_stops_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The minute's last-use write commits with an fsync, and waits up to the busy timeout
    # behind another writer (here an operator's sqlite3 holding the write lock). On the
    # loop, that wait stopped every connection; now the loop goes on serving meanwhile.
    store = SessionStore.open(tmp_path)
    _, token = store.issue(agent="ab" * 32, channels=frozenset({str(uuid.uuid4())}),
                           actions=frozenset({"channel.read"}), ttl_seconds=None, uid=None,
                           now=1_800_000_000)
    loop_thread = threading.get_ident()
    entered = threading.Event()
    threads: list[bool] = []
    real_write = SessionStore.write_last_use

    def write_spy(self: SessionStore, noted: dict[str, int]) -> None:
        threads.append(threading.get_ident() == loop_thread)
        entered.set()
        real_write(self, noted)

    monkeypatch.setattr(SessionStore, "write_last_use", write_spy)
    monkeypatch.setattr(wiring, "LAST_USE_FLUSH_SECONDS", 0.01)
    holder = sqlite3.connect(tmp_path / "sessions.db", isolation_level=None)
    reader = sqlite3.connect(tmp_path / "sessions.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        assert store.authenticate(f"Bearer {token}", None, 1_800_000_001) is not None
        with trio.fail_after(30):  # a hang guard, not a measurement
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wiring._flush_last_use_forever, store)
                while not entered.is_set():
                    await trio.sleep(0.01)
                # The write waits on the lock in its thread; the loop answers requests.
                for _ in range(10):
                    assert store.authenticate(f"Bearer {token}", None,
                                              1_800_000_002) is not None
                    await trio.sleep(0.01)
                assert reader.execute("SELECT last_used_at FROM credentials"
                                      ).fetchall() == [(None,)]
                holder.execute("COMMIT")
                while reader.execute("SELECT last_used_at FROM credentials"
                                     ).fetchall() != [(1_800_000_001,)]:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        assert threads and not any(threads), threads
    finally:
        holder.close()
        reader.close()
        store.close()
    # What the loop noted while the write waited is written at close.
    check = sqlite3.connect(tmp_path / "sessions.db")
    try:
        assert check.execute("SELECT last_used_at FROM credentials").fetchall() == [
            (1_800_000_002,)]
    finally:
        check.close()


async def test_a_locked_watermarks_db_changes_no_verdict_and_loses_no_later_version(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An operator's sqlite3 (or a backup tool) holds the write lock on watermarks.db. The
    # write of each version's watermark waits the busy timeout (shortened here) in its
    # thread and fails; the relay took the event, so the verdict is `succeeded`, and the
    # failure is one log line. On the loop, it stalled every client and answered
    # `indeterminate` + `internal`.
    monkeypatch.setattr(_sqlite, "BUSY_TIMEOUT_MS", 200)
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent("a")
    cred = broker.credential(agent, [channel])
    store = broker.app._relay.watermarks
    assert store is not None

    async def ok(action: str, args: dict[str, Any]) -> dict[str, Any]:
        answer = await broker.call(cred, action, args)
        assert answer["status"] == "succeeded", answer
        return answer

    first = (await ok("profile.set", {"about": "one"}))["outcome"]
    assert store.get(agent, 0, "") == Watermark(first["createdAt"], first["eventId"])

    holder = sqlite3.connect(broker.state_dir / WATERMARKS_DB, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with caplog.at_level(logging.WARNING, logger="buzz_broker"):
            await ok("storage.put", {"slug": "mem/two", "value": "v2"})
            await ok("profile.set", {"about": "two"})
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    lines = [getattr(r, "buzz_fields", {}) for r in caplog.records
             if getattr(r, "buzz_event", None) == "relay_watermark_unrecorded"]
    assert [(f["agent"], f["kind"], f["error"]) for f in lines] == [
        (agent, 0, "OperationalError")], lines
    assert all(r.exc_info is None for r in caplog.records), "no traceback"
    # The lost write left the floor where it was: never lower, and no later version
    # is refused for it (the relay's newest, "two", is later than the floor).
    assert store.get(agent, 0, "") == Watermark(first["createdAt"], first["eventId"])
    got = await ok("storage.get", {"slug": "mem/two"})
    assert got["outcome"]["value"] == "v2"
    third = (await ok("profile.set", {"about": "three"}))["outcome"]
    assert store.get(agent, 0, "") == Watermark(third["createdAt"], third["eventId"])
