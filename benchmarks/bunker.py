"""One message.post through buzz-broker vs one NIP-46 ("bunker") sign round trip, same run.

    python benchmarks/bunker.py [--requests 200] [--warmup 20] [--timeout 5]

Issue 9's latency target: one message.post against LocalRelay at low load takes at most
1/20 of the NIP-46 remote-signer round trip measured in the same run - the latency an agent
pays today when its key sits in a bunker instead of in the broker.

Everything talks through ONE relay process, nostr-sdk's LocalRelay with NIP-42 AUTH
required (``python -m tests.devrelay --auth``, loopback), as the daemon's other benchmarks do:
  bunker:  NDK's NIP-46 backend (npm ``@nostr-dev-kit/ndk``, NDKNip46Backend - what
           nsecbunkerd is built on) in a node process, holding one fresh key it generates
           itself (benchmarks/nip46/bunker.mjs);
  client:  NDK's NDKNip46Signer in a second node process (benchmarks/nip46/client.mjs):
           connects once (bunker:// URI), then asks for N kind-9 channel messages to be
           signed one after another; each figure is request sent -> signed event back
           (nip44-encrypted kind-24133 request and response through the relay, both ends
           authenticated to it). A second series does sign + publish (the signed event is
           published and the relay's OK awaited), which is what a broker post does;
  broker:  `buzz-broker serve` (SoftHSM2 token, ledger, audit on) and benchmarks/load.py's
           generator with one request in flight: N message.post requests over the Unix
           socket, each signed in custody, recorded and published, answered after the
           relay's OK.
Each side is warmed up first (connections open, AUTH done) and then timed N times; the
ratio printed is broker p50 / bunker p50 for both bunker series, with the target met when
it is at most 1/20 against the sign round trip (the bunker's lowest figure).

NDK is installed at run time with npm into the run's temporary directory (never into the
repository): ``npm install --no-audit --no-fund --no-package-lock`` of the pinned major
(--ndk) and ``ws`` (node 20 has no global WebSocket). Without node or npm, or when the
install fails or takes over --install-timeout seconds, the run stops with one line saying
so. The node scripts refuse any non-loopback address, so NDK's default outbox relays are
never dialled.

Rules: loopback only; every wait is bounded (install, node start, each round trip via the
client's --timeout, each subprocess); no key or credential is printed (the bunker's and the
client's keys are generated inside node and never leave it; agent credentials live only in
the run's 0600 agents.json).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _harness as H  # noqa: E402
from benchmarks import load as L  # noqa: E402

NIP46_DIR = Path(__file__).resolve().parent / "nip46"
#: The target: broker p50 at most this fraction of the bunker's sign round trip p50.
TARGET_RATIO = 1 / 20
#: NDK 3 is the line the workarounds in benchmarks/nip46/*.mjs were written against.
DEFAULT_NDK = "@nostr-dev-kit/ndk@3"
WS_PACKAGE = "ws@8"
NODE_START_SECONDS = 30.0


class BenchError(Exception):
    """A setup step failed; main() prints the message as one line and exits non-zero."""


def install_ndk(directory: Path, ndk_spec: str, timeout: float) -> str:
    """npm-install NDK and ws into `directory`; returns the installed NDK version."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise BenchError("node and npm are needed for the bunker (NDK is a node package); not found on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "package.json").write_text('{"name": "buzz-bench-nip46", "private": true}\n')
    try:
        done = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--no-package-lock", "--loglevel=error",
             ndk_spec, WS_PACKAGE],
            cwd=directory, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"npm install {ndk_spec} took over {timeout:g} s (registry unreachable?)") from None
    manifest = directory / "node_modules" / "@nostr-dev-kit" / "ndk" / "package.json"
    if done.returncode != 0 or not manifest.exists():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"npm install {ndk_spec} failed (exit {done.returncode}): {last}")
    version: str = json.loads(manifest.read_text())["version"]
    return version


