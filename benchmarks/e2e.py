"""message.post end to end against nostr-sdk's LocalRelay: the daemon vs nostr-sdk itself.

    python benchmarks/e2e.py [--levels 1,16,64] [--duration 8]

One LocalRelay (``python -m tests.devrelay --auth``: NIP-42 AUTH required, loopback) serves
both sides, in the same run:
  daemon:   64 agents, each its own key and credential; for each concurrency level C,
            benchmarks/load.py's generator (closed loop, C requests in flight, one agent per
            connection) posts message.post over the Unix socket to `buzz-broker serve`,
            which signs in custody (SoftHSM2), records in the ledger and publishes;
  baseline: nostr-sdk's own Client, C clients each with its own key (AUTH by nostr-sdk's
            SignerAuthenticator), each signing the same kind-9 channel message with
            nostr-sdk and publishing it (`send_event`, which waits for the relay's OK) in a
            loop. This is what an agent holding its own key would pay.
Printed per level: posts/s, p50/p99 latency for both, and the ratios daemon/baseline
(throughput and p50). Everything runs on this machine: the relay, the daemon, the
generator and the baseline share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _harness as H  # noqa: E402
from benchmarks import load as L  # noqa: E402

AGENTS = 64


async def sdk_baseline(url: str, channel: str, concurrency: int, duration: float) -> dict[str, Any]:
    import nostr_sdk

    nostr_sdk.uniffi_set_event_loop(asyncio.get_running_loop())
    clients = []
    for _ in range(concurrency):
        keys = nostr_sdk.Keys.generate()
        client = nostr_sdk.ClientBuilder().authenticator(nostr_sdk.SignerAuthenticator(keys)).build()
        await client.add_relay(nostr_sdk.RelayUrl.parse(url))
        await client.connect()
        clients.append((keys, client))
    tag = nostr_sdk.Tag.parse(["h", channel])

    async def one(keys: Any, client: Any, n: int) -> bool:
        event = nostr_sdk.EventBuilder(nostr_sdk.Kind(9), f"sdk {n}").tags([tag]).finalize(keys)
        try:
            out = await client.send_event(event)
        except Exception as exc:  # noqa: BLE001 - nostr-sdk raises its own types; counted, not fatal
            print(f"nostr-sdk send_event: {type(exc).__name__}: {exc}", file=sys.stderr)
            return False
        return bool(out.success)

    # Warm-up: each client's first publish pays its AUTH (the daemon's warm-up does too).
    await asyncio.gather(*(one(k, c, -1) for k, c in clients))
    latencies: list[float] = []
    failures = 0
    deadline = time.perf_counter() + duration

    async def lane(keys: Any, client: Any) -> None:
        nonlocal failures
        n = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            ok = await one(keys, client, n)
            latencies.append(time.perf_counter() - t0)
            failures += not ok
            n += 1

    start = time.perf_counter()
    await asyncio.gather(*(lane(k, c) for k, c in clients))
    elapsed = time.perf_counter() - start
    for _, client in clients:
        await client.shutdown()
    return {"rps": round(len(latencies) / elapsed, 1), "p50_ms": round(H.pct(latencies, 0.5) * 1e3, 2),
            "p99_ms": round(H.pct(latencies, 0.99) * 1e3, 2), "failures": failures, "answered": len(latencies)}


def run_baseline(url: str, channel: str, concurrency: int, duration: float) -> dict[str, Any]:
    """The nostr-sdk side in its own process (asyncio; the daemon side is trio)."""
    done = subprocess.run([sys.executable, __file__, "--sdk", url, "--channel", channel,
                           "--concurrency", str(concurrency), "--duration", str(duration)],
                          stdout=subprocess.PIPE, text=True, timeout=duration * 4 + 120)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"the nostr-sdk baseline failed (exit {done.returncode}) with no figures")
    result: dict[str, Any] = json.loads(lines[-1])
    if done.returncode != 0:
        # Seen at interpreter exit after client shutdown; the figures were already printed.
        result["exit"] = done.returncode
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,16,64", help="concurrency levels")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per level and side")
    parser.add_argument("--sdk", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--channel", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 < args.duration <= 120:
        parser.error("--duration must be in (0, 120]")
    if args.sdk:
        print(json.dumps(asyncio.run(sdk_baseline(args.sdk, args.channel, args.concurrency, args.duration))))
        return
    levels = [int(x) for x in args.levels.split(",")]
    if not levels or min(levels) < 1 or max(levels) > AGENTS:
        parser.error(f"levels must be 1..{AGENTS}")
    print(json.dumps({"machine": H.machine(), "relay": "nostr-sdk LocalRelay 0.45 (tests.devrelay --auth), loopback"}), flush=True)
    with H.workdir() as tmp:
        token = H.make_token(tmp / "token")
        state = tmp / "state"
        channel = H.new_channel()
        pubkeys = trio.run(H.import_agents, token, state, AGENTS)
        agents = H.issue_credentials(state, pubkeys, [channel])
        agents_file = H.write_agents(tmp / "agents.json", agents)
        with H.relay_process("local") as (url, relay):
            config = H.write_config(tmp / "broker.toml", token, state, tmp / "broker.sock", url)
            with H.daemon_process(config, tmp) as daemon:
                trio.run(L.warm_up, daemon.socket, agents)
                load_args = argparse.Namespace(procs=1, rate=0.0, concurrency=1, mix={"post": 1}, seed=1,
                                               duration=args.duration, requests=1_000_000,
                                               max_outstanding=1024, profile=None)
                for level in levels:
                    ours = L.run_load(load_args, agents_file, daemon, f"daemon c={level}", relay.pid,
                                      concurrency=level, procs=1 if level < 32 else 2)
                    base = run_baseline(url, channel, level, args.duration)
                    print(json.dumps({"run": f"nostr-sdk c={level}", **base}), flush=True)
                    print(f"c={level:3d}: daemon {ours['rps']:7.1f} posts/s p50 {ours['p50_ms']:7.2f} ms "
                          f"p99 {ours['p99_ms']:7.2f} ms errors {ours['errors'] or 'none'} | nostr-sdk "
                          f"{base['rps']:7.1f} posts/s p50 {base['p50_ms']:7.2f} ms p99 {base['p99_ms']:7.2f} ms | "
                          f"ratio daemon/sdk: throughput {ours['rps'] / base['rps']:.2f}, "
                          f"p50 {ours['p50_ms'] / base['p50_ms']:.2f}", flush=True)


if __name__ == "__main__":
    main()
