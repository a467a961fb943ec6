"""The group-commit engine the ledger and the audit log share: order, batching, one
caller's failure, a flush that raises, and cancellation while waiting."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from daemon.state._group_commit import Failed, GroupCommit


class Recorder:
    """A flush that answers each item doubled, refuses negative items, and remembers batches."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()

    def flush(self, batch: Sequence[int]) -> list[int | Failed]:
        self.gate.wait()
        self.batches.append(list(batch))
        return [Failed(ValueError(i)) if i < 0 else 2 * i for i in batch]


def engine(recorder: Recorder) -> GroupCommit[int, int]:
    return GroupCommit(recorder.flush, flush_failed=lambda: RuntimeError("flush failed"))


async def test_a_lone_caller_gets_its_result() -> None:
    recorder = Recorder()
    assert await engine(recorder).submit(21) == 42
    assert recorder.batches == [[21]]


async def test_concurrent_callers_share_batches_in_call_order() -> None:
    recorder = Recorder()
    group = engine(recorder)
    results: dict[int, int] = {}
    called: list[int] = []  # trio starts tasks in no fixed order

    async def one(i: int) -> None:
        called.append(i)  # no checkpoint between this and the item being queued
        results[i] = await group.submit(i)

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(one, i)
    assert results == {i: 2 * i for i in range(50)}
    assert [i for batch in recorder.batches for i in batch] == called
    assert len(recorder.batches) < 50
    assert group.idle


async def test_a_failed_item_fails_only_its_caller() -> None:
    recorder = Recorder()
    group = engine(recorder)
    outcomes: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = await group.submit(i)
        except ValueError as exc:
            outcomes[i] = exc.args

    async with trio.open_nursery() as nursery:
        for i in (1, -2, 3):
            nursery.start_soon(one, i)
    assert outcomes == {1: 2, -2: (-2,), 3: 6}


async def test_a_flush_that_raises_answers_everyone_queued() -> None:
    calls: list[int] = []

    def broken(batch: Sequence[int]) -> list[int | Failed]:
        calls.append(len(batch))
        raise OSError("boom")

    group: GroupCommit[int, int] = GroupCommit(
        broken, flush_failed=lambda: RuntimeError("flush failed")
    )
    seen: list[type[BaseException]] = []

    async def one(i: int) -> None:
        try:
            await group.submit(i)
        except (OSError, RuntimeError) as exc:
            seen.append(type(exc))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(one, i)
    # The flusher sees the original error, every other caller the owner's error.
    assert sorted(seen, key=str) == sorted([OSError] + [RuntimeError] * 9, key=str)
    assert group.idle
    # A flush that answers the wrong number of items is the same kind of bug.
    short: GroupCommit[int, int] = GroupCommit(
        lambda batch: [], flush_failed=lambda: RuntimeError("flush failed")
    )
    with pytest.raises(AssertionError):
        await short.submit(1)


async def test_cancelled_callers_lose_and_duplicate_nothing() -> None:
    recorder = Recorder()
    recorder.gate.clear()  # hold the first flush in its worker thread
    group = engine(recorder)
    gives_up = trio.CancelScope()

    async def impatient() -> None:
        with gives_up:
            await group.submit(3)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(group.submit, 1)  # becomes the flusher
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(group.submit, 2)  # queued behind the running flush
        nursery.start_soon(impatient)
        await trio.testing.wait_all_tasks_blocked()
        gives_up.cancel()  # stops waiting; item 3 is already queued
        nursery.cancel_scope.cancel()  # the flusher is shielded: it finishes anyway
        recorder.gate.set()
    assert [sorted(batch) for batch in recorder.batches] == [[1], [2, 3]]  # each once
    assert group.idle
