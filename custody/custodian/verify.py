"""`buzz-broker custodian FILE --verify-log`: check the custodian's signed log, beside it or not.

Why a command: the custodian's log (`<log_dir>/signed.jsonl`, ledger.py) is hash-chained
so that an edit shows, but nothing an operator or auditor could run checked it; the
daemon's `audit verify` reads the daemon's audit files, whose lines are written another
way, and calls every line of this log edited. main.py imports this module for
`--verify-log` alone: the serving custodian never loads it (tests/custodian/test_size.py).

What is checked: the one older file a move keeps (`signed.jsonl.1`, ledger.py `max_bytes`),
if any, then `signed.jsonl`, as one chain. Each line must be a JSON object whose `hash` is
SHA-256(prev || the line without `hash`) (ledger.py `hashed_line`, the writer's own), whose
`prev` is the hash of the line before it and whose `seq` is one more than that line's. The
first line read chains to GENESIS when its `seq` is 1; a later one's `prev` is taken as
given, since the files before it were replaced by moves. What this cannot show (there is
no anchor): lines cut from the end, and the older files a move dropped, or one removed.

Beside a serving custodian: it opens the files to read and nothing else, and takes no
lock, so neither the custodian (whose appends never wait: server.py `appended`) nor a
command beside it ever waits for it. It reads the two files as they were at one moment:
both opened, then `signed.jsonl` looked at again, and read once more from the start if a
move came between (`MAX_TRIES`); each is read up to its size then, and a last line with no
newline there is one being written (or a crash's, cut at the next start), not read. Lines
written after that moment are not checked; a line whose sync failed, which the writer cuts
again, may have been.

Output: one line on stdout, `custodian: signed log ok: N lines checked in FILES; head
SEQ:HASH`, exit 0; or `custodian: signed log broken: PATH line N: why (M lines checked
before it)`, exit `EXIT_BROKEN`, as the daemon's `audit verify`. A fault (FILE, no log
directory, a file it may not read) is one line on stderr, exit 1.

WARNING: the lines and the exit codes are documented in docs/custodian.md ("The signed
log") and docs/operations.md ("Exit codes: every command"); keep them in step.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

from custody.custodian.config import ConfigError, load
from custody.custodian.ledger import GENESIS, MAX_LINE, hashed_line

__all__ = ["EXIT_BROKEN", "Broken", "Checked", "check_log", "main", "verify_chain"]

#: Exit status when the chain is broken (1 is a fault, 2 a usage error): `audit verify`'s.
EXIT_BROKEN: Final = 3
#: Reads of the pair a move may interrupt before it gives up: a move takes `log_max_bytes`
#: (4 KiB at least) of synced lines, so two in a row are already unlikely.
MAX_TRIES: Final = 5


class Broken(ValueError):
    """A line that breaks the chain: its number in its file (from 1) and why."""

    def __init__(self, line: int, why: str) -> None:
        super().__init__(f"line {line} breaks the chain: {why}")
        self.line = line
        self.why = why


@dataclass(frozen=True, slots=True)
class Checked:
    """A log that verifies: the lines checked, the files they were in, the last line's seq
    and hash (0 and GENESIS for none), whether a partial last line was left unread."""

    lines: int
    files: tuple[Path, ...]
    seq: int
    head: str
    partial: bool


@dataclass(frozen=True, slots=True)
class _Head:
    """Where the chain stands: the last line's hash (None: the first line's `prev` is taken
    as given, GENESIS if its seq is 1) and seq (None: any)."""

    hash: str | None
    seq: int | None


_NOT_A_LINE: Final = "not a line of this log (a JSON object with its seq, prev and hash)"


def _why(line: bytes, at: _Head) -> tuple[str | None, _Head]:
    """Why `line` does not follow `at` (None: it does), and the head after it."""
    try:  # a line that is no JSON object, or lacks a member, breaks it too
        entry = json.loads(line)
        claimed, prev, seq = entry.pop("hash"), entry["prev"], entry["seq"]
        own = hashed_line(prev, entry)[1]
    except (ValueError, TypeError, KeyError, AttributeError):
        return _NOT_A_LINE, at
    if type(seq) is not int or not isinstance(claimed, str):
        return _NOT_A_LINE, at
    if own != claimed:
        return "its hash is not the hash of its contents (the line was edited)", at
    if prev != (at.hash if at.hash is not None else GENESIS if seq == 1 else prev):
        return "its prev is not the hash of the line before it (a line cut, added or moved)", at
    if at.seq is not None and seq != at.seq + 1:
        return f"its seq {seq} does not follow {at.seq}", at
    return None, _Head(claimed, seq)


def _lines(file: BinaryIO, size: int) -> Iterator[bytes]:
    """The whole lines of `file` within its first `size` bytes; a last one with no newline
    is yielded too, for the caller to judge."""
    left = size
    while left > 0:
        line = file.readline(min(left, MAX_LINE + 1))
        if not line:
            return
        left -= len(line)
        yield line


def _walk(file: BinaryIO, size: int, at: _Head, *, tail_ok: bool) -> tuple[int, _Head, bool]:
    """Check `file`'s lines from `at`; (lines checked, the head after them, a partial last
    line left unread). `tail_ok`: a last line with no newline is being written (the current
    file), not read; else it breaks the chain. Raises Broken."""
    count = 0
    for count, line in enumerate(_lines(file, size), 1):
        if not line.endswith(b"\n"):
            if len(line) > MAX_LINE:
                raise Broken(count, f"longer than {MAX_LINE} bytes: no line of this log")
            if tail_ok:
                return count - 1, at, True
            raise Broken(count, "the file ends inside it (no newline): the file was cut")
        why, at = _why(line, at)
        if why is not None:
            raise Broken(count, why)
    return count, at, False


def verify_chain(path: Path, start: str = GENESIS) -> int:
    """Check one file's lines, the first chaining to `start`; the number of lines. Raises
    Broken (a ValueError) naming the first line that breaks the chain."""
    with open(path, "rb") as file:
        count, _at, _partial = _walk(file, os.fstat(file.fileno()).st_size, _Head(start, None),
                                     tail_ok=False)
    return count


class BrokenAt(Exception):
    """The chain breaks in `path`: `broken` says where and why; `before`: lines checked."""

    def __init__(self, path: Path, broken: Broken, before: int) -> None:
        super().__init__(f"{path} {broken}")
        self.path = path
        self.broken = broken
        self.before = before


def _open(path: Path) -> BinaryIO | None:
    """`path` to read, None if absent. Root may run this in a directory the custodian's
    user owns: a link there must not make root read another file, nor a FIFO hang it.

    Raises:
        OSError: a symbolic link (ELOOP), or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.fdopen(fd, "rb")  # closed by the caller's stack
    except BaseException:
        os.close(fd)
        raise


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def check_log(path: Path) -> Checked:
    """Verify `path` (`signed.jsonl`) and the older file beside it as one chain.

    Raises:
        BrokenAt: a line breaks the chain.
        FileNotFoundError: neither file is there.
        OSError: a file cannot be read; or (EAGAIN) it moved MAX_TRIES times while opened.
    """
    older = path.with_name(path.name + ".1")
    for _ in range(MAX_TRIES):
        with contextlib.ExitStack() as stack:
            # The current file first: a move after it makes `older` that same file, and
            # either way `path` then names another file, which the look below sees.
            files: list[tuple[Path, BinaryIO]] = []
            for name in (path, older):
                if (file := _open(name)) is not None:
                    files.insert(0, (name, stack.enter_context(file)))
            stats = {name: os.fstat(file.fileno()) for name, file in files}
            if _inode(path) != (stats[path].st_ino if path in stats else None):
                continue  # moved (or made) meanwhile: open the pair again
            if not files:
                raise FileNotFoundError(2, f"neither it nor {older.name} is there", str(path))
            return _check(files, {name: stat.st_size for name, stat in stats.items()}, path)
    raise OSError(11, f"the log moved {MAX_TRIES} times while it was opened: run it again",
                  str(path))


