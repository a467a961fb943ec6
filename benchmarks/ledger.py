"""Ledger throughput: first-time recorded requests/s and replays/s, against an in-memory
dict doing the same bookkeeping in the same run (the baseline ratio).

A first-time request is what the pipeline does for a publishing operation:
begin() -> Fresh, record_pending() (durable, synchronous=FULL), finish(..., Status.SUCCEEDED).
A replay is begin() on a key whose final verdict is recorded.

Requests run as `--concurrency` trio tasks at once, so group commit can share one
transaction (one fsync, one thread hop) among many; the commit count per request is
printed. The database lives in `--dir` (default: a temporary directory; fsync cost
depends on the filesystem, which is printed).

Usage: python benchmarks/ledger.py [--requests N] [--concurrency C ...] [--dir PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buzzwire.contract import ErrorCode, Status  # noqa: E402
from daemon.state.ledger import Fresh, Ledger, LedgerKey, Replay  # noqa: E402

PENDING = b'{"events":[{"id":"' + b"e" * 64 + b'","sig":"' + b"s" * 128 + b'"}]}' + b" " * 300
RESPONSE = b'{"type":"broker_result","status":"succeeded","outcome":{"eventId":"' + b"e" * 64 + b'"}}'


@dataclass
class _DictFlight:
    digest: bytes
    done: trio.Event = field(default_factory=trio.Event)


class DictLedger:
    """The same bookkeeping with nothing durable: the floor the real ledger is held to."""

    def __init__(self) -> None:
        #: key -> (digest, state, pending, response, status, code): the real ledger's columns
        self.records: dict[LedgerKey, tuple[bytes, str, bytes | None, bytes | None,
                                            Status | None, ErrorCode | None]] = {}
        self.inflight: dict[LedgerKey, _DictFlight] = {}

    async def begin(self, key: LedgerKey, digest: bytes) -> object:
        await trio.lowlevel.checkpoint()
        while (flight := self.inflight.get(key)) is not None:
            if flight.digest != digest:
                return "conflict"
            await flight.done.wait()
        row = self.records.get(key)
        if row is None:
            self.inflight[key] = _DictFlight(digest)
            return "fresh"
        if row[0] != digest:
            return "conflict"
        assert row[4] is not None
        return Replay(row[3] or b"", row[4], row[5])

    async def record_pending(self, key: LedgerKey, digest: bytes, pending: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.records[key] = (digest, "pending", pending, None, None, None)

    async def finish(self, key: LedgerKey, digest: bytes, response: bytes, status: Status,
                     code: ErrorCode | None = None) -> None:
        await trio.lowlevel.checkpoint()
        self.records[key] = (digest, "final", self.records[key][2], response, status, code)
        self.inflight.pop(key).done.set()


async def _drive(n: int, concurrency: int, one: "object") -> float:
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await one(i)  # type: ignore[operator]

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return n / (time.perf_counter() - start)


async def bench_sqlite(path: Path, n: int, concurrency: int) -> tuple[float, float, float]:
    ledger = Ledger.open(path, retention_seconds=7 * 86400)
    digest = hashlib.sha256(b"body").digest()
    tag = f"c{concurrency}"

    async def first(i: int) -> None:
        begun = await ledger.begin(LedgerKey("a" * 64, f"{tag}-{i}"), digest)
        assert isinstance(begun, Fresh)
        await ledger.record_pending(begun.ticket, PENDING)
        await ledger.finish(begun.ticket, RESPONSE, Status.SUCCEEDED)

    async def replay(i: int) -> None:
        begun = await ledger.begin(LedgerKey("a" * 64, f"{tag}-{i}"), digest)
        assert (isinstance(begun, Replay) and begun.response == RESPONSE
                and begun.status is Status.SUCCEEDED)

    try:
        commits0 = ledger.commits
        fresh_rate = await _drive(n, concurrency, first)
        commits_per_request = (ledger.commits - commits0) / n
        replay_rate = await _drive(n, concurrency, replay)
    finally:
        ledger.close()
    return fresh_rate, replay_rate, commits_per_request


async def bench_dict(n: int, concurrency: int) -> tuple[float, float]:
    ledger = DictLedger()
    digest = hashlib.sha256(b"body").digest()

    async def first(i: int) -> None:
        key = LedgerKey("a" * 64, f"r-{i}")
        assert await ledger.begin(key, digest) == "fresh"
        await ledger.record_pending(key, digest, PENDING)
        await ledger.finish(key, digest, RESPONSE, Status.SUCCEEDED)

    async def replay(i: int) -> None:
        begun = await ledger.begin(LedgerKey("a" * 64, f"r-{i}"), digest)
        assert (isinstance(begun, Replay) and begun.response == RESPONSE
                and begun.status is Status.SUCCEEDED)

    return await _drive(n, concurrency, first), await _drive(n, concurrency, replay)


def _filesystem(path: Path) -> str:
    try:
        out = subprocess.run(
            ["df", "-T", str(path)], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        return out[-1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


async def main(args: argparse.Namespace) -> None:
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"ledger benchmark: {args.requests} requests per run, db in {_filesystem(base)} "
          f"filesystem, python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    print(f"{'concurrency':>11} | {'first-time/s':>12} {'dict/s':>10} {'ratio':>6} "
          f"{'commits/req':>11} | {'replays/s':>10} {'dict/s':>10} {'ratio':>6}")
    for c in args.concurrency:
        path = base / f"ledger-c{c}.db"
        fresh, replay, cpr = await bench_sqlite(path, args.requests, c)
        dfresh, dreplay = await bench_dict(args.requests, c)
        print(f"{c:>11} | {fresh:>12,.0f} {dfresh:>10,.0f} {dfresh / fresh:>5.0f}x "
              f"{cpr:>11.3f} | {replay:>10,.0f} {dreplay:>10,.0f} {dreplay / replay:>5.0f}x")
        for suffix in ("", "-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--dir", help="where to put the database (default: a temp dir)")
    trio.run(main, parser.parse_args())
