"""What the audit log and the rate limiter cost a request.

Prints, for 1, 16 and 64 concurrent appenders (trio tasks, each appending verdict records
back to back, like requests finishing): records made durable per second, records per
fsync (group commit), and the mean time one append takes — next to the same run with a
no-op append (a checkpoint). Two costs per request follow: the added latency (how much
longer one request waits for its record to be durable) and the amortized cost (wall time
per record at that concurrency, minus the no-op's: what the log takes from throughput). Then the
rate limiter's `take()` per call. Each run lasts `--seconds`; the machine is shared, so
treat the figures as orders of magnitude. Run: python benchmarks/audit.py [--dir DIR]
(DIR should be on the disk the state directory lives on; fsync cost is the disk's).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

# The repository first: run as a script, benchmarks/ is sys.path[0], and its custody.py
# would shadow the custody package the daemon's modules import.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from buzzwire.contract import Status  # noqa: E402
from daemon.state.audit import AuditLog, AuditRecord, BodyDigest, Phase  # noqa: E402
from daemon.state.ratelimit import DEFAULT_RATE_CONFIG, RateLimiter  # noqa: E402

AGENT = "ab" * 32
CRED = "cred_0123456789abcdef"


def make_record(n: int) -> AuditRecord:
    return AuditRecord(
        phase=Phase.VERDICT, at=time.time(), credential_id=CRED, agent=AGENT,
        action="message.post", request_id=f"bench-{n}",
        body=BodyDigest.mac(hashlib.sha256(b"%d" % n).hexdigest()), status=Status.SUCCEEDED,
        code=None, events=(hashlib.sha256(b"e%d" % n).hexdigest(),),
    )


async def drive(append: Callable[[AuditRecord], Awaitable[None]], tasks: int,
                seconds: float) -> tuple[int, float, float]:
    """(records, elapsed, mean seconds per append) for `tasks` appenders."""
    done = 0
    busy = 0.0
    deadline = time.perf_counter() + seconds

    async def appender(offset: int) -> None:
        nonlocal done, busy
        n = offset
        while time.perf_counter() < deadline:
            record = make_record(n)
            start = time.perf_counter()
            await append(record)
            busy += time.perf_counter() - start
            done += 1
            n += tasks

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for t in range(tasks):
            nursery.start_soon(appender, t)
    elapsed = time.perf_counter() - start
    return done, elapsed, busy / max(done, 1)


async def noop(record: AuditRecord) -> None:
    await trio.lowlevel.checkpoint()


async def main(directory: Path, seconds: float) -> None:
    print(f"audit directory: {directory} ({seconds:.1f} s per run)")
    print(f"{'appenders':>9} {'records/s':>10} {'per fsync':>9} {'append µs':>10} "
          f"{'no-op rec/s':>12} {'no-op µs':>9} {'added latency µs':>17} {'amortized µs':>13}")
    for tasks in (1, 16, 64):
        log = AuditLog.open(directory / f"run-{tasks}")
        count, elapsed, per = await drive(log.append, tasks, seconds)
        batches = log.batches
        await log.aclose()
        base_count, base_elapsed, base_per = await drive(noop, tasks, seconds)
        print(f"{tasks:>9} {count / elapsed:>10,.0f} {count / max(batches, 1):>9.1f} "
              f"{per * 1e6:>10,.0f} {base_count / base_elapsed:>12,.0f} "
              f"{base_per * 1e6:>9,.1f} {(per - base_per) * 1e6:>17,.0f} "
              f"{(elapsed / count - base_elapsed / base_count) * 1e6:>13,.1f}")

    # The limiter's hot path: a dict walk per request, no I/O.
    with tempfile.TemporaryDirectory(dir=directory) as state:
        from daemon.state.sessions import SessionStore

        store = SessionStore.open(Path(state))
        _cid, token = store.issue(agent=AGENT, channels=frozenset(
            {"123e4567-e89b-12d3-a456-426614174000"}), actions=frozenset({"message.post"}),
            ttl_seconds=None, uid=None, now=int(time.time()))
        principal = store.authenticate(f"Bearer {token}", None, int(time.time()))
        assert principal is not None
        limiter = RateLimiter.open(Path(state), DEFAULT_RATE_CONFIG)
        calls = 200_000
        now = time.time()
        start = time.perf_counter()
        for i in range(calls):
            limiter.take(principal, "message.post", now + i)  # 1 s apart: always allowed
        took = time.perf_counter() - start
        flush_start = time.perf_counter()
        limiter.flush()
        flushed = time.perf_counter() - flush_start
        limiter.close()
        print(f"rate limiter take(): {calls / took:,.0f} calls/s ({took / calls * 1e6:.2f} µs "
              f"each); one flush of the dirty counters: {flushed * 1e3:.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    if args.dir:
        trio.run(main, Path(args.dir), args.seconds)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trio.run(main, Path(tmp), args.seconds)