def read_json_line(proc: subprocess.Popen[str], timeout: float, what: str) -> dict[str, Any]:
    """The next JSON line on `proc`'s stdout within `timeout` seconds."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(left):
                break
            line = proc.stdout.readline()
            if not line:
                raise BenchError(f"{what} exited (code {proc.wait(timeout=5)}) before it was ready")
            if line.startswith("{"):
                obj: dict[str, Any] = json.loads(line)
                if "error" in obj:
                    raise BenchError(f"{what}: {obj['error']}")
                return obj
    raise BenchError(f"{what} was not ready within {timeout:.0f} s")


def node_env(modules: Path) -> dict[str, str]:
    env = dict(os.environ, NIP46_MODULES=str(modules))
    env.pop("DEBUG", None)  # NDK logs through `debug`; a DEBUG inherited here would flood stderr
    return env


def run_client(modules: Path, uri: str, channel: str, n: int, warmup: int, timeout: float,
               *, publish: bool, log: Path, bunker_pid: int, relay_pid: int) -> dict[str, Any]:
    """One client process: connect, warm up, N timed requests; its summary, with the CPU the
    client, the bunker and the relay spent per request (the bunker's and relay's measured
    over the whole client run, warm-up and connect included, so a slight overestimate)."""
    bunker0, relay0 = H.proc_stat(bunker_pid), H.proc_stat(relay_pid)
    argv = ["node", str(NIP46_DIR / "client.mjs"), uri, channel, str(n), str(warmup),
            str(int(timeout * 1000)), "--auth"] + (["--publish"] if publish else [])
    bound = NODE_START_SECONDS + (n + warmup + 2) * timeout
    try:
        with open(log, "a") as err:
            done = subprocess.run(argv, env=node_env(modules), stdout=subprocess.PIPE, stderr=err,
                                  text=True, timeout=bound, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"the NIP-46 client took over {bound:.0f} s") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise BenchError(f"the NIP-46 client printed nothing (exit {done.returncode}; see its log)")
    out: dict[str, Any] = json.loads(lines[-1])
    if "error" in out:
        raise BenchError(f"the NIP-46 client: {out['error']}")
    ms: list[float] = out["latencies_ms"]
    bunker_cpu = H.proc_stat(bunker_pid).cpu_seconds - bunker0.cpu_seconds
    relay_cpu = H.proc_stat(relay_pid).cpu_seconds - relay0.cpu_seconds
    total = n + warmup
    return {"run": "bunker sign + publish" if publish else "bunker sign", "answered": len(ms),
            "failures": out["failures"], "p50_ms": round(H.pct(ms, 0.5), 2), "p90_ms": round(H.pct(ms, 0.9), 2),
            "min_ms": round(min(ms, default=float("nan")), 2), "max_ms": round(max(ms, default=float("nan")), 2),
            "client_cpu_ms_per_req": round(out["cpu_ms"] / max(1, len(ms)), 2),
            "bunker_cpu_ms_per_req": round(bunker_cpu * 1e3 / total, 2),
            "relay_cpu_ms_per_req": round(relay_cpu * 1e3 / total, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="timed requests per series (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests first (default 20)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds allowed per round trip (default 5)")
    parser.add_argument("--install-timeout", type=float, default=300.0, help="seconds allowed for npm install")
    parser.add_argument("--ndk", default=DEFAULT_NDK, help=f"npm spec of NDK to install (default {DEFAULT_NDK})")
    args = parser.parse_args()
    if not 0 < args.requests <= 10_000 or not 0 <= args.warmup <= 1_000:
        parser.error("--requests must be 1..10000 and --warmup 0..1000")
    if not 0 < args.timeout <= 60 or not 0 < args.install_timeout <= 1800:
        parser.error("--timeout must be in (0, 60] and --install-timeout in (0, 1800]")
    try:
        run(args)
    except BenchError as exc:
        print(f"bunker benchmark: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def run(args: argparse.Namespace) -> None:
    with H.workdir() as tmp:
        modules = tmp / "nip46"
        ndk_version = install_ndk(modules, args.ndk, args.install_timeout)
        node_version = subprocess.run(["node", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        print(json.dumps({"machine": H.machine(), "relay": "nostr-sdk LocalRelay 0.45 (tests.devrelay --auth), loopback",
                          "ndk": ndk_version, "node": node_version}), flush=True)
        token = H.make_token(tmp / "token")
        state = tmp / "state"
        channel = H.new_channel()
        pubkeys = trio.run(H.import_agents, token, state, 1)
        agents = H.issue_credentials(state, pubkeys, [channel])
        agents_file = H.write_agents(tmp / "agents.json", agents)
        with H.relay_process("local") as (url, relay):
            with open(tmp / "bunker.log", "a") as bunker_log:
                bunker = subprocess.Popen(["node", str(NIP46_DIR / "bunker.mjs"), url, "--auth"],
                                          env=node_env(modules), stdout=subprocess.PIPE, stderr=bunker_log, text=True)
            try:
                uri = str(read_json_line(bunker, NODE_START_SECONDS, "the NDK bunker")["bunker"])
                config = H.write_config(tmp / "broker.toml", token, state, tmp / "broker.sock", url)
                with H.daemon_process(config, tmp) as daemon:
                    results = measure(args, modules, uri, channel, agents, agents_file, daemon,
                                      relay.pid, bunker.pid, tmp)
            finally:
                H.stop(bunker)
    report(results)


def measure(args: argparse.Namespace, modules: Path, uri: str, channel: str, agents: list[H.Agent],
            agents_file: Path, daemon: H.Daemon, relay_pid: int, bunker_pid: int,
            tmp: Path) -> dict[str, dict[str, Any]]:
    """The three series, one after another on the same relay: broker, bunker sign, sign + publish."""
    trio.run(L.warm_up, daemon.socket, agents)
    # Warm-up posts beyond warm_up's one: the same number of untimed requests as the bunker gets.
    warm = argparse.Namespace(procs=1, rate=0.0, concurrency=1, mix={"post": 1}, seed=1, duration=120.0,
                              requests=max(1, args.warmup), max_outstanding=1024, profile=None)
    L.run_load(warm, agents_file, daemon, "broker warm-up", relay_pid)
    timed = argparse.Namespace(**{**vars(warm), "requests": args.requests})
    broker = L.run_load(timed, agents_file, daemon, "broker message.post c=1", relay_pid)
    if broker["answered"] != args.requests or broker["errors"]:
        raise BenchError(f"the broker answered {broker['answered']}/{args.requests} with errors {broker['errors']}")
    out = {"broker": broker}
    for publish in (False, True):
        one = run_client(modules, uri, channel, args.requests, args.warmup, args.timeout,
                         publish=publish, log=tmp / "client.log", bunker_pid=bunker_pid, relay_pid=relay_pid)
        print(json.dumps(one), flush=True)
        out["publish" if publish else "sign"] = one
    return out


def report(results: dict[str, dict[str, Any]]) -> None:
    broker, sign, both = results["broker"], results["sign"], results["publish"]
    ratio_sign = broker["p50_ms"] / sign["p50_ms"]
    ratio_both = broker["p50_ms"] / both["p50_ms"]
    met = ratio_sign <= TARGET_RATIO
    print(json.dumps({"run": "ratio", "broker_p50_ms": broker["p50_ms"], "bunker_sign_p50_ms": sign["p50_ms"],
                      "bunker_sign_publish_p50_ms": both["p50_ms"], "broker_over_bunker_sign": round(ratio_sign, 4),
                      "broker_over_bunker_sign_publish": round(ratio_both, 4), "target": TARGET_RATIO,
                      "met": met, "loadavg": H.machine()["loadavg"]}), flush=True)
    print(f"broker message.post (sign + record + publish): p50 {broker['p50_ms']:.2f} ms, p90 {broker['p90_ms']:.2f} ms\n"
          f"NIP-46 bunker sign round trip (NDK):           p50 {sign['p50_ms']:.2f} ms, p90 {sign['p90_ms']:.2f} ms\n"
          f"NIP-46 bunker sign + publish (NDK):            p50 {both['p50_ms']:.2f} ms, p90 {both['p90_ms']:.2f} ms\n"
          f"ratio broker/bunker p50: {ratio_sign:.3f} of the sign round trip (1/{1 / ratio_sign:.1f}), "
          f"{ratio_both:.3f} of sign + publish (1/{1 / ratio_both:.1f}); target <= 1/20 of the round trip: "
          f"{'met' if met else 'MISSED'}", flush=True)


if __name__ == "__main__":
    main()
