"""A command's lines in the custodian's log: `keys` (rotate, migrate, restore), `--recover`
and `--forget-destroyed`, each its own process under the custodian's uid.

Why here, not in ledger.py: the serving custodian writes its own lines (server.py
`_change`) and never loads this module; the commands share one way to open the log and
to say a fault writing it, and one write-ahead for a change. They append through the same
`SignLog` as the server, whose lock keeps one chain when they run beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from custody._errors import CustodyError
from custody.custodian.config import CustodianConfig
from custody.custodian.ledger import SignLog, failed_line

__all__ = ["append", "logged_change", "open_log"]

T = TypeVar("T")


def _fault(exc: OSError, what: str) -> CustodyError:
    return CustodyError(f"the custodian's log cannot be written ({exc.strerror}): {what}")


def open_log(config: CustodianConfig, what: str) -> SignLog:
    """The custodian's log, opened to append: BrokenLog (its last line not its own) as is,
    any other fault a CustodyError ending with `what` (what it leaves done)."""
    try:
        return SignLog(config.settings.log_path, config.settings.log_max_bytes)
    except OSError as exc:
        raise _fault(exc, what) from None


def append(log: SignLog, entries: list[dict[str, object]], what: str, *,
           done: bool = False) -> int:
    """`entries` on disk (SignLog.append: synced); the last one's seq. `done`: owed if the
    write fails (SignLog.close then puts them on stderr)."""
    try:
        return log.append(entries, done=done)
    except OSError as exc:
        raise _fault(exc, what) from None


async def logged_change(log: SignLog, intent: dict[str, object],
                        change: Callable[[], Awaitable[T]],
                        outcome: Callable[[T, int], list[dict[str, object]]]) -> T:
    """`change()` between its `intent` line (on disk first: a write that fails changes
    nothing) and `outcome(result, intent's seq)`, or `failed` naming the fault's type if it
    raises (server.py `_change`, for a command)."""
    seq = append(log, [{"op": "intent", **intent}], "nothing was changed")
    try:
        result = await change()
    except Exception as exc:
        with contextlib.suppress(CustodyError):  # the fault that ended it is the one said
            append(log, [failed_line(seq, exc)], "", done=True)
        raise
    append(log, outcome(result, seq), "the change is made, and its intent line stands for it",
           done=True)
    return result
