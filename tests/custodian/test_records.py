"""The pipeline's copy of the custodian's records (custody/custodian/records.py): reads
answer from it; untended (a command), a read asks the version at a bounded rate, and at
once after a lifecycle call, a fault or a reconnect; tended (the daemon), reads never ask,
its task does, and a fault leaves the last snapshot served.

Pure: a counting source stands in for the socket and a settable clock (untended) or trio's
autojump clock (tended) for time; the socket itself is the e2e flows' (test_pipeline.py),
the SIGKILL test's (test_recovery.py) and the SIGSTOP tests' (test_stopped_custodian.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from custody._keystore import KeyRecord
from custody.custodian.client import CustodianUnavailable
from custody.custodian.records import RECHECK_SECONDS, RecordCache

A, B, C = "a" * 64, "b" * 64, "c" * 64


def _record(pubkey: str, owner: str, deleted_at: int | None = None,
            mint_ref: str | None = None) -> KeyRecord:
    return KeyRecord(pubkey=pubkey, owner=owner, auth_tag=None, created_at=1,
                     deleted_at=deleted_at, mint_ref=mint_ref)


@dataclass
class Source:
    """The blocking asks (`ask_*`) and the async ones (`fetch_*`), each noted in `asked`."""

    version: int = 1
    records: list[KeyRecord] = field(default_factory=list)
    connections: int = 1
    asked: list[str] = field(default_factory=list)
    down: bool = False
    #: the next fetch_version reads the version, then waits for this before answering
    gate: trio.Event | None = None

    def ask_version(self) -> tuple[int, object]:
        self.asked.append("records_version")
        if self.down:
            raise CustodianUnavailable("down")
        return self.version, self.connections

    def ask_records(self) -> list[KeyRecord]:
        self.asked.append("agents")
        return list(self.records)

    async def fetch_version(self) -> tuple[int, object]:
        self.asked.append("fetch records_version")
        answer = self.version, self.connections
        gate, self.gate = self.gate, None
        if gate is not None:
            await gate.wait()
        await trio.lowlevel.checkpoint()
        if self.down:
            raise CustodianUnavailable("down")
        return answer

    async def fetch_records(self) -> list[KeyRecord]:
        self.asked.append("fetch agents")
        await trio.lowlevel.checkpoint()
        return list(self.records)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reads_answer_from_the_snapshot_asking_the_version_at_a_bounded_rate() -> None:
    source, clock = Source(records=[_record(A, B), _record(B, C, mint_ref="m")]), Clock()
    cache = RecordCache(source, clock)
    for _ in range(1000):
        assert cache.get(A) is not None
        assert cache.version() == 1
    assert cache.chain(A) == [_record(A, B), _record(B, C, mint_ref="m")]
    assert cache.by_mint_ref("m") == _record(B, C, mint_ref="m")
    assert source.asked == ["records_version", "agents"]  # 2,000 reads, one check
    source.records.append(_record(C, A, deleted_at=5))
    source.version = 2
    clock.now += RECHECK_SECONDS / 2
    assert cache.get(C) is None  # not yet asked: another process's change is unseen
    clock.now += RECHECK_SECONDS
    assert cache.get(C) == _record(C, A, deleted_at=5)
    assert [r.pubkey for r in cache.all()] == [A, B]
    assert len(cache.all(include_deleted=True)) == 3
    assert source.asked == ["records_version", "agents", "records_version", "agents"]
    clock.now += RECHECK_SECONDS
    cache.get(A)
    assert source.asked[-1] == "records_version"  # same version: no listing


def test_expire_and_a_reconnect_ask_at_once_and_a_fault_is_raised_every_time() -> None:
    source, clock = Source(records=[_record(A, B)]), Clock()
    cache = RecordCache(source, clock)
    cache.get(A)
    source.records.append(_record(B, C))
    source.version = 2
    cache.expire()  # the pipeline's own mint, say
    assert cache.get(B) is not None
    source.records.append(_record(C, A))
    source.connections += 1  # a new custodian may count from the same number again
    cache.expire()
    assert cache.get(C) is not None and source.asked.count("agents") == 3
    source.down = True
    cache.expire()
    for _ in range(2):  # no stale answer while it is gone
        with pytest.raises(CustodianUnavailable):
            cache.get(A)
    source.down = False
    assert cache.get(A) is not None


# --- tended: the daemon's task keeps it, reads never ask -----------------------------------


class Untouchable(Source):
    """A source whose blocking asks fail the test: a tended read must never reach them."""

    def ask_version(self) -> tuple[int, object]:
        raise AssertionError("a tended read asked the custodian")

    def ask_records(self) -> list[KeyRecord]:
        raise AssertionError("a tended read asked the custodian")


async def test_tended_reads_never_ask_and_the_task_keeps_the_snapshot_fresh(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    source = Untouchable(records=[_record(A, B)])
    cache = RecordCache(source)
    await nursery.start(cache.run)
    for _ in range(1000):
        assert cache.get(A) is not None and cache.version() == 1
    source.records.append(_record(B, C))
    source.version = 2
    assert cache.get(B) is None  # another process's change: unseen until the task checks
    await trio.sleep(2 * RECHECK_SECONDS)
    assert cache.get(B) == _record(B, C) and cache.version() == 2
    checks = source.asked.count("fetch records_version")
    await trio.sleep(10.0)  # the task's rate, whatever the reads: one check a period
    assert source.asked.count("fetch records_version") - checks <= 10.0 / RECHECK_SECONDS + 1
    assert source.asked.count("fetch agents") == 2  # listed only when the version moved
    before, now = len(source.asked), trio.current_time()
    cache.expire()  # a fault of the client's: the task checks at once
    while len(source.asked) == before:
        await trio.lowlevel.checkpoint()  # never idle: the mock clock stands still
    assert source.asked[before:] == ["fetch records_version"] and trio.current_time() == now


async def test_a_fault_while_tended_keeps_the_last_snapshot_and_a_reconnect_lists_again(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock,
        caplog: pytest.LogCaptureFixture) -> None:
    source = Untouchable(version=7, records=[_record(A, B)])
    cache = RecordCache(source)
    await nursery.start(cache.run)
    first = cache.version()
    source.down = True
    with caplog.at_level(logging.INFO, logger="buzz_broker.custodian.records"):
        await trio.sleep(20 * RECHECK_SECONDS)
        for _ in range(3):  # the last snapshot, no fault raised to the reader
            assert cache.get(A) == _record(A, B) and cache.version() == first
        # A custodian that restarted counts from scratch: the same number, other records,
        # over a new connection.
        source.records = [_record(A, B, deleted_at=9), _record(C, A)]
        source.connections += 1
        source.down = False
        await trio.sleep(2 * RECHECK_SECONDS)
    assert cache.get(A) == _record(A, B, deleted_at=9) and cache.get(C) is not None
    assert cache.version() != first  # though the custodian's number is 7 again
    said = [r.levelno for r in caplog.records if r.name == "buzz_broker.custodian.records"]
    assert said == [logging.WARNING, logging.INFO]  # once when it went, once when back


async def test_before_the_first_snapshot_a_tended_read_raises_unavailable(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    source = Untouchable(records=[_record(A, B)], down=True)
    cache = RecordCache(source)
    await nursery.start(cache.run)
    for read in (lambda: cache.get(A), lambda: cache.version(), lambda: cache.all()):
        with pytest.raises(CustodianUnavailable):  # never "no such agent"
            read()
    source.down = False
    await trio.sleep(2 * RECHECK_SECONDS)
    assert cache.get(A) == _record(A, B)


async def test_a_lifecycle_call_returns_after_a_check_begun_after_its_answer(
        nursery: trio.Nursery) -> None:
    source = Untouchable(records=[_record(A, B)])
    cache = RecordCache(source)
    await cache.refreshed()
    cache.tend()  # as the daemon; its task is not needed for this
    gate = source.gate = trio.Event()
    nursery.start_soon(cache.refreshed)  # a check under way, that asked before the change
    await trio.testing.wait_all_tasks_blocked()
    source.records.append(_record(B, C))  # the change a lifecycle call just made
    source.version = 2
    seen: list[KeyRecord | None] = []

    async def after_the_call() -> None:
        await cache.changed()
        seen.append(cache.get(B))

    for _ in range(2):
        nursery.start_soon(after_the_call)
    await trio.testing.wait_all_tasks_blocked()
    assert seen == []  # not the check that was under way
    gate.set()
    await trio.testing.wait_all_tasks_blocked()
    assert seen == [_record(B, C), _record(B, C)]
    # one check at start, the one under way, and one more shared by both callers
    assert source.asked.count("fetch records_version") == 3


@pytest.mark.parametrize("listing", [[{"pubkey": A}], [{"pubkey": A, "owner": B, "auth_tag": 5,
                                                        "created_at": 1, "deleted_at": None,
                                                        "mint_ref": None}], [7]])
def test_a_listing_that_breaks_the_table_is_unavailable_not_a_crash(listing: list[object]
                                                                     ) -> None:
    # In the daemon it is raised in the records task, which keeps the last snapshot on a
    # CustodyError; anything else would end the daemon.
    from custody.custodian.client import _records

    with pytest.raises(CustodianUnavailable):
        _records(listing)
