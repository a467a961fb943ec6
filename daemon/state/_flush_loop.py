"""The periodic flush the audit log's counters share (read_audit.py, refusal_audit.py).

Each counts lines whose window closes `window_seconds` after its first count, and writes
the closed ones in `flush()`. The loop here calls it `FLUSHES_PER_WINDOW` times a window,
so a count is written at most a quarter window after its window closed: the loss bound
both modules state ("`WINDOW_SECONDS` plus one flush interval"). A write that fails is
the counter's own business (it keeps the count for the next call); nothing is caught here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import trio

__all__ = ["FLUSHES_PER_WINDOW", "flush_forever"]

#: How often a window is checked for closed counts: a count waits at most a quarter
#: window past its close, and a quiet daemon wakes four times a window for it.
FLUSHES_PER_WINDOW: Final = 4


async def flush_forever(flush: Callable[[], Awaitable[None]], window_seconds: float, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                        ) -> None:
    """Call `flush` every `window_seconds / FLUSHES_PER_WINDOW`, forever.

    Cancellation: a nursery task, stopped by cancelling it; the daemon's last flush at
    shutdown (`flush(everything=True)`, daemon/wiring.py) is the caller's, not this loop's.
    """
    task_status.started()
    while True:
        await trio.sleep(window_seconds / FLUSHES_PER_WINDOW)
        await flush()
