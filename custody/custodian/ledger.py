"""The custodian's own record of what it did, and its own per-agent signing bound.

Why its own: a compromised pipeline can write its own ledger and audit log as it likes;
this one is written only by the process that holds the keys, under its uid.

- `SignLog`: one JSON line per answered request (op, agent, kind and event id for a
  signature, a count for NIP-44; a key change has an `intent` line before: server.py,
  keys.py), each carrying `prev`, the hash of the line before, and last `hash` =
  SHA-256(prev || the line without `hash`). Nothing secret goes in: ids, kinds, pubkeys,
  counts. Disk is bounded by `max_bytes`: past it the file moves to `.1` (replacing the
  older one) and the chain continues in the new file from the last hash.
  The head moves only once a write is written and on disk (fdatasync: once per append,
  so a batch of lines costs one; a failed one is cut off again), so no answer leaves
  before its line would survive a power cut; a last line a crash left without its newline
  is cut at open, and logged; a last whole line that is not one of these refuses the open
  (`BrokenLog`), before anything is written. Lines of an effect already made (a key
  minted, destroyed...) whose write failed are owed: held in memory and written first,
  before any later line (the server refuses effects meanwhile).
  Writers: the serving custodian and the commands beside it (`--recover`,
  `--forget-destroyed`). Each append holds an exclusive `flock` on the file from the head's
  check to its sync (and a move to `.1`); a file not as this writer left it (inode, size)
  has its head read again and a torn tail cut under that lock: one chain, no line cut.
  A command waits for the lock; the serving custodian's log (`wait=False`) does not, so
  a writer stopped holding it (SIGSTOP) never blocks its event loop: the append raises
  BlockingIOError, nothing written, and server.py waits for it without blocking.
- `RateBound`: a token bucket per agent (signatures per minute, burst the same); memory
  bounded by `MAX_AGENTS` buckets (the oldest dropped, which only gives that agent a full
  bucket again). Only a live agent held here gets one (the server checks before it
  spends), so keys asked for at random evict no bucket.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Final

__all__ = ["SignLog", "BrokenLog", "RateBound", "GENESIS", "MAX_LINE", "chain_head",
           "failed_line", "fault_name", "hashed_line"]

log = logging.getLogger("buzz_broker.custodian")

GENESIS: Final = "0" * 64
MAX_AGENTS: Final = 65536
#: A line of the log is far under this: a tail this long with no newline holds no line.
MAX_LINE: Final = 65536
_HEX64: Final = re.compile(r"[0-9a-f]{64}")


class BrokenLog(Exception):
    """The log's last whole line is not one of its lines: the chain cannot go on from it."""


def fault_name(exc: BaseException) -> str:
    """An exception as a log may name it: its type, and an OSError's errno name; never its
    text, which could carry an argument."""
    code = errno.errorcode.get(exc.errno or 0) if isinstance(exc, OSError) else None
    return type(exc).__name__ if code is None else f"{type(exc).__name__} {code}"


def failed_line(intent: int, exc: BaseException) -> dict[str, object]:
    """The outcome line of a change that raised after its `intent` line (every writer's)."""
    return {"op": "failed", "intent": intent, "fault": fault_name(exc)}


def hashed_line(prev: str, entry: dict[str, object]) -> tuple[str, str]:
    """The line's text without `hash`, and its hash chained to `prev` (the writer's and
    `--verify-log`'s one rule: custody/custodian/verify.py)."""
    body = json.dumps(entry, separators=(",", ":"), sort_keys=True)
    return body, hashlib.sha256(bytes.fromhex(prev) + body.encode("utf-8")).hexdigest()


