"""Relay connections: one per agent vs one shared and re-authenticated; TCP_QUICKACK on/off.

    .venv/bin/python benchmarks/relay_connections.py [--agents 16] [--events 20]

Against nostr-sdk's LocalRelay (the development relay, ``tests.devrelay --auth``, NIP-42
required for read and write) on loopback. Events are signed before timing starts, so the
figures are the relay client's cost (connect, AUTH, EVENT/OK, REQ/EOSE), not signing.

What it measures:
1. cold vs warm publish through RelayPool (cold = TCP + WebSocket + refused EVENT + AUTH +
   resend; warm = EVENT/OK on an authenticated connection);
2. N agents x M events published concurrently, (a) RelayPool: one connection per agent,
   (b) one shared raw connection that re-authenticates before each agent's event (the
   alternative design: AUTH-as-agent then EVENT must be serialized);
3. whether LocalRelay accepts several AUTHs on one connection, and for whom it then
   accepts events (decides whether design (b) is even correct there);
4. query latency (REQ -> EVENT + EOSE, two frames) with TCP_QUICKACK re-armed vs not:
   LocalRelay does not set TCP_NODELAY, so without quick ACKs the EOSE waits for our
   delayed ACK.

Baseline in the same run: ``raw_event_ok``, EVENT -> OK one at a time on an authenticated
trio-websocket connection without the pool; the pool's warm figures are printed as ratios
to it (``*_vs_raw``). Also:
5. a burst of 60 publishes on each of 10 fresh connections (``cold_burst``): wall time,
   publishes not accepted, and the wall time as a ratio to one cold publish;
6. the AUTH gate's cost on an open gate (``gate_open_passage``), in-process.

Results are printed as one JSON object per line, with the relay and the settings used.

Two runs here (2 shared cores, other work running; noisy), --agents 16, --events 20/10:
  publish cold p50 3.9 / 2.3 ms, warm p50 0.54 / 0.36 ms (QUICKACK on);
  1 agent sequential 3,801 / 2,593 events/s (p50 0.25 / 0.38 ms);
  16 agents concurrent 2,183 / 1,523 events/s (p50 5.3 / 11.2 ms, p99 22.3 / 15.9 ms);
  second AUTH on one connection: refused ("auth-required: received invalid challenge"),
    and after one AUTH LocalRelay accepted EVENTs from any author;
  shared re-authenticated connection: not possible on LocalRelay (see above);
  query of one event (EVENT + EOSE): p50 44.0 ms without TCP_QUICKACK, 0.65 ms with it.

The AUTH gate (daemon/relay/gate.py), six runs each of the pool before and after it,
alternating, defaults and --events 50 (load average 1.0-1.8 from neighbours; noisy):
  raw EVENT -> OK p50 0.34-0.84 ms;
  1 agent sequential p50 / raw: before 1.16-1.77 (median 1.38), after 0.92-2.06 (1.32);
  cold publish p50 5.8-8.2 ms either side (this load; 2.3-3.9 ms above was quieter);
  cold burst of 60, p50 wall: before 27-57 ms, after 31-58 ms; not accepted 0 either side
    (the race needs a relay slower than the client: tests/relay/test_auth_burst.py);
  open gate: 1.2 us a request (0.14 % of a raw round trip).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio
import trio_websocket

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.relay.gate import AuthGate  # noqa: E402
from daemon.relay.pool import Accepted, RelayPool, RelayTimeouts  # noqa: E402
from tests.fixtures.relay import TestKey, auth_signer_for, signed, start_devrelay  # noqa: E402

TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=600)
RELAY = "nostr-sdk LocalRelay 0.45 (tests.devrelay --auth), loopback"


def emit(name: str, **fields: Any) -> None:
    print(json.dumps({"bench": name, "relay": RELAY, **fields}), flush=True)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(p * len(s)))]


async def cold_vs_warm(url: str, n: int, raw_p50: float) -> float:
    keys = [TestKey() for _ in range(n)]
    pool = RelayPool(url, auth_signer_for(*keys), timeouts=TIMEOUTS)
    cold: list[float] = []
    warm: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for k in keys:
            first, second = signed(k.sign(1, "cold")), signed(k.sign(1, "warm"))
            t0 = time.perf_counter()
            assert isinstance(await pool.publish(k.pubkey, first), Accepted)
            t1 = time.perf_counter()
            assert isinstance(await pool.publish(k.pubkey, second), Accepted)
            t2 = time.perf_counter()
            cold.append(t1 - t0)
            warm.append(t2 - t1)
        nursery.cancel_scope.cancel()
    emit("publish_cold_vs_warm", agents=n, cold_p50_ms=ms(statistics.median(cold)),
         warm_p50_ms=ms(statistics.median(warm)), quickack=True,
         warm_vs_raw=round(statistics.median(warm) / raw_p50, 2))
    return statistics.median(cold)


async def per_agent_pool(url: str, agents: int, events: int, raw_p50: float) -> None:
    keys = [TestKey() for _ in range(agents)]
    ready = {k.pubkey: [signed(k.sign(1, f"e{i}")) for i in range(events)] for k in keys}
    pool = RelayPool(url, auth_signer_for(*keys), timeouts=TIMEOUTS)
    lat: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        # Warm every agent's connection first: steady state is what we compare.
        for k in keys:
            assert isinstance(await pool.publish(k.pubkey, signed(k.sign(1, "warmup"))), Accepted)

        async def agent(k: TestKey) -> None:
            for ev in ready[k.pubkey]:
                t0 = time.perf_counter()
                assert isinstance(await pool.publish(k.pubkey, ev), Accepted)
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        async with trio.open_nursery() as inner:
            for k in keys:
                inner.start_soon(agent, k)
        wall = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    emit("per_agent_connections", agents=agents, events=agents * events,
         per_second=round(agents * events / wall), p50_ms=ms(pct(lat, 0.5)), p99_ms=ms(pct(lat, 0.99)),
         p50_vs_raw=round(pct(lat, 0.5) / raw_p50, 2))


async def _ok(ws: trio_websocket.WebSocketConnection, event_id: str) -> list[Any]:
    while True:
        msg: list[Any] = json.loads(await ws.get_message())
        if msg[0] == "OK" and msg[1] == event_id:
            return msg


async def _challenge(ws: trio_websocket.WebSocketConnection, k: TestKey) -> str:
    # LocalRelay challenges only after a refusal: provoke one.
    probe = k.sign(1, "probe")
    await ws.send_message(json.dumps(["EVENT", probe]))
    challenge = ""
    while True:
        msg = json.loads(await ws.get_message())
        if msg[0] == "AUTH":
            challenge = msg[1]
        if msg[0] == "OK" and msg[1] == probe["id"]:
            return challenge


async def raw_event_ok(url: str, n: int) -> float:
    """The baseline: EVENT -> OK, one at a time, on an authenticated raw connection (no
    pool: frames encoded before timing). Returns its p50 in seconds."""
    k = TestKey()
    frames = [(ev["id"], json.dumps(["EVENT", ev])) for ev in (k.sign(1, f"raw {i}") for i in range(n))]
    lat: list[float] = []
    async with trio_websocket.open_websocket_url(url) as ws:
        challenge = await _challenge(ws, k)
        auth = k.sign(22242, "", [["relay", url], ["challenge", challenge]])
        await ws.send_message(json.dumps(["AUTH", auth]))
        assert (await _ok(ws, auth["id"]))[2] is True
        for event_id, frame in frames:
            t0 = time.perf_counter()
            await ws.send_message(frame)
            assert (await _ok(ws, event_id))[2] is True
            lat.append(time.perf_counter() - t0)
    emit("raw_event_ok", events=n, p50_ms=ms(pct(lat, 0.5)), p99_ms=ms(pct(lat, 0.99)),
         note="baseline: trio-websocket alone, authenticated, no pool")
    return pct(lat, 0.5)


async def gate_open_passage(n: int, raw_p50: float) -> None:
    """What an open AUTH gate adds to every warm request: `passage` on an open gate, timed
    in-process, as a fraction of the raw EVENT -> OK round trip."""
    gate = AuthGate()
    gate.open()
    t0 = time.perf_counter()
    for _ in range(n):
        async with gate.passage(TIMEOUTS.ok):
            pass
    per = (time.perf_counter() - t0) / n
    emit("gate_open_passage", passages=n, per_us=round(per * 1e6, 2),
         share_of_raw_event_ok=round(per / raw_p50, 4))


async def cold_burst(url: str, rounds: int, burst: int, cold_p50: float) -> None:
    """`burst` publishes at once on each of `rounds` fresh connections (new agents): the
    AUTH gate's cost cold (one probe, then everyone) and what went wrong."""
    keys = [TestKey() for _ in range(rounds)]
    pool = RelayPool(url, auth_signer_for(*keys), timeouts=TIMEOUTS)
    walls: list[float] = []
    failed = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for k in keys:
            events = [signed(k.sign(1, f"burst {i}")) for i in range(burst)]
            results: list[object] = []

            async def one(ev: Any, k: TestKey = k, results: list[object] = results) -> None:
                results.append(await pool.publish(k.pubkey, ev))

            t0 = time.perf_counter()
            async with trio.open_nursery() as inner:
                for ev in events:
                    inner.start_soon(one, ev)
            walls.append(time.perf_counter() - t0)
            failed += sum(not isinstance(r, Accepted) for r in results)
        nursery.cancel_scope.cancel()
    emit("cold_burst", rounds=rounds, burst=burst, wall_p50_ms=ms(statistics.median(walls)),
         wall_max_ms=ms(max(walls)), not_accepted=failed,
         wall_p50_vs_cold_publish=round(statistics.median(walls) / cold_p50, 2))


