"""daemon.metrics: the exposition format parsed back, and the scrape endpoint served by
daemon.http over a real Unix socket and a real loopback TCP socket."""

from __future__ import annotations

import functools
import os
import re
import stat
import time
from pathlib import Path

import pytest
import trio

from daemon.http import ListenError, ServerControl, bind_tcp_socket, bind_unix_socket, serve
from daemon.metrics import (
    CONTENT_TYPE,
    MAX_SERIES,
    REQUEST_BUCKETS,
    SCRAPE_LIMITS,
    TOKEN_BUCKETS,
    Metrics,
    scrape_routes,
)

ACTIONS = ("channel.read", "message.post", "reaction.add")

# One sample line of text format 0.0.4: name, optional {labels}, value.
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def _unescape(v: str) -> str:
    return re.sub(r'\\(.)', lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], v)


def parse(text: bytes) -> tuple[dict[str, tuple[str, str]], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """Strict reader: every line is HELP, TYPE or a sample of a family declared above it."""
    meta: dict[str, tuple[str, str]] = {}
    helps: dict[str, str] = {}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    decoded = text.decode("utf-8")
    assert decoded.endswith("\n")
    for line in decoded[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, h = line[7:].partition(" ")
            helps[name] = h
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            assert name in helps and name not in meta, line
            meta[name] = (kind, helps[name])
        else:
            m = _SAMPLE.match(line)
            assert m, line
            name, _, body, value = m.groups()
            labels: list[tuple[str, str]] = []
            if body:
                consumed = 0
                for lm in _LABEL.finditer(body):
                    assert lm.start() == consumed, line
                    labels.append((lm.group(1), _unescape(lm.group(2))))
                    consumed = lm.end()
                assert consumed == len(body), line
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in meta else name
            assert family in meta, line
            key = (name, tuple(labels))
            assert key not in samples, line
            samples[key] = float(value)
    return meta, samples


def test_render_parses_back_with_types_and_values() -> None:
    m = Metrics(actions=ACTIONS)
    m.request("message.post", "succeeded", None, 0.003)
    m.request("message.post", "succeeded", None, 0.02)
    m.request("message.post", "failed", "unauthorized", 0.0004)
    m.request(None, None, None, 0.0001)
    m.relay_round_trip("publish", "accepted", 0.012)
    m.token_call("sign", 0.0002)
    m.set_ledger_size(42)
    m.connection_opened(); m.connection_opened(); m.connection_closed()
    meta, s = parse(m.render())
    assert meta["buzz_broker_requests_total"][0] == "counter"
    assert meta["buzz_broker_request_duration_seconds"][0] == "histogram"
    assert meta["buzz_broker_relay_round_trips_total"][0] == "counter"
    assert meta["buzz_broker_relay_round_trip_seconds"][0] == "histogram"
    assert meta["buzz_broker_token_call_seconds"][0] == "histogram"
    assert meta["buzz_broker_ledger_size"][0] == "gauge"
    assert meta["buzz_broker_open_connections"][0] == "gauge"
    req = "buzz_broker_requests_total"
    assert s[(req, (("action", "message.post"), ("status", "succeeded"), ("code", "")))] == 2
    assert s[(req, (("action", "message.post"), ("status", "failed"), ("code", "unauthorized")))] == 1
    assert s[(req, (("action", ""), ("status", "none"), ("code", "")))] == 1
    assert s[("buzz_broker_ledger_size", ())] == 42
    assert s[("buzz_broker_open_connections", ())] == 1
    assert s[("buzz_broker_relay_round_trips_total", (("op", "publish"), ("result", "accepted")))] == 1
    assert s[("buzz_broker_token_call_seconds_count", (("op", "sign"),))] == 1


def test_histogram_buckets_are_cumulative_and_end_at_inf() -> None:
    m = Metrics(actions=ACTIONS)
    observations = [0.0004, 0.0005, 0.003, 0.003, 0.2, 99.0]  # 0.0005 sits exactly on a bound (le)
    for x in observations:
        m.request("channel.read", "succeeded", None, x)
    _, s = parse(m.render())
    name = "buzz_broker_request_duration_seconds"
    buckets = [(float(dict(lbl)["le"]), v) for (n, lbl), v in s.items() if n == name + "_bucket"]
    assert [b for b, _ in buckets] == [*REQUEST_BUCKETS, float("inf")]
    for bound, count in buckets:
        assert count == sum(1 for x in observations if x <= bound)
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)
    assert s[(name + "_count", (("action", "channel.read"),))] == len(observations)
    assert s[(name + "_sum", (("action", "channel.read"),))] == pytest.approx(sum(observations))
    assert buckets[-1][1] == len(observations)
    assert b'le="+Inf"' in m.render()


def test_label_escaping_round_trips() -> None:
    m = Metrics(actions=ACTIONS)
    nasty = 'a\\b"c\nd}e,f="g'
    m.relay_round_trip("publish", nasty, 0.01)
    text = m.render()
    assert b'result="a\\\\b\\"c\\nd}e,f=\\"g"' in text
    assert b"\nd}" not in text  # a raw line feed inside a label would end the sample line
    _, s = parse(text)
    assert s[("buzz_broker_relay_round_trips_total", (("op", "publish"), ("result", nasty)))] == 1


def test_unknown_actions_and_series_are_bounded() -> None:
    m = Metrics(actions=ACTIONS)
    m.request("sign", "failed", "unknown_action", 0.001)  # an agent's string is not a label
    _, s = parse(m.render())
    assert (("buzz_broker_requests_total", (("action", "other"), ("status", "failed"), ("code", "unknown_action")))) in s
    for i in range(MAX_SERIES + 50):
        m.token_call(f"op{i}", 0.001)
    _, s = parse(m.render())
    ops = {dict(lbl)["op"] for (n, lbl), _ in s.items() if n == "buzz_broker_token_call_seconds_count"}
    assert len(ops) == MAX_SERIES + 1 and "other" in ops
    assert s[("buzz_broker_token_call_seconds_count", (("op", "other"),))] == 50
    assert len(TOKEN_BUCKETS) == len(set(TOKEN_BUCKETS))


def _registry_only(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
                   ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples the registry holds: without the read-at-scrape process_* and build info."""
    return {k: v for k, v in samples.items()
            if not k[0].startswith("process_") and k[0] != "buzz_broker_build_info"}


def test_fresh_registry_renders_gauges_at_zero() -> None:
    _, s = parse(Metrics(actions=ACTIONS).render())
    assert _registry_only(s) == {("buzz_broker_ledger_size", ()): 0,
                                 ("buzz_broker_open_connections", ()): 0}


def test_process_and_build_info_families() -> None:
    from importlib import metadata
    import platform
    import resource

    meta, s = parse(Metrics(actions=ACTIONS).render())
    version = metadata.version("buzz-broker")
    assert s[("buzz_broker_build_info", (("version", version),
                                         ("python", platform.python_version())))] == 1
    assert meta["process_cpu_seconds_total"][0] == "counter"
    assert abs(s[("process_open_fds", ())] - len(os.listdir("/proc/self/fd"))) <= 1
    assert s[("process_max_fds", ())] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    rss = s[("process_resident_memory_bytes", ())]
    assert 10 * 2**20 < rss < s[("process_virtual_memory_bytes", ())]


def test_process_start_time_is_when_the_process_started() -> None:
    import subprocess
    import sys

    spawned = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "from daemon.metrics import process_lines; "
         "print([l for l in process_lines() if l.startswith('process_start_time_seconds ')][0])"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    started = float(out.stdout.split()[1])
    assert spawned - 1 < started < spawned + 5


async def _exchange(stream: trio.abc.Stream, raw: bytes) -> bytes:
    """Send `raw`, read until the server closes (a scrape is one request per connection)."""
    async with stream:
        await stream.send_all(raw)
        chunks = []
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                chunks.append(chunk)
    return b"".join(chunks)


async def _http(path: str, raw: bytes) -> bytes:
    return await _exchange(await trio.open_unix_socket(path), raw)


async def _serve_socket(nursery: trio.Nursery, registry: Metrics, path: str) -> ServerControl:
    """What daemon/cli/serve.py does for `[metrics] socket`."""
    control: ServerControl = await nursery.start(functools.partial(
        serve, scrape_routes(registry), path, SCRAPE_LIMITS, socket_mode=0o600))
    return control


async def test_admin_socket_serves_metrics_and_404(tmp_path: Path) -> None:
    m = Metrics(actions=ACTIONS)
    m.request("message.post", "succeeded", None, 0.01)
    path = str(tmp_path / "admin.sock")
    async with trio.open_nursery() as nursery:
        await _serve_socket(nursery, m, path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        ok = await _http(path, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = ok.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert f"content-type: {CONTENT_TYPE}".encode() in head.lower()
        assert b"connection: close" in head.lower()
        served = parse(body)[1]
        assert _registry_only(served) == _registry_only(parse(m.render())[1])
        assert ("process_open_fds", ()) in served
        # A Prometheus scrape config may add parameters: the path alone routes.
        query = await _http(path, b"GET /metrics?module=x HTTP/1.1\r\nHost: x\r\n\r\n")
        assert query.startswith(b"HTTP/1.1 200 ")
        missing = await _http(path, b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
        assert missing.startswith(b"HTTP/1.1 404 ")
        post = await _http(path, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert post.startswith(b"HTTP/1.1 405 ") and b"\r\nAllow: GET, HEAD\r\n" in post
        garbage = await _http(path, b"\x00\x01 nonsense\r\n\r\n")
        assert garbage.startswith(b"HTTP/1.1 400 ")
        nursery.cancel_scope.cancel()
    assert not os.path.exists(path)  # removed on exit


async def test_head_gets_the_length_of_get_and_no_body(tmp_path: Path) -> None:
    path = str(tmp_path / "admin.sock")
    m = Metrics(actions=ACTIONS)
    async with trio.open_nursery() as nursery:
        await _serve_socket(nursery, m, path)
        got = await _http(path, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and body == b""
        declared = re.search(rb"(?i)content-length: (\d+)", head)
        assert declared is not None
        length = int(declared.group(1))
        get = await _http(path, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        # The same registry, one scrape later: only read-at-scrape figures may differ.
        assert abs(len(get.partition(b"\r\n\r\n")[2]) - length) < 64
        nursery.cancel_scope.cancel()


async def test_scrape_bounds_body_and_head(tmp_path: Path) -> None:
    """SCRAPE_LIMITS: a scrape carries no body (413) and at most 8 KiB of head (431)."""
    path = str(tmp_path / "admin.sock")
    async with trio.open_nursery() as nursery:
        await _serve_socket(nursery, Metrics(actions=ACTIONS), path)
        body = await _http(path, b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        assert body.startswith(b"HTTP/1.1 413 ")
        flood = b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 100) for i in range(90))
        big = await _http(path, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + flood + b"\r\n")
        assert big.startswith(b"HTTP/1.1 431 ")
        nursery.cancel_scope.cancel()


async def test_admin_socket_replaces_stale_socket_and_refuses_a_file(tmp_path: Path) -> None:
    import socket as pysocket
    stale = tmp_path / "stale.sock"
    s = pysocket.socket(pysocket.AF_UNIX)
    s.bind(str(stale)); s.close()
    m = Metrics(actions=ACTIONS)
    async with trio.open_nursery() as nursery:
        await _serve_socket(nursery, m, str(stale))
        assert (await _http(str(stale), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        nursery.cancel_scope.cancel()
    regular = tmp_path / "file"
    regular.write_text("keep me")
    with pytest.raises(ListenError, match="not a socket"):
        await serve(scrape_routes(m), str(regular), SCRAPE_LIMITS)
    assert regular.read_text() == "keep me"


async def test_admin_socket_leaves_a_live_socket_alone(tmp_path: Path) -> None:
    """The stale-socket check the old metrics server lacked: it unlinked whatever socket
    was at its path, so a second daemon (or a typo'd path) cut off a live listener."""
    path = str(tmp_path / "admin.sock")
    live = bind_unix_socket(path, mode=0o600)
    try:
        with pytest.raises(ListenError, match="already listening"):
            await serve(scrape_routes(Metrics(actions=ACTIONS)), path, SCRAPE_LIMITS)
        assert os.path.exists(path)
        probe = trio.socket.socket(trio.socket.AF_UNIX)
        with probe:
            await probe.connect(path)  # still the live listener's
    finally:
        live.close()


async def test_tcp_listener_serves_metrics_on_loopback() -> None:
    """[metrics] listen: what any local user can read over TCP, and nothing identifying."""
    m = Metrics(actions=ACTIONS)
    m.request("message.post", "succeeded", None, 0.01)
    m.request("not-an-action-" + "a" * 64, "failed", "unauthorized", 0.01)
    tcp = bind_tcp_socket("127.0.0.1", 0)
    host, port = tcp.getsockname()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, scrape_routes(m), tcp, SCRAPE_LIMITS)
        got = await _exchange(await trio.open_tcp_stream(host, port),
                              f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        _, served = parse(body)
        assert served[("buzz_broker_requests_total",
                       (("action", "message.post"), ("status", "succeeded"), ("code", "")))] == 1
        assert ("process_resident_memory_bytes", ()) in served
        assert b"not-an-action" not in body  # an agent's string never becomes a label
        nursery.cancel_scope.cancel()
    with pytest.raises(OSError):  # closed with its nursery
        await trio.open_tcp_stream(host, port)


def test_tcp_port_taken_is_one_line() -> None:
    taken = bind_tcp_socket("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as info:
            bind_tcp_socket("127.0.0.1", port)
        assert str(info.value) == f"127.0.0.1:{port}: Address already in use"
    finally:
        taken.close()


async def test_the_ledger_size_is_counted_at_start_and_says_it_is_hourly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not read at scrape (the ledger keeps a running count of bytes, not of records; a
    # count is a query on its writer): the sweeper sets it at its first round, when the
    # daemon starts, and then once an interval, and the help text says so.
    from buzzwire.contract import Status
    from daemon import wiring
    from daemon.state.ledger import Fresh, Ledger, LedgerKey

    assert wiring.SWEEP_INTERVAL_SECONDS == 3600  # what "hourly" below means
    ledger = Ledger.open(tmp_path / "ledger.db", retention_seconds=3600)
    for i in range(3):
        begun = await ledger.begin(LedgerKey("a" * 64, f"r-{i}"), bytes(32))
        assert isinstance(begun, Fresh)
        await ledger.finish(begun.ticket, b"{}", Status.SUCCEEDED)
    m = Metrics(actions=ACTIONS)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wiring._sweep_forever, ledger, m)
            with trio.fail_after(10):
                while parse(m.render())[1][("buzz_broker_ledger_size", ())] != 3:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        ledger.close()
    kind, help_text = parse(m.render())[0]["buzz_broker_ledger_size"]
    assert kind == "gauge" and "hourly" in help_text and "start" in help_text
