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

Results are printed as one JSON object per line, with the relay and the settings used.

Two runs here (2 shared cores, other work running; noisy), --agents 16, --events 20/10:
  publish cold p50 3.9 / 2.3 ms, warm p50 0.54 / 0.36 ms (QUICKACK on);
  1 agent sequential 3,801 / 2,593 events/s (p50 0.25 / 0.38 ms);
  16 agents concurrent 2,183 / 1,523 events/s (p50 5.3 / 11.2 ms, p99 22.3 / 15.9 ms);
  second AUTH on one connection: refused ("auth-required: received invalid challenge"),
    and after one AUTH LocalRelay accepted EVENTs from any author;
  shared re-authenticated connection: not possible on LocalRelay (see above);
  query of one event (EVENT + EOSE): p50 44.0 ms without TCP_QUICKACK, 0.65 ms with it.
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

from daemon.relay.pool import Accepted, RelayPool, RelayTimeouts  # noqa: E402
from tests.fixtures.relay import TestKey, auth_signer_for, start_devrelay  # noqa: E402

TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=600)
RELAY = "nostr-sdk LocalRelay 0.45 (tests.devrelay --auth), loopback"


def emit(name: str, **fields: Any) -> None:
    print(json.dumps({"bench": name, "relay": RELAY, **fields}), flush=True)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(p * len(s)))]


async def cold_vs_warm(url: str, n: int) -> None:
    keys = [TestKey() for _ in range(n)]
    pool = RelayPool(url, auth_signer_for(*keys), timeouts=TIMEOUTS)
    cold: list[float] = []
    warm: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for k in keys:
            first, second = k.sign(1, "cold"), k.sign(1, "warm")
            t0 = time.perf_counter()
            assert isinstance(await pool.publish(k.pubkey, first), Accepted)
            t1 = time.perf_counter()
            assert isinstance(await pool.publish(k.pubkey, second), Accepted)
            t2 = time.perf_counter()
            cold.append(t1 - t0)
            warm.append(t2 - t1)
        nursery.cancel_scope.cancel()
    emit("publish_cold_vs_warm", agents=n, cold_p50_ms=ms(statistics.median(cold)),
         warm_p50_ms=ms(statistics.median(warm)), quickack=True)


async def per_agent_pool(url: str, agents: int, events: int) -> None:
    keys = [TestKey() for _ in range(agents)]
    signed = {k.pubkey: [k.sign(1, f"e{i}") for i in range(events)] for k in keys}
    pool = RelayPool(url, auth_signer_for(*keys), timeouts=TIMEOUTS)
    lat: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        # Warm every agent's connection first: steady state is what we compare.
        for k in keys:
            assert isinstance(await pool.publish(k.pubkey, k.sign(1, "warmup")), Accepted)

        async def agent(k: TestKey) -> None:
            for ev in signed[k.pubkey]:
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
         per_second=round(agents * events / wall), p50_ms=ms(pct(lat, 0.5)), p99_ms=ms(pct(lat, 0.99)))


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


async def shared_reauth(url: str, agents: int, events: int) -> None:
    keys = [TestKey() for _ in range(agents)]
    signed = [(k, k.sign(1, f"e{i}")) for i in range(events) for k in keys]  # interleaved
    lat: list[float] = []
    async with trio_websocket.open_websocket_url(url) as ws:
        challenge = await _challenge(ws, keys[0])
        t0 = time.perf_counter()
        for k, ev in signed:
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
    emit("shared_connection_reauth", agents=agents, events=len(signed),
         per_second=round(len(signed) / wall), p50_ms=ms(pct(lat, 0.5)), p99_ms=ms(pct(lat, 0.99)),
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
            assert isinstance(await pool.publish(k.pubkey, ev), Accepted)
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
        await cold_vs_warm(url, 20)
        await per_agent_pool(url, 1, events * 4)
        await per_agent_pool(url, agents, events)
        await multi_auth_semantics(url)
        await shared_reauth(url, agents, events)
        await query_quickack(url, 30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--events", type=int, default=20)
    args = parser.parse_args()
    trio.run(main, args.agents, args.events)
