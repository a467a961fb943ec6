"""daemon.peer_shares and daemon.fault_log: the bookkeeping behind the HTTP layer's bounds."""

from __future__ import annotations

import io
import json
import logging

import pytest
import trio
import trio.testing

from daemon.fault_log import FaultLog
from daemon.peer_shares import ByteBudget, ConnectionCounts
from tests.adversarial.test_http_faults import captured_log  # noqa: F401 - the log fixture


async def test_one_uid_alone_holds_half_and_leaves_a_share_for_another() -> None:
    budget = ByteBudget(1000)
    await budget.reserve(1, 300)
    await budget.reserve(1, 200)  # 500 = total // (1 holder + 1)
    assert not budget.fits(1, 1)
    # Another uid holding nothing gets in at once, though uid 1 is at its share.
    with trio.fail_after(1):
        await budget.reserve(2, 300)
    assert budget.used == 800
    # Two holders: a share is 1000 // 3, and uid 1 (500) is over it; a third uid asking
    # would make it 1000 // 4 (one share always kept for a uid not yet holding).
    assert budget.share(1) == 333 and not budget.fits(1, 1) and budget.share(3) == 250


async def test_a_waiting_reservation_proceeds_when_bytes_are_released() -> None:
    budget = ByteBudget(1000)
    await budget.reserve(1, 500)
    got = trio.Event()

    async def second() -> None:
        await budget.reserve(1, 400)
        got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.sleep(0.05)
        assert not got.is_set()  # back-pressure: it waits
        budget.release(1, 500)
        with trio.fail_after(1):
            await got.wait()
    assert budget.held(1) == 400


def test_budget_refuses_impossible_and_unbalanced_use() -> None:
    budget = ByteBudget(100)
    with pytest.raises(ValueError):
        budget.release(1, 1)
    with pytest.raises(ValueError):
        trio.run(budget.reserve, 1, 101)


def test_connection_counts_cap_per_uid() -> None:
    counts = ConnectionCounts(2)
    assert counts.try_open(7) and counts.try_open(7) and not counts.try_open(7)
    assert counts.try_open(8)  # another uid is not affected
    counts.close(7)
    assert counts.try_open(7) and counts.open(7) == 2


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_fault_log_writes_once_per_cause_per_interval(captured_log: io.StringIO) -> None:
    now = [0.0]
    faults = FaultLog(logging.getLogger("buzz_broker.test"), "fault", interval=60,
                      clock=lambda: now[0])
    assert faults.record(("a",), kind="a")
    for _ in range(1000):
        assert not faults.record(("a",), kind="a")
    assert faults.record(("b",), kind="b")  # another cause has its own line
    now[0] = 61.0
    assert faults.record(("a",), kind="a")
    lines = _lines(captured_log)
    assert [line["kind"] for line in lines] == ["a", "b", "a"]
    assert lines[2]["suppressed"] == 1000 and faults.total == 1003


def test_fault_log_causes_are_a_bounded_set(captured_log: io.StringIO) -> None:
    faults = FaultLog(logging.getLogger("buzz_broker.test"), "fault", max_causes=4,
                      clock=lambda: 0.0)
    for n in range(1000):
        faults.record(("uid", n), uid=n)
    # Four causes of their own, then everything shares "other": five lines for 1,000 causes.
    assert len(_lines(captured_log)) == 5


def test_fault_log_forgets_a_quiet_cause_when_its_table_is_full(
    captured_log: io.StringIO,
) -> None:
    # A long-lived daemon meets more causes (agents, uids) than the table holds: the
    # first ones seen must not keep the table full for ever, every later cause sharing
    # "other". One quiet for an interval with nothing counted is forgotten; one with a
    # count still to report is kept.
    now = [0.0]
    faults = FaultLog(logging.getLogger("buzz_broker.test"), "fault", max_causes=2,
                      interval=60, clock=lambda: now[0])
    assert faults.record(("a",)) and faults.record(("b",))
    assert not faults.record(("b",))  # b has a count to report
    assert faults.record(("c",))  # "other"
    now[0] = 61.0
    assert faults.record(("e",), kind="e")  # a was quiet: forgotten, e has its own line
    assert faults.record(("b",), kind="b")  # b was kept, and reports its count
    lines = _lines(captured_log)
    assert lines[-2]["kind"] == "e" and "suppressed" not in lines[-2]
    assert lines[-1]["kind"] == "b" and lines[-1]["suppressed"] == 1
    assert faults.total == 6


async def test_a_reservation_of_the_whole_budget_fits_an_empty_budget() -> None:
    """max_inflight_bytes may equal max_body_bytes (the config allows it): a body of that
    size must fit the empty budget, else it waits until its 408 every time."""
    budget = ByteBudget(100)
    with trio.fail_after(1):
        await budget.reserve(1, 100)
    assert budget.used == 100 and budget.held(1) == 100
    assert not budget.fits(2, 1)


async def test_a_uid_holding_nothing_takes_a_request_larger_than_its_share() -> None:
    """A uid holding nothing may always take one reservation that fits in what is free, so
    a share smaller than one request never wedges it."""
    budget = ByteBudget(1000)
    await budget.reserve(2, 100)
    await budget.reserve(3, 100)
    assert budget.share(1) == 250
    with trio.fail_after(1):
        await budget.reserve(1, 600)
    assert budget.held(1) == 600
    # Holding something, it is held to its share again.
    assert not budget.fits(1, 1)


def test_connection_counts_forget_a_key_with_nothing_open() -> None:
    """Credential keys are digests of whatever a client sends: a key whose last connection
    closed is dropped, so the table is bounded by the connections open, not by the keys
    ever seen."""
    counts = ConnectionCounts(2)
    for key in range(1000):
        assert counts.try_open(key)
        counts.close(key)
    assert counts._open == {}


async def test_a_uid_holding_nothing_still_waits_when_the_budget_is_spent() -> None:
    """The total is a hard bound: a uid holding nothing gets in at once only if its
    reservation fits in what is free; else it waits like any other."""
    budget = ByteBudget(1000)
    await budget.reserve(1, 500)
    await budget.reserve(2, 400)
    got = trio.Event()

    async def third() -> None:
        await budget.reserve(3, 200)
        got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(third)
        await trio.testing.wait_all_tasks_blocked()
        assert not got.is_set() and budget.used == 900
        budget.release(2, 400)
        with trio.fail_after(1):
            await got.wait()
    assert budget.used == 700 <= budget.total
