"""The custodian's own record of what it did, and its own per-agent signing bound.

Why its own: a compromised pipeline can write its own ledger and audit log as it likes;
this one is written only by the process that holds the keys, under its uid.

- `SignLog`: one JSON line per answered intent (op, agent, kind and event id for a
  signature, a count for NIP-44), each carrying `prev`, the hash of the line before, and
  last `hash` = SHA-256(prev || the line without `hash`). Nothing secret goes in: ids, kinds,
  pubkeys, counts. Disk is bounded by `max_bytes`: past it the file moves to `.1`
  (replacing the older one) and the chain continues in the new file from the last hash.
  The head moves only once a write has fully succeeded (a failed one is cut off again);
  a last line a crash left without its newline is cut at open, and logged. Lines of an
  effect already made (a key minted, destroyed...) whose write failed are owed: held in
  memory and written first, before any later line (the server refuses effects meanwhile).
- `RateBound`: a token bucket per agent (signatures per minute, burst the same); memory
  bounded by `MAX_AGENTS` buckets (the oldest dropped, which only gives that agent a full
  bucket again). Only a live agent held here gets one (the server checks before it
  spends), so keys asked for at random evict no bucket.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Final

__all__ = ["SignLog", "RateBound", "GENESIS", "verify_chain"]

log = logging.getLogger("buzz_broker.custodian")

GENESIS: Final = "0" * 64
MAX_AGENTS: Final = 65536


def _hashed(prev: str, entry: dict[str, object]) -> tuple[str, str]:
    body = json.dumps(entry, separators=(",", ":"), sort_keys=True)
    return body, hashlib.sha256(bytes.fromhex(prev) + body.encode("utf-8")).hexdigest()


class SignLog:
    """An append-only, hash-chained JSON-lines file."""

    def __init__(self, path: Path, max_bytes: int, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._max = max_bytes
        self._clock = clock
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        cut = _cut_torn_tail(path)
        if cut:
            log.warning("signed log %s: cut a torn last line (%d bytes, a write a crash left "
                        "unfinished); the chain continues from the last whole line", path, cut)
        self.head, self.seq = GENESIS, 0
        last = _last_line(path)
        if last is not None:
            self.head, self.seq = str(last["hash"]), int(str(last["seq"]))
        self._file: BinaryIO | None = open(path, "ab", buffering=0)  # noqa: SIM115 - held open
        self._owed: list[dict[str, object]] = []

    def append(self, entries: list[dict[str, object]], *, done: bool = False) -> None:
        """Write the lines owed, then `entries` (one line each), before the answer leaves.
        Unbuffered, and the head moves only once every byte is written: a failed write is
        cut off and raises, so the next line chains to the last one on disk. `done`: their
        effect stands whatever the write does, so a failed write leaves them owed."""
        at = int(self._clock())  # the effect's time, even for a line written late
        todo = self._owed + [{"at": at, **entry} for entry in entries]
        try:
            self._write(todo)
        except BaseException:
            if done:
                self._owed = todo
            raise
        self._owed = []

    def _write(self, entries: list[dict[str, object]]) -> None:
        if self._file is None:  # after a move, or an open that failed: retried at each line
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - held open
        head, seq, lines = self.head, self.seq, []
        for entry in entries:
            seq += 1
            body, head = _hashed(head, {"seq": seq, "prev": head, **entry})
            lines.append(f'{body[:-1]},"hash":"{head}"}}\n')  # one encoding, not two
        data = memoryview("".join(lines).encode("utf-8"))
        start = self._file.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[self._file.write(data):]
        except BaseException:
            with contextlib.suppress(OSError):  # else the next open cuts the torn line
                self._file.truncate(start)
            raise
        self.head, self.seq = head, seq
        if self._file.tell() > self._max:  # written: a move that fails fails no line, and
            file, self._file = self._file, None  # the next line tries it again
            with contextlib.suppress(OSError):
                file.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the owed lines' last try, else the journal's
            self.append([])
        for entry in self._owed:
            log.error("signed log %s: a line owed, never written: %s", self.path,
                      json.dumps(entry, sort_keys=True))
        if self._file is not None:
            self._file.close()


def _cut_torn_tail(path: Path) -> int:
    """Truncate `path` after its last newline if it does not end with one; the bytes cut.
    A line is far under 64 KiB: a tail with no newline at all is no torn line, left alone."""
    try:
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            start = f.seek(max(0, size - 65536))
            tail = f.read()
            newline = tail.rfind(b"\n")
            if tail.endswith(b"\n") or not tail or (newline < 0 and start > 0):
                return 0
            f.truncate(start + newline + 1)
            os.fsync(f.fileno())
            return size - (start + newline + 1)
    except FileNotFoundError:
        return 0


def _last_line(path: Path) -> dict[str, object] | None:
    for candidate in (path, path.with_name(path.name + ".1")):
        try:
            with open(candidate, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 65536))
                lines = f.read().splitlines()
        except FileNotFoundError:
            continue
        if lines:
            value = json.loads(lines[-1])
            if isinstance(value, dict):
                return value
    return None


def verify_chain(path: Path, start: str = GENESIS) -> int:
    """Check every line's hash against the one before; the number of lines. ValueError
    names the first line that breaks the chain."""
    prev = start
    count = 0
    with open(path, encoding="utf-8") as f:
        for count, line in enumerate(f, 1):
            entry = json.loads(line)
            claimed = entry.pop("hash")
            if entry["prev"] != prev or _hashed(prev, entry)[1] != claimed:
                raise ValueError(f"line {count} breaks the chain")
            prev = claimed
    return count


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
