"""The key-event log: the audit log's hash chain, for the commands that move agent keys.

Rules (issue 18):
- `<state>/key-events/` holds an audit chain of its own (daemon/state/audit.py: the same
  canonical lines with `seq`, `prev`, `digest`, the same files `audit-NNNNNN.jsonl`, the
  same `verify`), whose lines are `KeyEvent`s. It is not the daemon's audit directory:
  the running daemon holds that one's lock, and `keys backup` runs with the daemon up.
- `write` opens the log, appends its events in order (each fsynced before the next), and
  closes it: the lock is held for those lines only, never across a command's work or a
  prompt. A second command waits for it up to `LOCK_WAIT_SECONDS`, then fails with
  `AuditUnavailable(busy=True)`; two writers never fork the chain.
- Anchor: after each write the new head (`seq sha256`) replaces `<state>/key-events.head`
  (atomically, under the lock). `write` refuses to continue a log that does not verify or
  does not reach that anchor, and `buzz-broker audit verify` reports it (exit 3): a cut
  tail, a deleted line or directory, an edit. What it cannot show: someone who can write
  the state directory can rewrite the log whole and its anchor to match (docs/install.md,
  "The key-event log").
- A `done` outcome that lists more than `MAX_KEY_PUBKEYS` pubkeys becomes several `done`
  lines with the same `op` (`outcome_lines`); each says the total in `agents`.
- `LEGACY_FILE` (`key-events.jsonl`, plain unchained lines written before this log) is
  never written, moved or deleted here: it stays readable as it was.
- No secret reaches a line: `KeyEvent` has no field that could hold one.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Final

import trio

from daemon.state.audit import MAX_KEY_PUBKEYS, AuditLog, AuditUnavailable, KeyEvent, verify

__all__ = ["KEY_EVENTS_DIRNAME", "HEAD_FILE", "LEGACY_FILE", "LOCK_WAIT_SECONDS", "new_op",
           "operator", "outcome_lines", "read_head", "write"]

#: The key-event log's directory under the state directory.
KEY_EVENTS_DIRNAME: Final = "key-events"
#: The plain, unchained file versions before this one appended to (read only now).
LEGACY_FILE: Final = "key-events.jsonl"
#: The anchor: `seq sha256` of the log's last record, beside (not in) its directory, so
#: that deleting the directory, or cutting records from its end, is seen by `verify`.
HEAD_FILE: Final = "key-events.head"
_HEAD_RE: Final = re.compile(rb"([0-9]{1,18}) ([0-9a-f]{64})\n")
_HEAD_MAX_BYTES: Final = 100
#: How long a command waits for another one to finish writing its lines. Writers hold the
#: lock for a few fsyncs, so this is only exceeded by a stuck process.
LOCK_WAIT_SECONDS: Final = 10.0


def new_op() -> str:
    """A fresh operation id: pairs a command's intent with its outcome."""
    return secrets.token_hex(8)


def operator() -> tuple[int, str | None]:
    """(uid, user name) of the process; the name is None when the uid has no entry."""
    uid = os.getuid()
    try:
        return uid, pwd.getpwuid(uid).pw_name
    except KeyError:
        return uid, None


def outcome_lines(event: KeyEvent, pubkeys: Sequence[str]) -> list[KeyEvent]:
    """`event` listing `pubkeys`: one line, or one per MAX_KEY_PUBKEYS of them."""
    if len(pubkeys) <= MAX_KEY_PUBKEYS:
        return [replace(event, pubkeys=tuple(pubkeys))]
    return [replace(event, pubkeys=tuple(pubkeys[i:i + MAX_KEY_PUBKEYS]))
            for i in range(0, len(pubkeys), MAX_KEY_PUBKEYS)]


def read_head(state_dir: Path) -> tuple[int, str] | None:
    """The anchored head (seq, sha256) in `<state_dir>/key-events.head`, or None if absent.

    Raises:
        ValueError: the file is not one `seq hash` line (it was damaged or edited).
        OSError: it cannot be read.
    """
    try:
        fd = os.open(state_dir / HEAD_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(_HEAD_MAX_BYTES + 1)
    match = _HEAD_RE.fullmatch(data)
    if match is None:
        raise ValueError(f"{HEAD_FILE} is not one `seq sha256` line")
    return int(match.group(1)), match.group(2).decode("ascii")


def _write_head(state_dir: Path, head: tuple[int, str]) -> None:
    """Replace the anchor file atomically (temporary file, fsync, rename, fsync the dir)."""
    temporary = state_dir / (HEAD_FILE + ".tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, f"{head[0]} {head[1]}\n".encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, state_dir / HEAD_FILE)
    directory = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write(state_dir: Path, events: Sequence[KeyEvent], *,
          lock_wait: float | None = None) -> tuple[int, str]:
    """Append `events` to `<state_dir>/key-events/` durably, in order; return the new head.

    Under the log's lock it first checks the whole chain and that it reaches the anchor
    (`key-events.head`): a log that was edited, cut or deleted is not continued (a new
    line after a cut would hide it). Then it appends, fsyncs, and moves the anchor to the
    new head. Call it outside trio (it runs its own).

    Raises:
        AuditUnavailable: the log cannot be opened or written (`detail` says why; `busy`
            when another command held it past `lock_wait`, default LOCK_WAIT_SECONDS), or
            it is broken (`detail` names the first bad line). Lines before a failing one
            may be in the log; the anchor then lags behind the log, which `verify` accepts.
    """
    try:
        # As custody's keystore does: a command may be the first to write the state dir.
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise AuditUnavailable(f"cannot create {state_dir}: {exc.strerror}") from None
    directory = state_dir / KEY_EVENTS_DIRNAME
    wait = LOCK_WAIT_SECONDS if lock_wait is None else lock_wait

    async def append() -> tuple[int, str]:
        log = AuditLog.open(directory, lock_wait=wait)
        try:
            _check(state_dir, directory)
            for event in events:
                await log.append(event)
            _write_head(state_dir, log.head)
        except OSError as exc:
            raise AuditUnavailable(f"cannot write {state_dir / HEAD_FILE}: "
                                   f"{exc.strerror}") from None
        finally:
            await log.aclose()
        return log.head

    return trio.run(append)


def _check(state_dir: Path, directory: Path) -> None:
    """Raise AuditUnavailable unless the log verifies and reaches its anchor."""
    try:
        anchor = read_head(state_dir)
        result = verify(directory, anchor=anchor)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise AuditUnavailable(f"cannot read the key-event anchor: {why}") from None
    if not result.ok:
        where = (f"{Path(result.file).name} line {result.line}: "
                 if result.file and result.line else "")
        raise AuditUnavailable(
            f"the key-event log is broken ({where}{result.reason}); run `buzz-broker audit "
            "verify`, and see docs/install.md, \"The key-event log\"")
