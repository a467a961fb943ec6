"""The one token worker: every PKCS#11 call in the process runs through here, one at a time.

Why (design.md, "PKCS#11 facts measured on this machine"): python-pkcs11 initializes
SoftHSM so that SoftHSM turns its own locking off, and two threads calling the token at
once crash the process. A network HSM answers in milliseconds, so the token is also never
called on the trio event-loop thread.

Two process-wide objects, because the hazard is process-wide:
- `TOKEN_LIMITER`, a trio CapacityLimiter(1): at most one trio worker thread exists for the
  token, so waiting callers wait in trio (cancellable) rather than in blocked threads.
- `_TOKEN_LOCK`, a threading.Lock taken inside the worker: the actual guarantee. It also
  covers callers outside trio, or in another trio run in another thread.
`abandon_on_cancel=False`: a PKCS#11 call cannot be interrupted, and the limiter must stay
held until the thread has really finished (trio's to_thread.run_sync docs), so a cancelled
caller waits for its in-flight token call to end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import trio

__all__ = ["TOKEN_LIMITER", "in_token_worker", "run_locked", "require_lock"]

T = TypeVar("T")

TOKEN_LIMITER = trio.CapacityLimiter(1)
_TOKEN_LOCK = threading.Lock()
#: The thread holding `_TOKEN_LOCK`: a Lock has no owner, and `locked()` alone let a thread
#: that does not hold it call the token while the worker did (the crash above).
_holder: int | None = None


def run_locked(fn: Callable[[], T]) -> T:
    """Run `fn` holding the token lock (synchronous callers: the CLI's import path, tests)."""
    global _holder
    with _TOKEN_LOCK:
        _holder = threading.get_ident()
        try:
            return fn()
        finally:
            _holder = None


async def in_token_worker(fn: Callable[[], T]) -> T:
    """Run `fn` in the token worker thread, holding the token lock. One hop per call.

    Cancellation: waits (cancellably) for the limiter; once `fn` has started, it runs to
    completion and its result or exception is delivered (abandon_on_cancel=False).
    """
    return await trio.to_thread.run_sync(
        run_locked, fn, limiter=TOKEN_LIMITER, abandon_on_cancel=False
    )


def require_lock() -> None:
    """Assert the caller holds the token lock: every function that calls PKCS#11 starts so."""
    if _holder != threading.get_ident():
        raise AssertionError("PKCS#11 called outside the token worker")
