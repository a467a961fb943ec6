"""Startup: process start to READY=1, and RSS, with 10 and 10,000 agents and credentials.

    python benchmarks/startup.py [--sizes 10,10000] [--repeat 3]

For each size N: a fresh SoftHSM2 token and state directory with N agent keys sealed in
the keystore (benchmarks/_harness.bulk_agents: sealed by the token exactly as custody
does, written in one transaction) and N credentials (one per agent, through
`SessionStore.issue`), then `buzz-broker serve` started --repeat times against the null
relay. Measured each time, from just before the process is spawned:
  - seconds to the ``READY=1`` datagram on our NOTIFY_SOCKET (what systemd waits for);
  - the daemon's RSS right after READY=1 and after one request per 100 agents
    (storage.address, no relay I/O) has touched the credential and keystore lookups.
The baseline in the same run is N=10: the ratio large/small says whether startup work
grows with the number of agents (custody unseals nothing at open; the credential table
is loaded whole).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _harness as H  # noqa: E402
from benchmarks.load import Conn, body  # noqa: E402


async def touch(socket_path: Path, agents: list[H.Agent]) -> int:
    ok = 0
    for agent in agents:
        conn = Conn(str(socket_path), agent.credential)
        status, raw = await conn.post(body("storage.address", {"slug": "mem/notes"}))
        await conn.close()
        answer = json.loads(raw) if raw else {}
        if status == 200 and answer.get("status") == "succeeded":
            ok += 1
        else:
            print(json.dumps({"http": status, "answer": answer}), file=sys.stderr)
    return ok


def measure(n: int, repeat: int) -> dict[str, object]:
    with H.workdir() as tmp:
        token = H.make_token(tmp / "token")
        state = tmp / "state"
        t0 = time.perf_counter()
        pubkeys = H.bulk_agents(token, state, n)
        channels = [H.new_channel() for _ in range(max(1, n // 100))]
        agents = H.issue_credentials(state, pubkeys, channels)
        setup = time.perf_counter() - t0
        ready: list[float] = []
        rss_ready: list[float] = []
        rss_used: list[float] = []
        with H.relay_process("null") as (url, _relay):
            config = H.write_config(tmp / "broker.toml", token, state, tmp / "broker.sock", url)
            for _ in range(repeat):
                with H.daemon_process(config, tmp) as daemon:
                    ready.append(daemon.ready_seconds)
                    rss_ready.append(H.proc_stat(daemon.pid).rss_bytes / 2**20)
                    sample = agents[:: max(1, n // 100)]
                    ok = trio.run(touch, daemon.socket, sample)
                    if ok != len(sample):
                        raise SystemExit(f"only {ok} of {len(sample)} requests succeeded")
                    rss_used.append(H.proc_stat(daemon.pid).rss_bytes / 2**20)
        result = {
            "agents": n, "credentials": n, "setup_s": round(setup, 1),
            "ready_s": [round(x, 3) for x in ready], "ready_median_s": round(statistics.median(ready), 3),
            "rss_ready_mb": [round(x, 1) for x in rss_ready],
            "rss_after_requests_mb": [round(x, 1) for x in rss_used],
        }
        print(json.dumps(result), flush=True)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,10000", help="comma-separated agent counts (first is the baseline)")
    parser.add_argument("--repeat", type=int, default=3, help="daemon starts per size")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        # One size per process: a PKCS#11 module loaded in a process keeps the first
        # SOFTHSM2_CONF it saw, so each size's fresh token needs a fresh process.
        measure(args.one, args.repeat)
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    if not sizes or min(sizes) <= 0 or max(sizes) > 100_000 or not 0 < args.repeat <= 10:
        parser.error("sizes must be 1..100000 and repeat 1..10")
    print(json.dumps({"machine": H.machine(), "relay": "null relay (benchmarks/null_relay.py)"}), flush=True)
    results = []
    for n in sizes:
        done = subprocess.run([sys.executable, __file__, "--one", str(n), "--repeat", str(args.repeat)],
                              stdout=subprocess.PIPE, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"size {n} failed")
        line = done.stdout.strip().splitlines()[-1]
        print(line, flush=True)
        results.append(json.loads(line))
    base = results[0]
    for r in results[1:]:
        print(f"{r['agents']} agents: READY=1 median {r['ready_median_s']} s "
              f"(x{float(r['ready_median_s']) / float(base['ready_median_s']):.2f} of {base['agents']} agents), "
              f"RSS {max(r['rss_after_requests_mb'])} MB max "
              f"(x{max(r['rss_after_requests_mb']) / max(base['rss_after_requests_mb']):.2f})")


if __name__ == "__main__":
    main()