async def shared_reauth(url: str, agents: int, events: int) -> None:
    keys = [TestKey() for _ in range(agents)]
    interleaved = [(k, k.sign(1, f"e{i}")) for i in range(events) for k in keys]
    lat: list[float] = []
    async with trio_websocket.open_websocket_url(url) as ws:
        challenge = await _challenge(ws, keys[0])
        t0 = time.perf_counter()
        for k, ev in interleaved:
            s = time.perf_counter()
            auth = k.sign(22242, "", [["relay", url], ["challenge", challenge]])
            await ws.send_message(json.dumps(["AUTH", auth]))
            answer = await _ok(ws, auth["id"])
            if answer[2] is not True:
                emit("shared_connection_reauth", agents=agents, refused=answer[2:],
                     note="the relay refuses a second AUTH on one connection")
                return
            await ws.send_message(json.dumps(["EVENT", ev]))
            ok = await _ok(ws, ev["id"])
            assert ok[2] is True, ok
            lat.append(time.perf_counter() - s)
        wall = time.perf_counter() - t0
    emit("shared_connection_reauth", agents=agents, events=len(interleaved),
         per_second=round(len(interleaved) / wall), p50_ms=ms(pct(lat, 0.5)), p99_ms=ms(pct(lat, 0.99)),
         note="AUTH signing (~0.1 ms) included per switch")


