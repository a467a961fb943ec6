"""A Buzz-shaped fleet against the daemon, beside a pinned baseline (issue 24 item 4).

    python benchmarks/fleet.py [--agents 16] [--channels 4] [--interval-ms 250]
                               [--post-rate 10] [--mention-share 1] [--duration 10] [--warmup 3]
                               [--relay both|null|local] [--procs 2] [--timer-origin start|ready]
                               [--baseline 75ee3f5 | --no-baseline]
                               [--search-max 128 | --no-search] [--search-duration 4]
                               [--profile PREFIX]

What runs (loopback and Unix sockets only, one temporary directory, removed afterwards):
  1. a fresh SoftHSM2 token (benchmarks/_harness.py);
  2. the **baseline**: commit --baseline (default 75ee3f5, the landed code before issue 24's
     polling work), built once into a cache outside the checkout (`git archive` of the
     commit, and a venv with it installed): $BUZZ_BROKER_BENCH_CACHE, else
     $XDG_CACHE_HOME/buzz-broker-bench, else ~/.cache/buzz-broker-bench. A later run reuses
     it. Its setup and its daemon run without the caller's PYTHONPATH (and the rest of
     _harness.IMPORT_REDIRECTS), and before its daemon starts, the check that its `daemon`
     is imported from under its own cache home (_harness.check_pinned_imports);
  3. per relay (the null relay, benchmarks/null_relay.py, and nostr-sdk's LocalRelay): one
     relay process; M channels, each holding 100 signed events before the load (canned
     for the null relay; posted through the daemon for LocalRelay), so every default window
     is 100 events;
  4. per build (this checkout, then the baseline): its own state directory made by that
     build's own code (agents through `Custody.import_agent`, credentials through
     `SessionStore.issue`, bound to our uid), its own `buzz-broker serve`. This checkout is
     driven over loopback TCP (`[server] listen_tcp`, `http://localhost:PORT`, as Buzz's
     transport names it); the baseline over its Unix socket, as the issue measured it;
  5. --procs generator processes running N agents of tests/fleet/buzz_agent.py (Buzz's
     runtime as ../shared/spec/buzz-client.md describes it: start calls, one channel.read
     per channel every --interval-ms with a fresh UUIDv4, strict reading, de-duplication,
     live signals on a mention), each agent polling all M channels and starting at a random
     moment of the interval, its poll timer counting from that moment (--timer-origin start:
     agents poll at random phases; `ready` counts from the start calls' answers instead,
     and agents the host answers together then poll together, every tick:
     docs/performance.md, "Phases"); beside them one poster posts --post-rate message.post
     a second (open loop), each mentioning one agent (which then takes a turn: typing.set,
     observer.emit, liveness.ping); --mention-share below 1 mentions no one in the other
     posts, spread evenly (0: the issue's load, posts beside the polls and no turns);
  6. each agent's first calls once before any window (the daemon opens an agent's relay
     connection at its first read); then the fleet runs, and after --warmup s a
     --duration s window is measured;
  7. then, with the fleet stopped, the same daemon answers 200 sequential polls of an
     unchanged window and 200 requests refused at validation (channel.read, limit 0): the
     daemon CPU of each kind, in the same run;
  8. the search (this checkout, --search-relay): the fleet doubled from --agents until p99
     passes 250 ms (or --search-max), then halved twice between the last pass and the first
     fail, --search-duration s each.

Printed per run: polls/s achieved (answered `succeeded`) against polls/s scheduled (the
agents' timer ticks: a tick whose poll of that channel is still in flight is skipped, so a
slow host lowers the fleet's own load; the nominal rate N×M/interval is printed too), and
both shares: achieved/scheduled (what the issue's "≥ 99 % of scheduled polls" counts) and
achieved/nominal (lower when the generators' timers fell behind the nominal rate), poll
latency p50/p99 counted from the tick, every other answer by action and code, the daemon's
CPU-seconds per request and cores (from /proc/<pid>/stat), durable growth of the ledger and
the audit log per hour (before and after the window: the ledger's logical size, pages x
page size read through a read-only connection, so the WAL's checkpoint jumps do not show;
the audit log's files' sizes), the generators' own CPU, the latency on the wire (request
sent to answer received, without the generator's own lag) and the machine's CPU pressure
(/proc/pressure/cpu) over the window. Then the ratios of this checkout to the
baseline, from the same run. The generator verifies each event id once per process
(tests/fleet/buzz_agent.py says why); everything shares this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _harness as H  # noqa: E402
from benchmarks.load import canned_events  # noqa: E402
from tests.fixtures.broker import write_config as broker_config  # noqa: E402
from tests.fleet.buzz_agent import TIMER_ORIGINS, BuzzAgent, percentile  # noqa: E402

BASELINE = "75ee3f5"
P99_LIMIT = 0.250
WINDOW_EVENTS = 100
#: Sequential requests per kind in the unchanged-poll vs validation-refusal comparison.
COMPARE_REQUESTS = 200

#: Made by each build's own code, run by that build's python in its source directory, so a
#: state directory always matches the daemon that serves it. It uses only what both builds
#: have (custody's import_agent, the session store's issue); reads a JSON job on stdin.
SETUP = r"""
import json, os, sys, time
import coincurve, trio
from buzzwire.contract import ACTIONS
from custody import Custody, TokenConfig
from daemon.state.sessions import SessionStore
job = json.load(sys.stdin)
token = TokenConfig(**job["token"])
async def agents(n):
    custody = await Custody.open(token, job["state_dir"])
    try:
        out = []
        for _ in range(n):
            owner = coincurve.PrivateKey().public_key_xonly.format().hex()
            secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
            out.append((await custody.import_agent(secret, owner=owner)).pubkey)
        return out
    finally:
        await custody.aclose()
