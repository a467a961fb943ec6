"""The runtime record and the revocation of a removed agent's credentials are written off
the event loop (issue 22, L6).

Each write commits with `synchronous=FULL`, so it blocks for an fsync: on the loop it
stalls every connection the daemon serves for as long as the disk takes. Proven against
the daemon in this process (real token, real LocalRelay, real socket) by recording which
thread each write ran in, for every path that makes one: agents.create (the runtime, after
publishing), agents.update with only a new runtime (written by the operation itself),
agents.update with a new name and runtime (after publishing), and agents.delete (the
revocation). Then each write is checked to have happened. And the minute's last-use write,
with the database locked by another writer: the loop goes on answering while it waits.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon import wiring
from daemon.state.runtimes import RuntimeStore
from daemon.state.sessions import SessionStore
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

    monkeypatch.setattr(RuntimeStore, "set", set_spy)
    monkeypatch.setattr(SessionStore, "revoke_agent", revoke_spy)

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
    await ok("agents.delete", {"target": {"pubkey": kid}})

    assert [name for name, _ in writes] == ["runtime", "runtime", "runtime", "revoke"]
    assert [on_loop for _, on_loop in writes] == [False] * 4, writes
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
