"""One key-custody command's intent and outcome in the key-event log (issue 18).

Rules:
- `recorded(...)` writes and fsyncs the INTENT line before the command does anything
  (daemon/state/key_events.py). If it cannot, the command stops right there: one
  CliError line, exit 1, and nothing was unsealed, sealed or created.
- The command then calls `trail.done(...)` once it has finished; a CliError (or any
  other exception, or ^C) leaving the block writes a FAILED line with the fault's one
  line (for an unexpected exception, its type name only: its text could carry a secret)
  and the fault is raised on. If the outcome cannot be written the command fails too and
  says so: the log then shows an intent without an outcome, which is what an operator
  must look at (docs/install.md, "The key-event log").
- Faults are clipped to what a `KeyEvent` holds (`MAX_KEY_TEXT`); they are CliError
  lines, which never carry a secret (daemon/cli/__init__.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Unpack

from daemon.cli._common import CliError
from daemon.state import key_events
from daemon.state.audit import (
    MAX_KEY_LABEL,
    MAX_KEY_TEXT,
    AuditUnavailable,
    KeyAction,
    KeyEvent,
    KeyFacts,
    KeyStage,
    text_fits,
)

__all__ = ["KeyTrail", "clip", "recorded"]

# A command has no operator log: without a handler the audit writer's own events
# (`audit.unavailable`, ...) would reach stderr through logging's last resort, a second
# line beside the CliError that already says why.
logging.getLogger("buzz_broker.audit").addHandler(logging.NullHandler())


def clip(text: str, limit: int = MAX_KEY_TEXT) -> str:
    """`text`, shortened (ending in `…`) until it fits a key-event text field."""
    while not text_fits(text, limit):
        text = text[: max(1, len(text) * 3 // 4 - 1)] + "…"
    return text


class KeyTrail:
    """The lines of one command run: built by `recorded`, finished by `done`."""

    def __init__(self, state_dir: Path, intent: KeyEvent) -> None:
        self._state = state_dir
        self._intent = intent
        self.finished = False

    def _write(self, *events: KeyEvent) -> None:
        try:
            key_events.write(self._state, events)
        except AuditUnavailable as exc:
            where = self._state / key_events.KEY_EVENTS_DIRNAME
            why = ("another command is writing it" if exc.busy
                   else exc.detail or str(exc))
            raise CliError(f"cannot write the key-event log {where}: {why}") from None

    def done(self, *, pubkeys: Sequence[str] = (), **facts: Unpack[KeyFacts]) -> None:
        """Write the DONE outcome (what moved). Raises CliError if it cannot be written."""
        self.finished = True  # whatever happens now, no FAILED line follows it
        outcome = replace(self._intent, at=time.time(), stage=KeyStage.DONE, **facts)
        self._write(*key_events.outcome_lines(outcome, pubkeys))

    def failed(self, fault: str) -> None:
        """Write the FAILED outcome (once; nothing after `done`)."""
        if self.finished:
            return
        self.finished = True
        self._write(replace(self._intent, at=time.time(), stage=KeyStage.FAILED,
                            fault=clip(fault)))


@contextmanager
def recorded(state_dir: Path, action: KeyAction, **facts: Unpack[KeyFacts]
             ) -> Iterator[KeyTrail]:
    """Write the intent for `action` with `facts`; yield the trail; record a failure.

    Raises:
        CliError: the intent (nothing has been done) or the outcome cannot be written, or
            the block's own CliError (after its FAILED line).
    """
    uid, user = key_events.operator()
    intent = KeyEvent(at=time.time(), op=key_events.new_op(), action=action,
                      stage=KeyStage.INTENT, uid=uid,
                      user=None if user is None else clip(user, MAX_KEY_LABEL), **facts)
    trail = KeyTrail(state_dir, intent)
    trail._write(intent)
    try:
        yield trail
    except CliError as exc:
        _fail(trail, str(exc))
        raise
    except BaseException as exc:
        _fail(trail, f"stopped by {type(exc).__name__}")
        raise


def _fail(trail: KeyTrail, fault: str) -> None:
    try:
        trail.failed(fault)
    except CliError as unwritten:
        raise CliError(f"{fault}; and its failure was not recorded: {unwritten}") from None