pubkeys = trio.run(agents, job["agents"])
store = SessionStore.open(job["state_dir"])
rows = []
for pubkey in pubkeys:
    _, credential = store.issue(agent=pubkey, channels=frozenset(job["channels"]),
                                actions=frozenset(ACTIONS), ttl_seconds=None,
                                uid=job["uid"], now=int(time.time()))
    rows.append({"pubkey": pubkey, "credential": credential})
store.close()
fd = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, "w") as fh:
    json.dump(rows, fh)
"""


@dataclass(frozen=True)
class Build:
    label: str
    python: str
    broker: str
    src: Path
    over_tcp: bool
    #: A pinned build's cache home: its setup and daemon then run in H.pinned_environ(),
    #: never with the caller's PYTHONPATH (which would import this checkout's code).
    home: Path | None = None

    def environ(self) -> dict[str, str] | None:
        """The environment its processes get, taken when they start (make_token sets
        SOFTHSM2_CONF after the builds are listed); None: the caller's."""
        return None if self.home is None else H.pinned_environ()


# ------------------------------------------------------------------ the baseline build


def baseline_build(commit: str) -> Build:
    """The pinned commit, built once into the benchmark cache (benchmarks/_harness.py)."""
    home, full = H.pinned_build(commit)
    return Build(f"baseline {full[:7]}", str(home / "venv" / "bin" / "python"),
                 str(home / "venv" / "bin" / "buzz-broker"), home / "src", over_tcp=False,
                 home=home)


def this_build() -> Build:
    return Build("this checkout", sys.executable, H.buzz_broker_bin(), H.REPO, over_tcp=True)


# ------------------------------------------------------------------ one daemon


