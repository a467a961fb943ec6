"""What the HTTP/1.1 transport alone costs: daemon/http.py's `serve`, a trivial application.

    python benchmarks/http_transport.py [--connections 32] [--rate 500] [--duration 8]
                                        [--warmup 2] [--rounds 3]
                                        [--baseline-ref fadae9c | --no-baseline]
                                        [--profile PREFIX]

What runs (loopback only; nothing is written outside a temporary directory):
  1. the **baseline**: --baseline-ref (default fadae9c, main when this benchmark was
     written), `git archive`d into the temporary directory. Only the source differs: both
     servers run on this interpreter and its h11 and trio, with the baseline's (or this
     checkout's) tree first on ``sys.path``, so a ratio is the transport code's alone;
  2. per round, one server process per build (the order alternates from round to round,
     so a drift of the machine lands on both): `serve` over a loopback TCP listener bound
     by `bind_tcp_socket`, the daemon's action-API shape - `action_routes`, the [server]
     defaults of `HttpLimits` with the TCP listener's per-credential cap, an `AdmissionGate`
     that admits our uid (no user-database lookup), so every request passes the browser
     rule (`daemon.loopback_tcp.browser_refusal`) - and an application that answers every
     request with the same 158-byte JSON envelope at once;
  3. one load-generator process (plain non-blocking sockets and epoll, no trio: its own
     cost stays small and off the server's loop): --connections keep-alive connections,
     together sending --rate requests a second on a fixed schedule (each connection every
     connections/rate s, phases spread evenly), one request in flight per connection as
     Buzz's transport has; each request a Buzz-like ``POST /v1/action`` with Host,
     Content-Type, Content-Length, ``Authorization: Bearer`` (one credential per
     connection, as one per agent: the listener caps connections per credential) and a
     200-byte channel.read body with a fresh requestId, 402 bytes in all. After --warmup s
     a --duration s window is measured.

Printed per run (one JSON line): requests answered in the window and per second, latency
p50/p99 counted from the scheduled send (so a server that falls behind shows it; the wire
latency, from the actual send, beside it), and the server's CPU per request: its main
thread's ``time.thread_time()`` (the event loop, where the transport runs) and the whole
process's ``resource.getrusage`` (user + system), both read by the server itself at the
window's edges. Then per build the median over rounds, and the ratios of this checkout to
the baseline from the same run.

--profile PREFIX: also run each server of the last round under cProfile with
``time.thread_time`` as its clock (the main thread's CPU, not wall time) and write
PREFIX-<build>.pstats; cProfile inflates call-heavy code about threefold here, so read
shares, not times, and never the CPU figures of a profiled run (they are marked and left
out of the medians). With --sample instead: stacks sampled on the process's CPU time
(SIGPROF), PREFIX-<build>.stacks, one "frame;frame;... count" line per stack.

Noise: on the shared 2-core machine the same code measured against itself (A/A) differs
by up to 6 % in CPU per request over 3 rounds; a ratio inside that says nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: main when this benchmark was written: the transport before any cut measured with it.
BASELINE_REF = "fadae9c"

#: The answer: a realistic small envelope (a `failed` one, the smallest the daemon sends).
ANSWER = json.dumps({
    "type": "broker_response", "protocolVersion": 1,
    "requestId": "00000000-0000-4000-8000-000000000000", "status": "failed",
    "code": "invalid_request", "message": "fixed",
}, separators=(",", ":")).encode()

#: A Buzz channel.read, about 200 bytes; the requestId (36 characters) is replaced per request.
_BODY_TEMPLATE = json.dumps({
    "type": "broker_request", "protocolVersion": 1, "requestId": "R" * 36,
    "actionVersion": 1, "action": "channel.read",
    "args": {"channelId": "5df7dfa8-e919-43df-8efd-f1dcb8af7071", "limit": 100,
             "mentionsOnly": False},
}, separators=(",", ":")).encode()


def _credential(index: int) -> str:
    """A credential's shape (`bb1_` and 43 base64url characters), one per connection as
    one per agent (the TCP listener caps connections per credential); never a real one."""
    return f"bb1_{index:043d}"


# ------------------------------------------------------------------ the server process


def serve_main(root: str, profile: str | None) -> None:
    """One server: `serve` of the tree at `root`; answers "t" on stdin with its CPU times."""
    sys.path.insert(0, root)
    import resource

    import trio

    from daemon import http
    from daemon.loopback_tcp import AdmissionGate, TcpAdmission

    assert Path(http.__file__).resolve().is_relative_to(Path(root).resolve()), http.__file__

    class Fixed:
        async def handle(self, request: http.HttpRequest) -> http.HttpAnswer:
            return http.HttpAnswer(200, ANSWER)

    def times() -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"thread": time.thread_time(), "process": usage.ru_utime + usage.ru_stime,
                "system": usage.ru_stime}

    async def main() -> None:
        raw = http.bind_tcp_socket("127.0.0.1", 0)
        port = raw.getsockname()[1]
        limits = http.HttpLimits(max_connections_per_credential=32)  # [server] defaults
        async with trio.open_nursery() as nursery:
            # The baseline's gate (before a622490) takes no nursery: the same script
            # serves both trees.
            owner = ({"nursery": nursery}
                     if "nursery" in inspect.signature(AdmissionGate).parameters else {})
            gate = AdmissionGate(TcpAdmission(frozenset({os.getuid()}), frozenset()), **owner)
            control = await nursery.start(lambda task_status: http.serve(
                http.action_routes(Fixed()), raw, limits, admit=gate, task_status=task_status))
            print(json.dumps({"port": port}), flush=True)
            stdin = trio.lowlevel.FdStream(os.dup(0))
            buffered = b""
            while True:
                chunk = await stdin.receive_some(64)
                if not chunk:
                    break
                buffered += chunk
                while b"\n" in buffered:
                    _line, buffered = buffered.split(b"\n", 1)
                    print(json.dumps(times()), flush=True)
            control.stop()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if profile is None:
        trio.run(main)
        return
    if profile.endswith(".stacks"):
        _sampled(lambda: trio.run(main), profile)
        return
    import cProfile
    profiler = cProfile.Profile(time.thread_time)
    profiler.runcall(trio.run, main)
    profiler.dump_stats(profile)


def _sampled(run: Any, path: str) -> None:
    """Run `run()` sampling the main thread's stack every ms of process CPU (SIGPROF).

    Why beside cProfile: it costs almost nothing per call, so call-heavy code is not
    inflated. A Python handler runs at the next bytecode boundary, so time in a C call
    (recv, epoll_wait, a regex) lands on the Python line that made the call.
    """
    from collections import Counter
    stacks: Counter[str] = Counter()

    def sample(_signum: int, frame: Any) -> None:
        names = []
        while frame is not None:
            code = frame.f_code
            names.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        stacks[";".join(reversed(names))] += 1

    signal.signal(signal.SIGPROF, sample)
    signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)
    try:
        run()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        with open(path, "w") as out:
            for stack, count in stacks.most_common():
                out.write(f"{stack} {count}\n")


# ------------------------------------------------------------------ the load generator


def _request(port: int, credential: str) -> bytes:
    body = _BODY_TEMPLATE.replace(b"R" * 36, str(uuid.uuid4()).encode())
    head = (f"POST /v1/action HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Authorization: Bearer {credential}\r\n\r\n").encode()
    return head + body


class _Client:
    __slots__ = ("sock", "credential", "due", "sent", "buffer", "busy")

    def __init__(self, sock: socket.socket, credential: str, due: float) -> None:
        self.sock = sock
        self.credential = credential
        self.due = due
        self.sent = 0.0
        self.buffer = b""
        self.busy = False


def _complete(buffer: bytes) -> bool:
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return False
    head = buffer[:end].lower()
    at = head.find(b"content-length:")
    if at < 0 or not head.startswith(b"http/1.1 200"):
        raise SystemExit(f"the server refused a request: {head[:40]!r}")
    length = int(head[at + 15:].split(b"\r\n", 1)[0])
    assert len(buffer) <= end + 4 + length, "one request in flight: nothing may follow"
    return len(buffer) == end + 4 + length


def load_main(port: int, connections: int, rate: float, warmup: float, duration: float) -> None:
    """Drive the server on a fixed schedule; print "window" at each edge, then the figures."""
    interval = connections / rate
    clients: dict[int, _Client] = {}
    poller = select.epoll()
    start = time.monotonic() + 0.2
    for i in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as HTTP clients do
        sock.setblocking(False)
        clients[sock.fileno()] = _Client(sock, _credential(i), start + interval * i / connections)
        poller.register(sock.fileno(), select.EPOLLIN)
    t0 = start + warmup
    t1 = t0 + duration
    edges = [t0, t1]
    latencies: list[float] = []
    wire: list[float] = []
    late_sends = 0
    while True:
        now = time.monotonic()
        if edges and now >= edges[0]:
            edges.pop(0)
            print("window", flush=True)
            sys.stdin.readline()  # the driver has read the server's times
            if not edges:
                break
            continue
        for client in clients.values():
            if not client.busy and client.due <= now:
                data = _request(port, client.credential)
                client.sent = time.monotonic()
                late_sends += client.sent - client.due > interval
                client.sock.send(data)  # ~400 bytes into an empty buffer: never partial
                client.busy = True
        idle = [c.due for c in clients.values() if not c.busy]
        wake = min(idle + edges) if idle or edges else now + 0.01
        for fd, _mask in poller.poll(max(0.0, wake - time.monotonic())):
            client = clients[fd]
            chunk = client.sock.recv(65536)
            if not chunk:
                raise SystemExit("the server closed a connection")
            client.buffer += chunk
            if _complete(client.buffer):
                done = time.monotonic()
                if t0 <= client.due < t1:
                    latencies.append(done - client.due)
                    wire.append(done - client.sent)
                client.buffer = b""
                client.busy = False
                client.due += interval
    cpu = time.process_time()
    for client in clients.values():
        client.sock.close()
    print(json.dumps({"answered": len(latencies), "late_sends": late_sends,
                      "latencies": latencies, "wire": wire, "generator_cpu": cpu}), flush=True)


# ------------------------------------------------------------------ the driver


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_once(args: argparse.Namespace, label: str, root: Path, profile: str | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--serve", str(root)]
    if profile:
        command += ["--profile-to", profile]
    server = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    try:
        port = json.loads(server.stdout.readline())["port"]
        load = subprocess.Popen(
            [sys.executable, __file__, "--load", str(port), "--connections", str(args.connections),
             "--rate", str(args.rate), "--warmup", str(args.warmup), "--duration", str(args.duration)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert load.stdin is not None and load.stdout is not None
        edges = []
        for _ in range(2):
            assert load.stdout.readline().strip() == "window"
            server.stdin.write("t\n")
            server.stdin.flush()
            edges.append(json.loads(server.stdout.readline()))
            load.stdin.write("go\n")
            load.stdin.flush()
        result = json.loads(load.stdout.readline())
        load.wait(timeout=30)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    n = max(1, result["answered"])
    thread = edges[1]["thread"] - edges[0]["thread"]
    process = edges[1]["process"] - edges[0]["process"]
    system = edges[1]["system"] - edges[0]["system"]
    return {
        "run": label, "profiled": bool(profile),
        "answered": result["answered"], "answered_per_s": round(result["answered"] / args.duration, 1),
        "scheduled_per_s": args.rate, "late_sends": result["late_sends"],
        "p50_ms": round(pct(result["latencies"], 0.50) * 1000, 3),
        "p99_ms": round(pct(result["latencies"], 0.99) * 1000, 3),
        "wire_p50_ms": round(pct(result["wire"], 0.50) * 1000, 3),
        "wire_p99_ms": round(pct(result["wire"], 0.99) * 1000, 3),
        "thread_cpu_ms_per_request": round(thread / n * 1000, 4),
        "process_cpu_ms_per_request": round(process / n * 1000, 4),
        "system_share": round(system / process, 3) if process else None,
        "server_cores": round(process / args.duration, 3),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


_COMPARED = ("thread_cpu_ms_per_request", "process_cpu_ms_per_request", "p50_ms", "p99_ms")


def baseline_tree(ref: str, into: Path) -> tuple[Path, str]:
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                         capture_output=True, text=True, check=False)
    if sha.returncode != 0:
        raise SystemExit(f"the baseline ref {ref} is not in this repository's history")
    full = sha.stdout.strip()
    into.mkdir()
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", "--format=tar", full],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit("git archive of the baseline failed")
    return into, full


def driver(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="buzz-http-bench-") as tmp:
        builds: list[tuple[str, Path]] = [("checkout", REPO)]
        if args.baseline_ref:
            root, full = baseline_tree(args.baseline_ref, Path(tmp) / "baseline")
            builds.append((f"baseline {full[:7]}", root))
        print(json.dumps({"connections": args.connections, "rate": args.rate,
                          "duration": args.duration, "rounds": args.rounds,
                          "request_bytes": len(_request(1, _credential(0))), "answer_body_bytes": len(ANSWER)}),
              flush=True)
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in builds}
        for round_ in range(args.rounds):
            order = builds if round_ % 2 == 0 else builds[::-1]
            for label, root in order:
                profile = None
                if args.profile and round_ == args.rounds - 1:
                    suffix = "stacks" if args.sample else "pstats"
                    profile = f"{args.profile}-{label.split()[0]}.{suffix}"
                summary = run_once(args, label, root, profile)
                print(json.dumps(summary), flush=True)
                if not profile:
                    runs[label].append(summary)
        medians = {label: {key: round(statistics.median(r[key] for r in rs), 4) for key in _COMPARED}
                   for label, rs in runs.items() if rs}
        for label, figures in medians.items():
            print(json.dumps({"median_of": label, "rounds": len(runs[label]), **figures}), flush=True)
        if len(medians) == 2:
            mine, base = medians[builds[0][0]], medians[builds[1][0]]
            print(json.dumps({"ratio_to_baseline": builds[1][0], **{
                key: round(mine[key] / base[key], 3) if base[key] else None for key in _COMPARED}}),
                flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rate", type=float, default=500.0, help="requests a second, all connections")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    parser.add_argument("--no-baseline", dest="baseline_ref", action="store_const", const="")
    parser.add_argument("--profile", metavar="PREFIX", help="profile the last round's servers")
    parser.add_argument("--sample", action="store_true",
                        help="with --profile: sample stacks on CPU time instead of cProfile")
    # The two child roles (run by the driver, not by hand).
    parser.add_argument("--serve", metavar="ROOT", help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", help=argparse.SUPPRESS)
    parser.add_argument("--load", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_main(args.serve, args.profile_to)
    elif args.load:
        load_main(args.load, args.connections, args.rate, args.warmup, args.duration)
    else:
        if not (0 < args.connections <= 1024 and 0 < args.rate <= 20000 and args.rounds >= 1
                and 0 < args.duration <= 600):
            parser.error("--connections 1-1024, --rate up to 20000, --duration up to 600 s")
        driver(args)


if __name__ == "__main__":
    main()
