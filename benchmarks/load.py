"""Load generator: the real protocol against the real daemon, from separate processes.

    python benchmarks/load.py [--relay null|local] [--agents 64] [--mix post=8,read=2]
                              (--concurrency C | --rate R) [--duration 10] [--requests N]
                              [--procs 1] [--read-events 100] [--no-floor] [--no-read-baseline]
                              [--custodian] [--allocator]

What runs (all on loopback / Unix sockets, all in one temporary directory):
  1. a fresh SoftHSM2 token, `keys init`, --agents agents imported through custody, one
     bearer credential each (benchmarks/_harness.py);
  2. the custody floor, in this process before the daemon starts (unless --no-floor):
     unseal + sign + event id through `Custody.sign_event` (one token hop per event),
     `Custody.sign_events` (64 per hop) and raw coincurve (no token) - the most the
     daemon could ever sign per second here;
  3. a relay process: the null relay (benchmarks/null_relay.py: AUTH accepted, OK at
     once, REQ answered with --read-events canned events) or nostr-sdk's LocalRelay;
  4. `buzz-broker serve` as its own process, ready when it sends READY=1;
  5. a warm-up: every agent posts once (relay connection + AUTH), reads once;
  6. --procs generator processes (this file with --worker), each speaking HTTP/1.1 (h11)
     over the Unix socket with keep-alive connections, one agent per connection;
  7. when the mix reads (and without --no-read-baseline): the read's same-run baseline,
     the same runs again against a second daemon on the same state and relay with
     `[relay] read_window_bytes = 0` (no read windows: every read is answered from the
     relay, cold, as before windows), then the ratio of reads/s (windows on / off).
     With windows on, a read of an unchanged channel is answered from the daemon's
     window; the null relay never changes a channel, so that is every read but the first.

Modes:
  closed loop (--concurrency C): C connections in total, each sends its next request as
      soon as the previous answer arrived. Measures the most the daemon does; latency
      grows with C by Little's law.
  open loop (--rate R): R requests per second in total arrive at fixed intervals,
      whatever the daemon's answers; latency is counted from the *intended* arrival (no
      coordinated omission). At most --max-outstanding requests are in flight per
      process; arrivals beyond that are counted as `generator_saturated`, not sent.
  Both stop at --duration seconds or --requests requests, whichever comes first.

Custody: every daemon here holds custody in its own process (`[custody]` without
`custodian_socket`), unless --custodian: then each of --repeat rounds runs the load twice,
against a daemon with custody in process and against one signing through the custodian
(`python -m custody.custodian`, the layout docs/install.md installs), same token, state,
relay and generator, alternating, and prints posts/s custodian / in process (medians).

Allocator (--allocator): each of --repeat rounds runs the load twice, against a daemon
(and with --custodian, a custodian) in this process's environment and against one under
its systemd unit's `Environment=` lines as well (tests/fixtures/units.py reads them:
PYTHONMALLOC=malloc, no glibc tcache, two arenas), alternating, and prints posts/s and
daemon CPU per request, units / default (the median of the rounds' ratios): what
overwriting every free costs.

Operations in --mix (weights): post = message.post (new requestId, a new event);
  replay = the identical bytes of a post this agent already made (answered from the
  ledger, `replayed: true`); read = channel.read, limit 100, of the agent's channel;
  storage = storage.address (no relay I/O).

Each read's answer is checked for its message count (`wrong_message_count` otherwise):
against the null relay exactly min(100, --read-events), what the channel holds (it
stores nothing posted; with posts in the mix, at least that); against LocalRelay at
least min(100, the channel's warm-up posts), as the load's posts add to it.

Reported (one JSON line per run, then a readable summary): requests/s, p50/p90/p99/max
latency in ms, errors by code (`http_<status>`, `transport:<Error>`, or the verdict code;
a replay not marked replayed is `not_replayed`), the daemon's RSS and CPU (cores used,
from /proc/<pid>/stat), the generator's CPU, the ratio to the custody floor, and the
machine. The generator shares the machine's cores with the daemon and the relay: the
figures say so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _harness as H  # noqa: E402
from tests.fixtures.units import BROKER_UNIT, CUSTODIAN_UNIT, unit_environment  # noqa: E402

OPS = ("post", "replay", "read", "storage")
RECEIVE = 65536


def parse_mix(text: str) -> dict[str, int]:
    mix: dict[str, int] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in OPS:
            raise argparse.ArgumentTypeError(f"unknown operation {name!r} (known: {', '.join(OPS)})")
        try:
            mix[name] = int(weight or "1")
        except ValueError:
            raise argparse.ArgumentTypeError(f"weight of {name} must be an integer") from None
        if mix[name] < 0:
            raise argparse.ArgumentTypeError(f"weight of {name} must be >= 0")
    if sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError("the mix needs a positive weight")
    return mix


def body(action: str, args: dict[str, Any], request_id: str | None = None) -> bytes:
    return json.dumps(
        {"type": "broker_request", "protocolVersion": 1, "requestId": request_id or uuid.uuid4().hex,
         "actionVersion": 1, "action": action, "args": args},
        separators=(",", ":"),
    ).encode()


class Conn:
    """One keep-alive HTTP/1.1 connection over the Unix socket, one request at a time."""

    def __init__(self, path: str, credential: str) -> None:
        self.path = path
        self.auth = f"Bearer {credential}"
        self.stream: trio.SocketStream | None = None
        self.h: h11.Connection | None = None

    async def post(self, payload: bytes) -> tuple[int, bytes]:
        if self.stream is None or self.h is None or self.h.our_state is not h11.IDLE:
            await self.close()
            self.stream = await trio.open_unix_socket(self.path)
            self.h = h11.Connection(h11.CLIENT)
        h, stream = self.h, self.stream
        try:
            await stream.send_all(
                h.send(h11.Request(method="POST", target="/v1/action", headers=[
                    ("Host", "broker"), ("Content-Type", "application/json"),
                    ("Content-Length", str(len(payload))), ("Authorization", self.auth)]))
                + h.send(h11.Data(data=payload)) + h.send(h11.EndOfMessage())
            )
            status, chunks = 0, []
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    h.receive_data(await stream.receive_some(RECEIVE))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    if h.our_state is h11.DONE and h.their_state is h11.DONE:
                        h.start_next_cycle()
                    return status, b"".join(chunks)
                elif isinstance(event, h11.ConnectionClosed):
                    raise trio.BrokenResourceError("closed by the daemon")
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream, self.h = self.stream, None, None
            with trio.CancelScope(shield=True):
                await stream.aclose()


@dataclass
class AgentState:
    agent: H.Agent
    conn: Conn
    busy: bool = False
    posted: list[bytes] = field(default_factory=list)  # bodies of earlier posts (for replay)
    read_expect: int = -1  # messages a read must return (at least; exactly if read_exact)
    read_exact: bool = False


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    by_op: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


def make_request(op: str, st: AgentState, seq: int) -> tuple[bytes, bool]:
    """(body, expect_replayed) for one operation of this agent."""
    if op == "replay" and st.posted:
        return st.posted[seq % len(st.posted)], True
    if op in ("post", "replay"):
        payload = body("message.post", {"channelId": st.agent.channel, "content": f"load {seq} {uuid.uuid4().hex[:8]}"})
        st.posted.append(payload)
        if len(st.posted) > 64:
            del st.posted[0]
        return payload, False
    if op == "read":
        return body("channel.read", {"channelId": st.agent.channel, "limit": 100}), False
    return body("storage.address", {"slug": f"mem/notes-{seq % 16}"}), False


async def one(st: AgentState, op: str, seq: int, res: Results, origin: float) -> None:
    payload, expect_replay = make_request(op, st, seq)
    try:
        status, raw = await st.conn.post(payload)
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
        res.errors[f"transport:{type(exc).__name__}"] += 1
        return
    res.latencies.append(time.perf_counter() - origin)
    res.by_op[op] += 1
    if status != 200:
        res.errors[f"http_{status}"] += 1
        return
    answer = json.loads(raw)
    if answer.get("status") != "succeeded":
        error = answer.get("error") or {}
        code = str(error.get("code"))
        if not res.errors[code]:  # the first of each code, for the operator
            print(f"{op}: {code}: {error.get('message')}", file=sys.stderr)
        res.errors[code] += 1
    elif expect_replay and not answer.get("replayed"):
        res.errors["not_replayed"] += 1
    elif op == "read" and st.read_expect >= 0:
        count = len(((answer.get("outcome") or {}).get("messages")) or ())
        if count < st.read_expect or (st.read_exact and count != st.read_expect):
            if not res.errors["wrong_message_count"]:
                print(f"read: {count} messages, expected {'' if st.read_exact else 'at least '}"
                      f"{st.read_expect}", file=sys.stderr)
            res.errors["wrong_message_count"] += 1


def choose(mix: dict[str, int], rng: random.Random) -> str:
    names = list(mix)
    return rng.choices(names, weights=[mix[n] for n in names])[0]


async def closed_loop(states: list[AgentState], args: argparse.Namespace, res: Results) -> float:
    rng = random.Random(args.seed)
    deadline = time.perf_counter() + args.duration
    budget = [args.requests]
    counter = [0]

    async def lane(idx: int) -> None:
        st = states[idx % len(states)]
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            counter[0] += 1
            await one(st, choose(args.mix, rng), counter[0], res, time.perf_counter())

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(args.concurrency):
            nursery.start_soon(lane, i)
    return time.perf_counter() - start


async def open_loop(states: list[AgentState], args: argparse.Namespace, res: Results) -> float:
    rng = random.Random(args.seed)
    interval = 1.0 / args.rate
    outstanding = [0]
    extra: list[Conn] = []

    async def fire(st: AgentState, op: str, seq: int, intended: float) -> None:
        outstanding[0] += 1
        try:
            if st.busy:  # the agent's connection is in use: this arrival gets its own
                conn = Conn(args.socket, st.agent.credential)
                extra.append(conn)
                await one(AgentState(st.agent, conn, posted=st.posted, read_expect=st.read_expect,
                                     read_exact=st.read_exact), op, seq, res, intended)
                await conn.close()
            else:
                st.busy = True
                try:
                    await one(st, op, seq, res, intended)
                finally:
                    st.busy = False
        finally:
            outstanding[0] -= 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        n = 0
        while n < args.requests:
            intended = start + n * interval
            if intended - start >= args.duration:
                break
            now = time.perf_counter()
            if intended > now:
                await trio.sleep(intended - now)
            if outstanding[0] >= args.max_outstanding:
                res.errors["generator_saturated"] += 1
            else:
                nursery.start_soon(fire, states[n % len(states)], choose(args.mix, rng), n, intended)
            n += 1
    return time.perf_counter() - start


async def worker(args: argparse.Namespace) -> None:
    agents = H.read_agents(args.agents_file)
    part, parts = args.slice
    mine = agents[part::parts] or agents
    states = [AgentState(a, Conn(args.socket, a.credential), read_expect=args.read_expect,
                         read_exact=args.read_exact) for a in mine]
    res = Results()
    cpu0 = time.process_time()
    if args.rate:
        elapsed = await open_loop(states, args, res)
    else:
        elapsed = await closed_loop(states, args, res)
    for st in states:
        await st.conn.close()
    print(json.dumps({"elapsed": elapsed, "cpu": time.process_time() - cpu0,
                      "latencies": res.latencies, "by_op": res.by_op, "errors": res.errors}), flush=True)


def spawn_workers(args: argparse.Namespace, agents_file: Path, socket_path: Path, **over: Any) -> list[subprocess.Popen[str]]:
    """Start the generator processes; `over` overrides procs, rate, concurrency, mix."""
    s = {"procs": args.procs, "rate": args.rate, "concurrency": args.concurrency,
         "mix": ",".join(f"{k}={v}" for k, v in args.mix.items()), **over}
    n = max(1, int(s["procs"]))
    procs = []
    for i in range(n):
        argv = [sys.executable, __file__, "--worker", "--agents-file", str(agents_file),
                "--socket", str(socket_path), "--slice", f"{i}/{n}", "--seed", str(args.seed + i),
                "--duration", str(args.duration), "--requests", str(max(1, args.requests // n)),
                "--mix", str(s["mix"]), "--max-outstanding", str(args.max_outstanding),
                # callers that build their own Namespace (e2e.py) check no read counts
                "--read-expect", str(getattr(args, "read_expect", -1))]
        if getattr(args, "read_exact", False):
            argv.append("--read-exact")
        if s["rate"]:
            argv += ["--rate", str(float(s["rate"]) / n)]
        else:
            argv += ["--concurrency", str(max(1, int(s["concurrency"]) // n))]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
    return procs


def run_load(args: argparse.Namespace, agents_file: Path, daemon: H.Daemon, label: str,
             relay_pid: int | None = None, **over: Any) -> dict[str, Any]:
    """Run the generator processes once; returns the summary (also printed as JSON)."""
    before = H.proc_stat(daemon.pid)
    relay_before = H.proc_stat(relay_pid) if relay_pid else None
    t0 = time.perf_counter()
    spy = None
    if args.profile:
        # py-spy samples the daemon (collapsed stacks, idle frames included: waits show).
        spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--format", "raw",
                                "--idle", "--nonblocking", "-r", "200", "-d", str(int(args.duration)),
                                "-o", f"{args.profile}.{label}.txt", "-p", str(daemon.pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = spawn_workers(args, agents_file, daemon.socket, **over)
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=args.duration * 3 + 120)
        if p.returncode != 0:
            raise SystemExit(f"generator process failed ({p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - t0
    after = H.proc_stat(daemon.pid)
    if spy is not None:
        spy.wait(timeout=60)
    latencies = [x for o in outs for x in o["latencies"]]
    errors: Counter[str] = Counter()
    by_op: Counter[str] = Counter()
    for o in outs:
        errors.update(o["errors"])
        by_op.update(o["by_op"])
    elapsed = max(o["elapsed"] for o in outs)
    done = len(latencies)
    summary = {
        "run": label,
        "mode": (f"open rate={over.get('rate', args.rate)}/s" if over.get("rate", args.rate)
                 else f"closed concurrency={over.get('concurrency', args.concurrency)}"),
        "mix": over.get("mix", ",".join(f"{k}={v}" for k, v in args.mix.items())),
        "generator_procs": over.get("procs", args.procs),
        "answered": done, "by_op": dict(by_op), "rps": round(done / elapsed, 1),
        "p50_ms": round(H.pct(latencies, 0.50) * 1e3, 2), "p90_ms": round(H.pct(latencies, 0.90) * 1e3, 2),
        "p99_ms": round(H.pct(latencies, 0.99) * 1e3, 2), "max_ms": round(max(latencies, default=0) * 1e3, 2),
        "errors": dict(errors),
        "daemon_rss_mb": round(after.rss_bytes / 2**20, 1),
        "daemon_cores": round((after.cpu_seconds - before.cpu_seconds) / wall, 2),
        "generator_cores": round(sum(o["cpu"] for o in outs) / wall, 2),
    }
    if relay_pid and relay_before:
        summary["relay_cores"] = round((H.proc_stat(relay_pid).cpu_seconds - relay_before.cpu_seconds) / wall, 2)
    print(json.dumps(summary), flush=True)
    return summary


# ---------------------------------------------------------------- the custody floor

async def custody_floor(token: Any, state_dir: Path, pubkeys: list[str], seconds: float) -> dict[str, float]:
    """Signatures per second: one hop each, 64 per hop, and raw coincurve (no token)."""
    import coincurve

    from custody import Custody, UnsignedEvent, compute_event_id

    out: dict[str, float] = {}
    custody = await Custody.open(token, state_dir)
    try:
        def unsigned(i: int, agent: str) -> UnsignedEvent:
            return UnsignedEvent(pubkey=agent, created_at=int(time.time()), kind=9,
                                 tags=(("h", "00000000-0000-4000-8000-000000000000"),), content=f"floor {i}")

        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            agent = pubkeys[n % len(pubkeys)]
            await custody.sign_event(agent, unsigned(n, agent))
            n += 1
        out["sign_event_per_s"] = n / (time.perf_counter() - t0)

        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            batch = [(pubkeys[(n + i) % len(pubkeys)], unsigned(n + i, pubkeys[(n + i) % len(pubkeys)])) for i in range(64)]
            await custody.sign_events(batch)
            n += 64
        out["sign_events64_per_s"] = n / (time.perf_counter() - t0)
    finally:
        await custody.aclose()

    key = coincurve.PrivateKey()
    pub = key.public_key_xonly.format().hex()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        event_id = compute_event_id(pub, int(time.time()), 9, (("h", "x"),), f"floor {n}")
        key.sign_schnorr(bytes.fromhex(event_id))
        n += 1
    out["coincurve_per_s"] = n / (time.perf_counter() - t0)
    return {k: round(v, 1) for k, v in out.items()}


# ---------------------------------------------------------------- orchestration

def canned_events(channel: str, n: int) -> list[dict[str, Any]]:
    """n signed kind-9 messages in the channel, one per second, for the null relay's REQs."""
    import coincurve

    from custody import compute_event_id

    key = coincurve.PrivateKey()
    pub = key.public_key_xonly.format().hex()
    now = int(time.time())
    events = []
    for i in range(n):
        tags = (("h", channel),)
        created = now - 10 - i
        content = f"canned message {i}"
        event_id = compute_event_id(pub, created, 9, tags, content)
        sig = key.sign_schnorr(bytes.fromhex(event_id)).hex()
        events.append({"id": event_id, "pubkey": pub, "created_at": created, "kind": 9,
                       "tags": [list(t) for t in tags], "content": content, "sig": sig})
    return events