def make_state(build: Build, token: Any, state_dir: Path, n: int, channels: Sequence[str],
               out: Path) -> list[dict[str, str]]:
    job = {"token": {"module": token.module, "token_label": token.token_label,
                     "pin_file": token.pin_file, "kek_label": token.kek_label},
           "state_dir": str(state_dir), "agents": n, "channels": list(channels),
           "uid": os.getuid(), "out": str(out)}
    done = subprocess.run([build.python, "-c", SETUP], input=json.dumps(job), text=True,
                          cwd=build.src, env=build.environ(), capture_output=True, check=False,
                          timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"fleet: state setup for {build.label} failed: "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    rows: list[dict[str, str]] = json.loads(out.read_text())
    return rows


@dataclass(frozen=True)
class Served:
    daemon: H.Daemon
    base: str
    state_dir: Path
    warmed: set[str]  # credentials whose relay connection the daemon has opened
    name: str  # relay and build, e.g. "local-this" (profile file names)


@contextmanager
def serve(build: Build, token: Any, tmp: Path, name: str, relay_url: str,
          log_level: str = "warning") -> Iterator[Served]:
    state = tmp / f"state-{name}"
    sock = tmp / f"{name}.sock"
    server: dict[str, object] = {"max_connections": 4096, "max_connections_per_uid": 4096}
    port = H.free_port()
    if build.over_tcp:
        server.update({"listen_tcp": [f"127.0.0.1:{port}"],
                       # a free port this run picked: nobody holds it for the daemon
                       "listen_tcp_accept_squatting_risk": True,
                       "tcp_allow_uids": [os.getuid()],
                       "max_connections_per_credential": 256})
    config = broker_config(tmp / f"{name}.toml", token=token, state_dir=state, socket=sock,
                           relay_url=relay_url, relay_timeout=10.0,
                           sections={"server": server, "log": {"level": log_level},
                                     "limits": {"enabled": False}})
    environ = build.environ()
    if build.home is not None and environ is not None:
        # Before anything is measured: the baseline's daemon is the baseline's code.
        H.check_pinned_imports(build.python, build.home, environ)
    with H.daemon_process(config, tmp, command=[build.broker], environ=environ) as daemon:
        base = f"http://localhost:{port}" if build.over_tcp else f"unix:{sock}"
        yield Served(daemon, base, state, set(), name)


def cpu_waited() -> float | None:
    """Seconds some task has waited for a CPU since boot (/proc/pressure/cpu), or None."""
    try:
        with open("/proc/pressure/cpu") as fh:
            some = fh.readline().split()
    except OSError:
        return None
    fields = dict(part.split("=", 1) for part in some[1:])
    return int(fields["total"]) / 1e6 if "total" in fields else None


def ledger_bytes(path: Path) -> int:
    """The ledger's logical size (pages x page size, as a reader sees it, WAL included),
    read-only: what it will occupy once checkpointed, without the WAL file's own jumps."""
    if not path.exists():
        return 0
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
        return int(pages) * int(size)
    finally:
        db.close()


def state_bytes(state_dir: Path) -> dict[str, int]:
    """Bytes of the ledger (logical) and of the audit log (its files' sizes)."""
    ledger = ledger_bytes(state_dir / "ledger.db")
    audit_dir = state_dir / "audit"
    audit = sum(p.stat().st_size for p in audit_dir.rglob("*") if p.is_file()) if audit_dir.exists() else 0
    return {"ledger": ledger, "audit": audit}


async def seed(base: str, poster: dict[str, str], channels: Sequence[str], n: int) -> None:
    """n posts per channel through the daemon (LocalRelay keeps them: the default window)."""
    agent = BuzzAgent(base, poster["credential"], channels)
    limiter = trio.CapacityLimiter(8)

    async def one(channel: str, i: int) -> None:
        async with limiter:
            verdict = await agent.call("message.post", {"channelId": channel,
                                                        "content": f"backlog {i}"})
            if verdict is None or verdict.status != "succeeded":
                raise SystemExit(f"fleet: seeding failed: {verdict.label if verdict else 'no answer'}")

    try:
        async with trio.open_nursery() as nursery:
            for channel in channels:
                for i in range(n):
                    nursery.start_soon(one, channel, i)
    finally:
        await agent.transport.aclose()


async def warm_up(base: str, rows: Sequence[dict[str, str]], channels: Sequence[str]) -> None:
    """Each agent's first calls before any window: the daemon opens an agent's relay
    connection (and signs its AUTH) at its first relay request, a one-off cost that would
    otherwise land in the first run's window and not in the others'."""
    limiter = trio.CapacityLimiter(8)

    async def one(row: dict[str, str]) -> None:
        async with limiter:
            agent = BuzzAgent(base, row["credential"], channels)
            try:
                await agent.call("storage.address", {"slug": "core"})
                for channel in channels:
                    await agent.call("channel.read", {"channelId": channel, "limit": WINDOW_EVENTS})
            finally:
                await agent.transport.aclose()
            if set(agent.stats.answers) != {"storage.address succeeded", "channel.read succeeded"}:
                raise SystemExit(f"fleet: warm-up got {dict(agent.stats.answers)} {dict(agent.stats.no_answer)}")

    async with trio.open_nursery() as nursery:
        for row in rows:
            nursery.start_soon(one, row)


async def compare_costs(served: Served, row: dict[str, str], channel: str) -> dict[str, float]:
    """Daemon CPU-seconds per request: an unchanged window polled, and a validation refusal."""
    agent = BuzzAgent(served.base, row["credential"], [channel])
    out = {}
    try:
        for kind, args in (("unchanged_poll", {"channelId": channel, "limit": WINDOW_EVENTS}),
                           ("validation_refusal", {"channelId": channel, "limit": 0})):
            await agent.call("channel.read", args)  # a warm connection
            before = H.proc_stat(served.daemon.pid).cpu_seconds
            for _ in range(COMPARE_REQUESTS):
                await agent.call("channel.read", args)
            out[kind] = (H.proc_stat(served.daemon.pid).cpu_seconds - before) / COMPARE_REQUESTS
    finally:
        await agent.transport.aclose()
    expected = {"channel.read succeeded", "channel.read failed:invalid_request"}
    if set(agent.stats.answers) != expected:
        raise SystemExit(f"fleet: the cost comparison got {dict(agent.stats.answers)}")
    return out


# ------------------------------------------------------------------ the load


def run_fleet(args: argparse.Namespace, served: Served, rows: list[dict[str, str]], n: int,
              channels: Sequence[str], duration: float, label: str) -> dict[str, Any]:
    """N agents (rows[1:n+1]; rows[0] posts) for --warmup + duration s; the window's figures."""
    fresh = [r for r in rows[1:n + 1] if r["credential"] not in served.warmed]
    trio.run(warm_up, served.base, fresh, channels)
    served.warmed.update(r["credential"] for r in fresh)
    agents_file = Path(served.state_dir).parent / f"fleet-{label.replace(' ', '_')}.json"
    fd = os.open(agents_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"poster": rows[0], "agents": rows[1:n + 1], "channels": list(channels)}, fh)
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", "--agents-file", str(agents_file),
         "--base", served.base, "--slice", f"{i}/{args.procs}", "--interval-ms", str(args.interval_ms),
         "--post-rate", str(args.post_rate if i == 0 else 0.0),
         "--mention-share", str(args.mention_share), "--timer-origin", args.timer_origin],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(args.procs)]
    # A loaded machine takes seconds to start a Python process: the window is set only
    # once every generator has imported everything and is waiting.
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("fleet: a generator did not start")
    t0 = time.time() + args.warmup
    t1 = t0 + duration
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{t0!r} {t1!r}\n")
        proc.stdin.close()
    time.sleep(max(0.0, t0 - time.time()))
    cpu0, disk0 = H.proc_stat(served.daemon.pid).cpu_seconds, state_bytes(served.state_dir)
    waited0 = cpu_waited()
    spy = None
    if args.profile:
        # py-spy samples the daemon over the measured window (collapsed stacks; without
        # --idle, so the samples are where its CPU goes, not where it waits).
        spy = subprocess.Popen(
            [str(Path(sys.executable).with_name("py-spy")), "record", "--format", "raw",
             "--nonblocking", "-r", "100", "-d", str(max(1, int(duration))),
             "-o", f"{args.profile}.{served.name}.{label.replace(' ', '_')}.txt", "-p", str(served.daemon.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(max(0.0, t1 - time.time()))
    cpu1, disk1 = H.proc_stat(served.daemon.pid).cpu_seconds, state_bytes(served.state_dir)
    waited1 = cpu_waited()
    rss = H.proc_stat(served.daemon.pid).rss_bytes
    if spy is not None:
        spy.wait(timeout=60)
        # The daemon's log beside the profile: which windows dropped and why, cold reads.
        log_copy = Path(f"{args.profile}.{served.name}.{label.replace(' ', '_')}.log")
        log_copy.write_bytes(served.daemon.log_path.read_bytes())
    parts = []
    for proc in procs:
        assert proc.stdout is not None
        out = proc.stdout.read()
        proc.wait(timeout=120)
        if proc.returncode != 0:
            raise SystemExit(f"fleet: a generator failed ({proc.returncode})")
        parts.append(json.loads(out.strip().splitlines()[-1]))
    latencies = [x for p in parts for x in p["latencies"]]
    wire = [x for p in parts for x in p["wire"]]
    answers: Counter[str] = Counter()
    for p in parts:
        answers.update(p["answers"])
    requests = sum(answers.values())
    polls_ok = answers.get("channel.read succeeded", 0)
    grown = {k: disk1[k] - disk0[k] for k in disk0}
    return {
        "run": label, "agents": n, "channels": len(channels), "interval_ms": args.interval_ms,
        "post_rate": args.post_rate, "mention_share": args.mention_share,
        "timer_origin": args.timer_origin,
        "polls_per_s_nominal": round(n * len(channels) / (args.interval_ms / 1000), 1),
        "polls_per_s_scheduled": round(sum(p["scheduled"] for p in parts) / duration, 1),
        "polls_per_s_achieved": round(polls_ok / duration, 1),
        # The target counts achieved of scheduled; scheduled falls below nominal
        # when the generators' timers fall behind, so achieved of nominal is printed too.
        "achieved_of_scheduled": round(polls_ok / max(1, sum(p["scheduled"] for p in parts)), 3),
        "achieved_of_nominal": round(polls_ok / max(1e-9, n * len(channels) * duration
                                                    / (args.interval_ms / 1000)), 3),
        "ticks_skipped": sum(p["skipped"] for p in parts),
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 1),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        "wire_p50_ms": round(percentile(wire, 0.50) * 1000, 1),
        "wire_p99_ms": round(percentile(wire, 0.99) * 1000, 1),
        "answers": dict(sorted(answers.items())),
        "requests_per_s": round(requests / duration, 1),
        "daemon_cores": round((cpu1 - cpu0) / duration, 3),
        # The machine's CPU pressure (PSI "some"): the share of the window in which some
        # runnable task waited for a core. High means neighbours (or the generators)
        # contended with the daemon, and latency figures include that wait.
        "cpu_pressure": (round((waited1 - waited0) / duration, 3)
                         if waited0 is not None and waited1 is not None else None),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "daemon_cpu_ms_per_request": round((cpu1 - cpu0) / max(1, requests) * 1000, 3),
        "daemon_rss_mb": round(rss / 2**20, 1),
        "ledger_bytes_per_hour": round(grown["ledger"] * 3600 / duration),
        "audit_bytes_per_hour": round(grown["audit"] * 3600 / duration),
        "state_bytes_per_poll": round(sum(grown.values()) / max(1, polls_ok)),
        "generator_cores": round(sum(p["cpu"] for p in parts) / duration, 3),
        "agents_ended": sum((Counter(p["ended"]) for p in parts), Counter()),
    }


async def worker(args: argparse.Namespace) -> None:
    """One generator process: its slice of the agents (and the poster, in slice 0)."""
    job = json.loads(Path(args.agents_file).read_text())
    index, count = args.slice
    rows = job["agents"][index::count]
    channels = job["channels"]
    interval = args.interval_ms / 1000
    pubkeys = [a["pubkey"] for a in job["agents"]]
    fleet = [BuzzAgent(args.base, r["credential"], channels, interval=interval, keep_ids=False,
                       log=True, timer_origin=args.timer_origin) for r in rows]
    poster = BuzzAgent(args.base, job["poster"]["credential"], channels, log=True)
    rng = random.Random(index)
    cpu: dict[str, float] = {}

    async def run_one(agent: BuzzAgent) -> None:
        await trio.sleep(rng.uniform(0, interval))  # agents start at any phase of the timer
        await agent.run()

    async def post_one(i: int) -> None:
        # Spread evenly: post i mentions an agent when the running count of mentions due
        # steps up, so a share of 0.5 is every other post.
        post: dict[str, Any] = {"channelId": channels[i % len(channels)],
                                "content": f"fleet post {i}"}
        if int((i + 1) * args.mention_share) > int(i * args.mention_share):
            post["mentions"] = [rng.choice(pubkeys)]  # the contract omits an empty array
        await poster.call("message.post", post)

    async def posts(nursery: trio.Nursery) -> None:
        if args.post_rate <= 0:
            return
        start = trio.current_time()
        for i in range(int((args.t1 - time.time()) * args.post_rate) + 1):
            await trio.sleep_until(start + i / args.post_rate)
            nursery.start_soon(post_one, i)

    async def window() -> None:
        await trio.sleep(max(0.0, args.t0 - time.time()))
        cpu["t0"] = time.process_time()
        await trio.sleep(max(0.0, args.t1 - time.time()))
        cpu["t1"] = time.process_time()
        for agent in fleet:
            agent.stop()

    async with trio.open_nursery() as nursery:
        for agent in fleet:
            nursery.start_soon(run_one, agent)
        nursery.start_soon(window)
        async with trio.open_nursery() as posting:
            posting.start_soon(posts, posting)
    await poster.transport.aclose()

    def inside(wall: float) -> bool:
        return bool(args.t0 <= wall < args.t1)

    answers: Counter[str] = Counter()
    latencies: list[float] = []
    wire: list[float] = []
    scheduled = skipped = 0
    for agent in [*fleet, poster]:
        for wall, seconds, action, label in agent.stats.calls:
            if inside(wall):
                answers[f"{action} {label}"] += 1
                if action == "channel.read":
                    latencies.append(seconds)
        wire.extend(seconds for wall, action, seconds in agent.stats.wire
                    if action == "channel.read" and inside(wall))
        for wall, sent in agent.stats.ticks:
            if inside(wall):
                scheduled += 1
                skipped += not sent
    print(json.dumps({"answers": answers, "latencies": latencies, "wire": wire, "scheduled": scheduled,
                      "skipped": skipped, "cpu": cpu.get("t1", 0.0) - cpu.get("t0", 0.0),
                      "ended": [a.ended for a in fleet if a.ended != "stopped"]}))


# ------------------------------------------------------------------ orchestration


def show(summary: dict[str, Any]) -> None:
    print(json.dumps(summary), flush=True)
    s = summary
    print(f"  {s['run']}: {s['agents']} agents x {s['channels']} channels every {s['interval_ms']} ms "
          f"(timers from {s['timer_origin']}): "
          f"{s['polls_per_s_achieved']} polls/s achieved of {s['polls_per_s_scheduled']} scheduled "
          f"({s['polls_per_s_nominal']} nominal; achieved/scheduled {s['achieved_of_scheduled']:.3f}, "
          f"achieved/nominal {s['achieved_of_nominal']:.3f}), p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms "
          f"(on the wire: p50 {s['wire_p50_ms']} ms, p99 {s['wire_p99_ms']} ms); "
          f"daemon {s['daemon_cores']} cores, {s['daemon_cpu_ms_per_request']} ms CPU per request; "
          f"ledger {s['ledger_bytes_per_hour'] / 1e6:.1f} MB/h, audit {s['audit_bytes_per_hour'] / 1e6:.1f} MB/h "
          f"({s['state_bytes_per_poll']} B per poll); generators {s['generator_cores']} cores; "
          f"machine: CPU pressure {s['cpu_pressure']}, load {s['loadavg_1m']}", flush=True)


def ratios(mine: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    def r(key: str) -> float | None:
        return round(mine[key] / base[key], 3) if base[key] else None
    return {"ratio_to_baseline": mine["run"], "relay": mine.get("relay"),
            **{k: r(k) for k in ("polls_per_s_achieved", "p50_ms", "p99_ms", "wire_p50_ms",
                                 "wire_p99_ms", "daemon_cores",
                                 "daemon_cpu_ms_per_request", "ledger_bytes_per_hour",
                                 "audit_bytes_per_hour", "state_bytes_per_poll")}}


def search(args: argparse.Namespace, served: Served, rows: list[dict[str, str]],
           channels: Sequence[str]) -> None:
    """Double the fleet until p99 passes 250 ms, then narrow twice."""
    tried: dict[int, float] = {}

    def trial(n: int) -> float:
        s = run_fleet(args, served, rows, n, channels, args.search_duration, f"search {n}")
        s["relay"] = args.search_relay
        show(s)
        tried[n] = s["p99_ms"] / 1000
        return tried[n]

    n = args.agents
    while n <= args.search_max and trial(n) <= P99_LIMIT:
        n *= 2
    passing = [k for k, v in tried.items() if v <= P99_LIMIT]
    failing = [k for k, v in tried.items() if v > P99_LIMIT]
    if not failing:
        print(json.dumps({"p99_passes_250ms_at": None, "note": f"p99 <= 250 ms up to {max(tried)} agents"
                          f" (--search-max {args.search_max})"}), flush=True)
        return
    low, high = (max(passing) if passing else 0), min(failing)
    for _ in range(2):
        mid = (low + high) // 2
        if mid <= low or mid >= high:
            break
        if trial(mid) <= P99_LIMIT:
            low = mid
        else:
            high = mid
    print(json.dumps({"p99_passes_250ms_at": {"agents": high, "channels": len(channels),
                                              "interval_ms": args.interval_ms,
                                              "polls_per_s_nominal": round(high * len(channels) / (args.interval_ms / 1000)),
                                              "last_passing_agents": low or None},
                      "relay": args.search_relay}), flush=True)
    print(f"  p99 passes 250 ms between {low} and {high} agents x {len(channels)} channels every "
          f"{args.interval_ms} ms ({args.search_relay} relay, this checkout)", flush=True)


def orchestrate(args: argparse.Namespace) -> None:
    print(json.dumps({"machine": H.machine()}), flush=True)
    builds = [this_build()]
    if args.baseline:
        builds.append(baseline_build(args.baseline))
    relays = ["null", "local"] if args.relay == "both" else [args.relay]
    need = 1 + max(args.agents, args.search_max if args.search else 0)
    with H.workdir() as tmp:
        token = H.make_token(tmp / "token")
        for relay in relays:
            channels = [H.new_channel() for _ in range(args.channels)]
            events = tmp / f"canned-{relay}.json"
            events.write_text(json.dumps([e for c in channels for e in canned_events(c, WINDOW_EVENTS)]))
            with H.relay_process(relay, events_file=events) as (url, _relay):
                seeded = relay == "null"
                results = []
                for build in builds:
                    name = f"{relay}-{'this' if build.over_tcp else 'base'}"
                    size = need if build.over_tcp and relay == args.search_relay and args.search else 1 + args.agents
                    rows = make_state(build, token, tmp / f"state-{name}", size, channels,
                                      tmp / f"agents-{name}.json")
                    with serve(build, token, tmp, name, url, args.log_level) as served:
                        if not seeded:
                            trio.run(seed, served.base, rows[0], channels, WINDOW_EVENTS)
                            seeded = True
                        summary = run_fleet(args, served, rows, args.agents, channels, args.duration,
                                            build.label)
                        summary["relay"] = relay
                        summary["log_level"] = args.log_level
                        summary["transport"] = "loopback TCP" if build.over_tcp else "Unix socket"
                        summary["cost_cpu_ms"] = {k: round(v * 1000, 3) for k, v in trio.run(
                            compare_costs, served, rows[1], channels[0]).items()}
                        show(summary)
                        print(f"    sequential, fleet stopped: unchanged-window poll "
                              f"{summary['cost_cpu_ms']['unchanged_poll']} ms CPU, validation refusal "
                              f"{summary['cost_cpu_ms']['validation_refusal']} ms CPU", flush=True)
                        results.append(summary)
                        if build.over_tcp and args.search and relay == args.search_relay:
                            search(args, served, rows, channels)
                if len(results) == 2:
                    out = ratios(results[0], results[1])
                    out["cost_unchanged_poll"] = round(results[0]["cost_cpu_ms"]["unchanged_poll"]
                                                       / results[1]["cost_cpu_ms"]["unchanged_poll"], 3)
                    print(json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=16, help="agents (each polls every channel)")
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--interval-ms", type=int, default=250,
                        help="poll period (Buzz's default is 1000, its minimum 100)")
    parser.add_argument("--post-rate", type=float, default=10.0, help="message.post per second beside the polls")
    parser.add_argument("--mention-share", type=float, default=1.0,
                        help="the share of posts that mention an agent, which then takes a turn "
                             "(0: posts only, the issue's load; 1: every post starts a turn)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before the window opens")
    parser.add_argument("--relay", choices=("both", "null", "local"), default="both")
    parser.add_argument("--procs", type=int, default=2, help="generator processes")
    parser.add_argument("--timer-origin", choices=TIMER_ORIGINS, default="start",
                        help="what an agent's poll timer counts from: its start (random phases), "
                             "or its start calls' answers (phases the host's answers set)")
    parser.add_argument("--baseline", default=BASELINE, help="the commit compared against (over its Unix socket)")
    parser.add_argument("--no-baseline", dest="baseline", action="store_const", const="")
    parser.add_argument("--search-max", type=int, default=128, help="largest fleet the search tries")
    parser.add_argument("--no-search", dest="search", action="store_false")
    parser.add_argument("--search-duration", type=float, default=4.0)
    parser.add_argument("--search-relay", choices=("null", "local"), default="null")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        help="the daemons' [log] level (default warning; info with --profile, "
                             "whose copy of the log says why windows dropped; info is the "
                             "config's own default, what an installed daemon pays)")
    parser.add_argument("--profile", metavar="PREFIX",
                        help="py-spy (installed beside this Python) the daemon over each measured window: collapsed stacks to PREFIX.<relay-build>.<run>.txt, its info log to .log")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--agents-file", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--slice", type=lambda s: tuple(int(x) for x in s.split("/")), default=(0, 1),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("agents", "channels", "procs", "duration", "search_duration"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if not 0.0 <= args.mention_share <= 1.0:
        parser.error("--mention-share must be between 0 and 1")
    if args.interval_ms < 100:
        parser.error("--interval-ms: Buzz's runtime polls at most every 100 ms")
    if args.duration > 600 or args.search_max > 4096:
        parser.error("--duration is bounded at 600 s, --search-max at 4096")
    if args.log_level is None:
        args.log_level = "info" if args.profile else "warning"
    if args.worker:
        print("ready", flush=True)
        args.t0, args.t1 = (float(x) for x in sys.stdin.readline().split())
        trio.run(worker, args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