class SignLog:
    """An append-only, hash-chained JSON-lines file."""

    def __init__(self, path: Path, max_bytes: int, clock: Callable[[], float] = time.time,
                 *, wait: bool = True) -> None:
        """`wait=False`: an append that finds another writer holding the lock raises
        BlockingIOError (an OSError) at once, nothing written (with `done`, its lines owed).
        The open's own look at the head always waits: nothing is served yet."""
        self.path = path
        self._max = max_bytes
        self._clock = clock
        self._lock = fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.head, self.seq = GENESIS, 0
        self._file: BinaryIO | None = None
        self._inode = 0  # of `_file`
        self._left: tuple[int, int] | None = None  # (inode, size) as this writer left it
        self._owed: list[dict[str, object]] = []
        self._reopen()
        try:
            with self._held(fcntl.LOCK_EX):  # the head read and a torn tail cut, as at each line
                pass
        except BaseException:
            if self._file is not None:
                self._file.close()
            raise

    def append(self, entries: list[dict[str, object]], *, done: bool = False) -> int:
        """Write the lines owed, then `entries` (one line each), before the answer leaves;
        the `seq` of the last line. The head moves only once every byte is on disk: a
        failed write or sync is cut off and raises, so the next line chains to the last one
        on disk. `done`: their effect stands whatever the write does, so a failed write
        leaves them owed."""
        at = int(self._clock())  # the effect's time, even for a line written late
        todo = self._owed + [{"at": at, **entry} for entry in entries]
        try:
            self._write(todo)
        except BaseException:
            if done:
                self._owed = todo
            raise
        self._owed = []
        return self.seq

    def _reopen(self) -> None:
        self._file = _open(self.path)
        self._inode = os.fstat(self._file.fileno()).st_ino

    @contextlib.contextmanager
    def _held(self, lock: int) -> Iterator[BinaryIO]:
        """The file at `path`, under an exclusive flock (every writer's, around each
        append; `lock`: its flags), its last whole line the head: read again, and a torn
        tail cut, if the file is not as this writer left it (another process wrote, cut or
        moved it)."""
        try:
            while True:
                assert self._file is not None
                fcntl.flock(self._file.fileno(), lock)
                with contextlib.suppress(FileNotFoundError):
                    if (now := os.stat(self.path)).st_ino == self._inode:
                        break
                file, self._file = self._file, None  # moved to `.1` by another writer
                file.close()  # since it was opened here
                self._reopen()
            if (now.st_ino, now.st_size) != self._left:
                self.head, self.seq = chain_head(self.path)  # before the cut: a broken
                cut = _cut_torn_tail(self.path)  # log is left as it is
                if cut:
                    log.warning("signed log %s: cut a torn last line (%d bytes, a write a "
                                "crash left unfinished); the chain continues from the last "
                                "whole line", self.path, cut)
                self._left = (now.st_ino, now.st_size - cut)
            yield self._file
        finally:
            if self._file is not None:  # None: moved and closed, which let it go
                with contextlib.suppress(OSError):
                    fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def _write(self, entries: list[dict[str, object]]) -> None:
        if self._file is None:  # after a move, or an open that failed: retried at each line
            self._reopen()
        if not entries:  # nothing owed: no write, no lock, and no sync to wait for
            return
        with self._held(self._lock) as file:
            self._locked_write(file, entries)

    def _locked_write(self, file: BinaryIO, entries: list[dict[str, object]]) -> None:
        head, seq, lines = self.head, self.seq, []
        for entry in entries:
            seq += 1
            body, head = hashed_line(head, {"seq": seq, "prev": head, **entry})
            lines.append(f'{body[:-1]},"hash":"{head}"}}\n')  # one encoding, not two
        data = memoryview("".join(lines).encode("utf-8"))
        start = file.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[file.write(data):]
            os.fdatasync(file.fileno())
        except BaseException:
            self._left = None  # as it is: read again at the next line
            with contextlib.suppress(OSError):  # else the next line's check cuts it
                file.truncate(start)
            raise
        self.head, self.seq = head, seq
        self._left = (self._inode, file.tell())
        if self._left[1] > self._max:  # written: a move that fails fails no line, and the
            self._file = None  # next line tries it again. Moved while locked: a writer
            with contextlib.suppress(OSError):  # waiting for it finds it moved
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            with contextlib.suppress(OSError):
                file.close()

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenLog):  # the owed lines' last try, else the
            self.append([])  # journal's
        for entry in self._owed:
            log.error("signed log %s: a line owed, never written: %s", self.path,
                      json.dumps(entry, sort_keys=True))
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


def _open(path: Path) -> BinaryIO:
    """`path` opened to append, and its directory synced: a file made here, or the move to
    `.1` before it, is on disk before its first line is."""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        file = open(path, "ab", buffering=0)  # noqa: SIM115 - held open
        os.fsync(directory)
    finally:
        os.close(directory)
    return file


def _cut_torn_tail(path: Path) -> int:
    """Truncate `path` after its last newline if it does not end with one; the bytes cut.
    A tail of MAX_LINE bytes with no newline at all is no torn line: left alone."""
    try:
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            start = f.seek(max(0, size - MAX_LINE))
            tail = f.read()
            newline = tail.rfind(b"\n")
            if tail.endswith(b"\n") or not tail or (newline < 0 and start > 0):
                return 0
            f.truncate(start + newline + 1)
            os.fsync(f.fileno())
            return size - (start + newline + 1)
    except FileNotFoundError:
        return 0


def chain_head(path: Path) -> tuple[str, int]:
    """(hash, seq) of the last whole line, in `path` or else its `.1`; GENESIS and 0 for
    none. Reads only (a line still being written is not whole, so not read). Raises
    BrokenLog if that line is not a JSON object with a 64-hex `hash` and an int `seq`:
    going on from GENESIS would fork the chain, and a traceback says nothing; and if a file
    there cannot be read (any OSError but its absence), naming it and why."""
    for candidate in (path, path.with_name(path.name + ".1")):
        try:
            with open(candidate, "rb") as f:
                start = f.seek(max(0, f.seek(0, os.SEEK_END) - MAX_LINE))
                tail = f.read()
        except FileNotFoundError:
            continue
        except OSError as exc:  # log_dir a file, a log it may not read, a name too long
            raise BrokenLog(f"signed log {candidate}: cannot read it ({exc.strerror}); "
                            "nothing was written") from None
        whole = tail[:tail.rfind(b"\n") + 1]  # a torn tail is no line: the open cuts it
        if whole or (tail and start):  # MAX_LINE, no newline: no line, nor a torn one
            try:
                last = json.loads(whole.splitlines()[-1])
                head, seq = last["hash"], last["seq"]
            except (ValueError, TypeError, KeyError, IndexError):
                head = seq = None
            if not (isinstance(head, str) and _HEX64.fullmatch(head) and type(seq) is int):
                raise BrokenLog(
                    f"signed log {candidate}: its last line is not a line of this log (a JSON "
                    "object with its seq and hash), so the chain cannot go on from it; nothing "
                    "was written: set the file aside, or put back its last line, and start "
                    "again")
            return head, seq
    return GENESIS, 0


class RateBound:
    """Signatures per agent per minute, as a token bucket."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = per_minute / 60.0
        self._burst = float(per_minute)
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, agent: str, count: int) -> bool:
        """Spend `count` signatures of `agent`'s bucket; False (nothing spent) if short."""
        now = self._clock()
        level, then = self._buckets.pop(agent, (self._burst, now))
        level = min(self._burst, level + (now - then) * self._rate)
        allowed = level >= count
        self._buckets[agent] = (level - count if allowed else level, now)
        while len(self._buckets) > MAX_AGENTS:
            self._buckets.popitem(last=False)
        return allowed
