"""Group commit: many callers' writes share one worker-thread hop and one fsync.

Rules:
- The owner (the ledger, the audit log) supplies one blocking `flush(batch) -> results`.
  It runs in a worker thread, one call at a time (this engine's own CapacityLimiter(1)),
  and must make the whole batch durable before it returns. It answers every item, in
  order: the item's result, or `Failed(exc)` for an item that was not made durable.
- Items are flushed in the order `submit` was called; a batch is everything queued when
  the previous flush returned. Owners whose records chain (the audit log) rely on this.
- Nobody is left waiting: if `flush` itself raises (a bug: it is meant to answer every
  item), every caller in that batch and every caller queued behind it gets a fresh
  exception from the owner's `flush_failed()`, and the flushing caller gets the original.

Theory of operation: `submit` queues its item; the first caller to find no flush running
becomes the flusher and, shielded from cancellation, hands the queue to the worker thread,
wakes that batch's callers, and repeats until the queue is empty. Under load many callers
share one hop and one fsync; a lone caller pays one of each. The flush is shielded because
other callers' durability depends on it, and it is bounded by what was queued.

Considered instead: a long-lived flusher task per owner (it needs a nursery, so an owner
could no longer be opened and used from any task), and one thread per write (no sharing).

WARNING: the state here (`_queue`, `_flushing`) is touched only from the event loop;
`flush` must not call back into this object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

__all__ = ["GroupCommit", "Failed"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Failed:
    """`flush`'s answer for one item that was not made durable: its caller raises `error`."""

    error: BaseException


@dataclass(slots=True, eq=False)
class _Waiting(Generic[T, R]):
    item: T
    done: trio.Event = field(default_factory=trio.Event)
    #: assigned just before `done` is set
    result: R | Failed = field(init=False)


class GroupCommit(Generic[T, R]):
    """One queue, one flusher at a time, one worker thread; see the module docstring.

    Args:
        flush: blocking; makes a batch durable and answers each item (module docstring).
        flush_failed: the exception a waiting caller gets when `flush` itself raised,
            made once per caller (each raises its own). This is where the owners differ:
            each names the error its own callers already handle.
    """

    def __init__(
        self,
        flush: Callable[[Sequence[T]], Sequence[R | Failed]],
        *,
        flush_failed: Callable[[], BaseException],
    ) -> None:
        self._flush = flush
        self._flush_failed = flush_failed
        self._limiter = trio.CapacityLimiter(1)
        self._queue: list[_Waiting[T, R]] = []
        self._flushing = False

    @property
    def idle(self) -> bool:
        """No flush is running and nothing is queued."""
        return not self._flushing and not self._queue

    async def submit(self, item: T) -> R:
        """Queue `item` for the next batch; return its result once the batch is durable.

        Raises:
            whatever `flush` answered `Failed(...)` for this item; `flush_failed()` when
            `flush` raised (the flushing caller gets that original exception instead).

        Cancellation: a caller cancelled while waiting only stops waiting; its item still
        goes out in the batch it joined (it may already be in one), exactly once.
        """
        waiting: _Waiting[T, R] = _Waiting(item)
        self._queue.append(waiting)
        if not self._flushing:
            self._flushing = True
            try:
                with trio.CancelScope(shield=True):
                    while self._queue:
                        batch, self._queue = self._queue, []
                        await self._flush_one(batch)
            finally:
                self._flushing = False
        await waiting.done.wait()
        result = waiting.result
        if isinstance(result, Failed):
            raise result.error
        return result

    async def _flush_one(self, batch: list[_Waiting[T, R]]) -> None:
        try:
            results = await trio.to_thread.run_sync(
                self._flush, [waiting.item for waiting in batch], limiter=self._limiter
            )
            if len(results) != len(batch):
                raise AssertionError(
                    f"group commit: flush answered {len(results)} of {len(batch)} items"
                )
        except BaseException:
            # Fail everyone queued rather than leave them waiting on a flusher that is gone.
            for waiting in (*batch, *self._queue):
                waiting.result = Failed(self._flush_failed())
                waiting.done.set()
            self._queue = []
            raise
        for waiting, result in zip(batch, results):
            waiting.result = result
            waiting.done.set()
