"""channel.read throughput: pages of 100 through the operation vs the raw relay query.

Against nostr-sdk's LocalRelay (a subprocess, NIP-42 AUTH required, per-filter cap 500),
through our RelayPool (TCP_QUICKACK re-armed after reads, the pool's default). The
channel holds `--events` kind-9 messages: most one per second, plus `--crowd` of them in
one second, so pages cross a crowded second the way the paging test does.

Measured in the same run:
- operation: `channel.read` `execute()` walking the whole channel with limit 100,
  following nextCursor — id/signature verification, the channel/filter checks, the
  boundary sweeps and the cursor MAC included. Per page: latency p50/p99, relay round
  trips, and events/s.
- raw: one `RelayPool.query` per page position with the plain filter
  `{"kinds":[9,40002], "#h":[channel], "until": t, "limit": 100}` — one relay round trip,
  no checks, and (by itself) not exact inside a crowded second. The baseline.
Ratio = operation time per page / raw time per page. Best of `--rounds` walks.

Run: python benchmarks/read.py [--events 2000] [--crowd 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from custody import verify_event  # noqa: E402
from buzzwire.contract import ChannelReadArgs, ReadOutcome, Status  # noqa: E402
from daemon.relay.cursor import CursorCodec  # noqa: E402
from daemon.operations import channel_read  # noqa: E402
from daemon.relay.pool import Accepted, RelayPool, RelayTimeouts  # noqa: E402
from tests.fixtures.relay import TestKey, auth_signer_for, signed, start_devrelay  # noqa: E402
from tests.read._support import NOW, context, new_channel, principal_for  # noqa: E402

LIMIT = 100
TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=600)


class CountingPool:
    """The pool's query, counted (round trips per page)."""

    def __init__(self, pool: RelayPool) -> None:
        self.pool = pool
        self.calls = 0

    async def query(self, agent: str, filters: Any) -> list[dict[str, Any]]:
        self.calls += 1
        return await self.pool.query(agent, filters)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    reader, author = TestKey(), TestKey()
    channel = new_channel()
    crowd_second = NOW - args.events
    events = [
        author.sign(9, f"message {n}", [["h", channel]], crowd_second if n < args.crowd else NOW - n)
        for n in range(args.events)
    ]
    with start_devrelay(auth=True) as (url, _proc), tempfile.TemporaryDirectory() as tmp:
        pool = RelayPool(url, auth_signer_for(reader, author), timeouts=TIMEOUTS)
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            limiter = trio.CapacityLimiter(32)

            async def publish(ev: dict[str, Any]) -> None:
                async with limiter:
                    # The pool publishes only a SignedEvent: the type signing makes.
                    assert isinstance(await pool.publish(author.pubkey, signed(ev)), Accepted)

            async with trio.open_nursery() as pub:
                for ev in events:
                    pub.start_soon(publish, ev)

            counting = CountingPool(pool)
            principal = principal_for(Path(tmp), reader.pubkey, [channel])
            ctx = context(counting, principal, CursorCodec.open(tmp))
            best_op: tuple[float, list[float], list[int], list[int]] | None = None
            best_raw: tuple[float, list[float]] | None = None
            for _ in range(args.rounds):
                latencies: list[float] = []
                trips: list[int] = []
                positions: list[int] = []  # the `until` of each page, for the raw baseline
                cursor = None
                seen = 0
                start = time.perf_counter()
                while True:
                    before, t0 = counting.calls, time.perf_counter()
                    verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel, limit=LIMIT, cursor=cursor))
                    latencies.append(time.perf_counter() - t0)
                    trips.append(counting.calls - before)
                    outcome = verdict.outcome
                    assert verdict.status is Status.SUCCEEDED and isinstance(outcome, ReadOutcome)
                    page = outcome.messages
                    positions.append(page[0].created_at if page else 0)
                    seen += len(page)
                    cursor = outcome.next_cursor
                    if cursor is None:
                        break
                total = time.perf_counter() - start
                assert seen == args.events, (seen, args.events)
                if best_op is None or total < best_op[0]:
                    best_op = (total, latencies, trips, positions)

                raw_lat: list[float] = []
                start = time.perf_counter()
                for until in positions:
                    t0 = time.perf_counter()
                    got = await pool.query(reader.pubkey, [{"kinds": [9, 40002], "#h": [channel], "until": until, "limit": LIMIT}])
                    raw_lat.append(time.perf_counter() - t0)
                    assert got or until == 0
                raw_total = time.perf_counter() - start
                if best_raw is None or raw_total < best_raw[0]:
                    best_raw = (raw_total, raw_lat)
            nursery.cancel_scope.cancel()

    assert best_op is not None and best_raw is not None
    total, latencies, trips, _ = best_op
    raw_total, raw_lat = best_raw
    pages = len(latencies)
    print("relay: nostr-sdk LocalRelay (subprocess, NIP-42 AUTH, cap 500); client: RelayPool, TCP_QUICKACK on")
    print(f"channel: {args.events} events, {args.crowd} in one second; limit {LIMIT}; {pages} pages; best of {args.rounds}")
    print(f"operation: {pages / total:8.1f} pages/s {args.events / total:9.0f} events/s  "
          f"p50 {pct(latencies, 0.5) * 1e3:6.1f} ms  p99 {pct(latencies, 0.99) * 1e3:6.1f} ms  "
          f"round trips/page mean {statistics.mean(trips):.2f} max {max(trips)}")
    print(f"raw query: {pages / raw_total:8.1f} pages/s {args.events / raw_total:9.0f} events/s  "
          f"p50 {pct(raw_lat, 0.5) * 1e3:6.1f} ms  p99 {pct(raw_lat, 0.99) * 1e3:6.1f} ms  (1 round trip, no checks)")
    print(f"ratio operation/raw time per page: {total / raw_total:.2f}")
    t0 = time.perf_counter()
    for ev in events:
        assert verify_event(ev)
    per_event = (time.perf_counter() - t0) / len(events)
    print(f"of which id+signature checks (custody.verify_event): {per_event * 1e6:.0f} us/event, "
          f"{per_event * LIMIT * 1e3:.1f} ms per page of {LIMIT}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--crowd", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    trio.run(main, parser.parse_args())