async def multi_auth_semantics(url: str) -> None:
    a, b, c = TestKey(), TestKey(), TestKey()
    async with trio_websocket.open_websocket_url(url) as ws:
        challenge = await _challenge(ws, a)
        auth_answers = []
        for k in (a, b):
            auth = k.sign(22242, "", [["relay", url], ["challenge", challenge]])
            await ws.send_message(json.dumps(["AUTH", auth]))
            auth_answers.append((await _ok(ws, auth["id"]))[2:])
        verdicts: dict[str, Any] = {"auth_answers": auth_answers}
        for name, k in (("first_authed", a), ("second_authed", b), ("never_authed", c)):
            ev = k.sign(1, name)
            await ws.send_message(json.dumps(["EVENT", ev]))
            ok = await _ok(ws, ev["id"])
            verdicts[name] = ok[2:]
    emit("two_auths_on_one_connection", accepts=verdicts,
         note="whether a relay keeps both pubkeys is the relay's choice (NIP-42)")


async def query_quickack(url: str, rounds: int) -> None:
    k = TestKey()
    for quickack in (False, True):
        pool = RelayPool(url, auth_signer_for(k), timeouts=TIMEOUTS, tcp_quickack=quickack)
        lat: list[float] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            ev = k.sign(1, f"q {quickack}")
            assert isinstance(await pool.publish(k.pubkey, signed(ev)), Accepted)
            await pool.query(k.pubkey, [{"ids": [ev["id"]]}])  # warm
            for _ in range(rounds):
                t0 = time.perf_counter()
                got = await pool.query(k.pubkey, [{"ids": [ev["id"]]}])
                lat.append(time.perf_counter() - t0)
                assert len(got) == 1
            nursery.cancel_scope.cancel()
        emit("query_one_event", quickack=quickack, rounds=rounds,
             p50_ms=ms(pct(lat, 0.5)), p99_ms=ms(pct(lat, 0.99)))


async def main(agents: int, events: int) -> None:
    with start_devrelay(auth=True) as (url, _proc):
        raw_p50 = await raw_event_ok(url, 200)
        cold_p50 = await cold_vs_warm(url, 20, raw_p50)
        await per_agent_pool(url, 1, events * 4, raw_p50)
        await per_agent_pool(url, agents, events, raw_p50)
        await cold_burst(url, 10, 60, cold_p50)
        await gate_open_passage(100_000, raw_p50)
        await multi_auth_semantics(url)
        await shared_reauth(url, agents, events)
        await query_quickack(url, 30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--events", type=int, default=20)
    args = parser.parse_args()
    trio.run(main, args.agents, args.events)