def _check(files: list[tuple[Path, BinaryIO]], sizes: dict[Path, int],
           current: Path) -> Checked:
    """Walk the files, oldest first, each up to its size, as one chain; only `current` is
    written to, so only its last line may be partial (module docstring)."""
    at, total, partial = _Head(None, None), 0, False
    for path, file in files:
        try:
            count, at, partial = _walk(file, sizes[path], at, tail_ok=path == current)
        except Broken as exc:
            raise BrokenAt(path, exc, total + exc.line - 1) from None
        total += count
    return Checked(lines=total, files=tuple(path for path, _ in files), seq=at.seq or 0,
                   head=at.hash or GENESIS, partial=partial)


def main(config_path: str) -> int:
    """The command: its one line, and its exit status (module docstring)."""
    try:
        path = load(config_path).settings.log_path
        if not path.parent.is_dir():  # one that is not there: a custodian never started
            what = "not a directory" if path.parent.exists() else "no such directory"
            raise ConfigError(f"{path.parent} (log_dir in {config_path}): {what}; no signed "
                              "log to verify")
        checked = check_log(path)
    except ConfigError as exc:
        print(f"custodian: {exc}", file=sys.stderr)
        return 1
    except BrokenAt as exc:
        print(f"custodian: signed log broken: {exc.path} line {exc.broken.line}: "
              f"{exc.broken.why} ({exc.before} lines checked before it)", flush=True)
        return EXIT_BROKEN
    except OSError as exc:  # a log it may not read, a name too long, moving under it
        print(f"custodian: signed log {exc.filename or config_path}: cannot verify it "
              f"({exc.strerror})", file=sys.stderr)
        return 1
    files = " and ".join(p.name for p in checked.files)
    partial = ("; a partial last line not read (being written, or a crash's: cut at the "
               "next start)") if checked.partial else ""
    print(f"custodian: signed log ok: {checked.lines} lines checked in {files} ({path.parent});"
          f" head {checked.seq}:{checked.head}{partial}", flush=True)
    return 0