async def warm_up(socket_path: Path, agents: list[H.Agent]) -> None:
    """Every agent posts once (opens its relay connection, AUTH) and reads once."""
    async def go(agent: H.Agent) -> None:
        conn = Conn(str(socket_path), agent.credential)
        for payload in (body("message.post", {"channelId": agent.channel, "content": "warm-up"}),
                        body("channel.read", {"channelId": agent.channel, "limit": 100})):
            status, raw = await conn.post(payload)
            answer = json.loads(raw) if raw else {}
            if status != 200 or answer.get("status") != "succeeded":
                raise SystemExit(f"warm-up failed: HTTP {status} {(answer.get('error') or {}).get('code')}")
        await conn.close()

    limiter = trio.CapacityLimiter(16)

    async def limited(agent: H.Agent) -> None:
        async with limiter:
            await go(agent)

    async with trio.open_nursery() as nursery:
        for agent in agents:
            nursery.start_soon(limited, agent)


def read_expectation(args: argparse.Namespace, channels: int) -> tuple[int, bool]:
    """(messages a read of limit 100 must return, whether exactly): what the channel holds."""
    if args.relay == "null":  # the canned events, whatever is posted (nothing is stored)
        return min(100, args.read_events), "post" not in args.mix and "replay" not in args.mix
    return min(100, args.agents // channels), False  # LocalRelay: at least the warm-up posts


def reads_per_s(summary: dict[str, Any]) -> float:
    return float(summary["by_op"].get("read", 0) / max(1e-9, summary["answered"]) * summary["rps"])


def orchestrate(args: argparse.Namespace) -> None:
    print(json.dumps({"machine": H.machine()}), flush=True)
    with H.workdir() as tmp:
        token = H.make_token(tmp / "token")
        state = tmp / "state"
        channels = [H.new_channel() for _ in range(max(1, args.agents // 16))]
        args.read_expect, args.read_exact = read_expectation(args, len(channels))
        pubkeys = trio.run(H.import_agents, token, state, args.agents)
        agents = H.issue_credentials(state, pubkeys, channels)
        agents_file = H.write_agents(tmp / "agents.json", agents)
        floor = None
        if not args.no_floor:
            floor = trio.run(custody_floor, token, state, pubkeys, args.floor_seconds)
            print(json.dumps({"custody_floor": floor}), flush=True)
        events_file = tmp / "canned.json"
        events_file.write_text(json.dumps([e for c in channels for e in canned_events(c, args.read_events)]))
        with H.relay_process(args.relay, events_file=events_file) as (url, relay):
            config = H.write_config(tmp / "broker.toml", token, state, tmp / "broker.sock", url)
            if args.allocator:
                allocator_modes(args, tmp, token, state, url, relay.pid, agents, agents_file)
                return
            if args.custodian:
                custody_modes(args, tmp, token, state, url, relay.pid, config, agents, agents_file)
                return
            with H.daemon_process(config, tmp) as daemon:
                print(json.dumps({"daemon_ready_s": round(daemon.ready_seconds, 3),
                                  "relay": "null relay (benchmarks/null_relay.py, TCP_NODELAY)" if args.relay == "null"
                                  else "nostr-sdk LocalRelay (tests.devrelay --auth)",
                                  "daemon_rss_mb": round(H.proc_stat(daemon.pid).rss_bytes / 2**20, 1)}), flush=True)
                trio.run(warm_up, daemon.socket, agents)
                warm: list[dict[str, Any]] = []
                for rep in range(args.repeat):
                    summary = run_load(args, agents_file, daemon, f"load#{rep + 1}", relay.pid)
                    if floor:
                        posts = summary["by_op"].get("post", 0) / max(1e-9, summary["answered"]) * summary["rps"]
                        print(f"  {summary['rps']:.0f} req/s ({posts:.0f} posts/s), p50 {summary['p50_ms']} ms, "
                              f"p99 {summary['p99_ms']} ms, max {summary['max_ms']} ms; errors {summary['errors'] or 'none'}; "
                              f"daemon {summary['daemon_cores']} cores, {summary['daemon_rss_mb']} MB; "
                              f"generator {summary['generator_cores']} cores, relay {summary.get('relay_cores')} cores (same machine)")
                        print(f"  ratio posts/s to custody floor: sign_event {posts / floor['sign_event_per_s']:.2f}, "
                              f"sign_events(64) {posts / floor['sign_events64_per_s']:.2f}, "
                              f"coincurve {posts / floor['coincurve_per_s']:.3f}", flush=True)
                    warm.append(summary)
            if "read" in args.mix and not args.no_read_baseline:
                # The reads' baseline, same run, same state and relay: no read windows.
                cold_config = H.write_config(tmp / "cold.toml", token, state, tmp / "broker.sock", url,
                                             relay={"read_window_bytes": 0})
                with H.daemon_process(cold_config, tmp) as daemon:
                    trio.run(warm_up, daemon.socket, agents)
                    cold = [run_load(args, agents_file, daemon, f"windows-off#{rep + 1}", relay.pid)
                            for rep in range(args.repeat)]
                on = [reads_per_s(s) for s in warm]
                off = [reads_per_s(s) for s in cold]
                print(f"  reads/s, windows on (default) {' / '.join(f'{x:.0f}' for x in on)}; "
                      f"windows off (read_window_bytes = 0, every read cold) "
                      f"{' / '.join(f'{x:.0f}' for x in off)}; errors on {[s['errors'] for s in warm]}, "
                      f"off {[s['errors'] for s in cold]}", flush=True)
                print(f"  ratio reads/s windows on / off (same run): "
                      f"{statistics.median(on) / max(1e-9, statistics.median(off)):.2f} "
                      f"(medians of {len(on)} runs each); p50 ms of the runs, on "
                      f"{' / '.join(str(s['p50_ms']) for s in warm)}, off "
                      f"{' / '.join(str(s['p50_ms']) for s in cold)}", flush=True)


def custody_modes(args: argparse.Namespace, tmp: Path, token: Any, state: Path, url: str,
                  relay_pid: int, config: Path, agents: list[H.Agent], agents_file: Path) -> None:
    """--custodian: the same load against custody in process and through the custodian,
    alternating round by round, one run each per round."""
    with H.custodian_process(token, state, url, tmp) as (csock, custodian):
        via = H.write_config(tmp / "via-custodian.toml", token, state, tmp / "broker.sock", url,
                             custody={"custodian_socket": str(csock)})
        rates: dict[str, list[float]] = {"in-process": [], "custodian": []}
        for rep in range(args.repeat):
            for mode, cfg in (("in-process", config), ("custodian", via)):
                with H.daemon_process(cfg, tmp) as daemon:
                    trio.run(warm_up, daemon.socket, agents)
                    c0 = H.proc_stat(custodian.pid).cpu_seconds
                    summary = run_load(args, agents_file, daemon, f"{mode}#{rep + 1}", relay_pid)
                    spent = H.proc_stat(custodian.pid).cpu_seconds - c0
                posts = summary["by_op"].get("post", 0) / max(1e-9, summary["answered"]) * summary["rps"]
                rates[mode].append(posts)
                print(f"  custody {mode:10s} round {rep + 1}: {summary['rps']:.0f} req/s ({posts:.0f} posts/s), "
                      f"p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms; errors {summary['errors'] or 'none'}; "
                      f"daemon {summary['daemon_cores']} cores; custodian {spent:.2f} CPU-s", flush=True)
    print(f"  ratio posts/s custodian / in process (same run, medians of {args.repeat}): "
          f"{statistics.median(rates['custodian']) / max(1e-9, statistics.median(rates['in-process'])):.2f}",
          flush=True)


def allocator_modes(args: argparse.Namespace, tmp: Path, token: Any, state: Path, url: str,
                    relay_pid: int, agents: list[H.Agent], agents_file: Path) -> None:
    """--allocator: the same load with the daemon (and custodian) in this process's
    environment and under their units' environment, alternating round by round."""
    broker, custodian_unit = unit_environment(BROKER_UNIT), unit_environment(CUSTODIAN_UNIT)
    # default: without the units' settings, even where this process has them.
    default = {k: v for k, v in os.environ.items() if k not in broker | custodian_unit}
    environs = {"default": default, "units": default | broker}
    custodian_environs = {"default": default, "units": default | custodian_unit}
    rates: dict[str, list[float]] = {mode: [] for mode in environs}
    cpu_ms: dict[str, list[float]] = {mode: [] for mode in environs}
    for rep in range(args.repeat):
        for mode, environ in environs.items():
            with ExitStack() as stack:
                custody: dict[str, object] = {}
                custodian = None
                if args.custodian:
                    csock, custodian = stack.enter_context(H.custodian_process(
                        token, state, url, tmp, environ=custodian_environs[mode]))
                    custody = {"custodian_socket": str(csock)}
                cfg = H.write_config(tmp / f"allocator-{rep}.toml", token, state,
                                     tmp / "broker.sock", url, custody=custody or None)
                daemon = stack.enter_context(H.daemon_process(cfg, tmp, environ=environ))
                trio.run(warm_up, daemon.socket, agents)
                c0 = H.proc_stat(custodian.pid).cpu_seconds if custodian else 0.0
                summary = run_load(args, agents_file, daemon, f"{mode}#{rep + 1}", relay_pid)
                spent = H.proc_stat(custodian.pid).cpu_seconds - c0 if custodian else 0.0
            posts = summary["by_op"].get("post", 0) / max(1e-9, summary["answered"]) * summary["rps"]
            rates[mode].append(posts)
            per_request = summary["daemon_cores"] / max(1e-9, summary["rps"]) * 1e3
            cpu_ms[mode].append(per_request)
            print(f"  allocator {mode:8s} round {rep + 1}: {summary['rps']:.0f} req/s ({posts:.0f} posts/s), "
                  f"p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms; errors {summary['errors'] or 'none'}; "
                  f"daemon {summary['daemon_cores']} cores ({per_request:.3f} CPU-ms a request), "
                  f"{summary['daemon_rss_mb']} MB"
                  + (f"; custodian {spent:.2f} CPU-s" if custodian else ""), flush=True)
    # Each round's pair ran back to back: the median of the rounds' ratios, so a machine
    # that got busier between rounds (shared cores) moves both sides of a ratio alike.
    def ratio(by_mode: dict[str, list[float]]) -> float:
        return statistics.median(u / max(1e-9, d) for u, d in zip(by_mode["units"], by_mode["default"]))
    print(f"  ratio units / default (same run, median of {args.repeat} rounds' ratios): "
          f"posts/s {ratio(rates):.2f}, daemon CPU-ms a request {ratio(cpu_ms):.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=64, help="closed loop: requests in flight (default 64)")
    mode.add_argument("--rate", type=float, default=0.0, help="open loop: arrivals per second in total")
    parser.add_argument("--agents", type=int, default=64, help="agents, each its own key and credential")
    parser.add_argument("--mix", type=parse_mix, default=parse_mix("post=1"), help="e.g. post=8,read=2 (ops: post, replay, read, storage)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run (bound)")
    parser.add_argument("--requests", type=int, default=1_000_000, help="requests per run at most (bound)")
    parser.add_argument("--procs", type=int, default=1, help="generator processes")
    parser.add_argument("--relay", choices=("null", "local"), default="null")
    parser.add_argument("--read-events", type=int, default=100, help="events per channel the null relay holds")
    parser.add_argument("--repeat", type=int, default=1, help="runs against the same daemon")
    parser.add_argument("--max-outstanding", type=int, default=1024, help="open loop: in-flight cap per process")
    parser.add_argument("--no-floor", action="store_true", help="skip the custody floor baseline")
    parser.add_argument("--custodian", action="store_true",
                        help="alternate custody in the daemon's process and through the custodian")
    parser.add_argument("--allocator", action="store_true",
                        help="alternate the default allocator and the systemd units' settings")
    parser.add_argument("--no-read-baseline", action="store_true",
                        help="skip the reads' baseline (the same runs with read windows off)")
    parser.add_argument("--floor-seconds", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", metavar="PREFIX", help="py-spy the daemon during each run (collapsed stacks to PREFIX.<run>.txt)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--agents-file", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--slice", type=lambda s: tuple(int(x) for x in s.split("/")), default=(0, 1), help=argparse.SUPPRESS)
    parser.add_argument("--read-expect", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--read-exact", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("agents", "duration", "requests", "procs"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.duration > 600:
        parser.error("--duration is bounded at 600 s")
    if args.worker:
        trio.run(worker, args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
