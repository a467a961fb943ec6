"""daemon/http over a real Unix socket: routing, keep-alive, pipelining, bounds, drain.

The client side is written by hand (raw bytes out, a small response reader in) so that
the tests can do what well-behaved clients never do: pipeline, stall, flood, hang up.
"""

from __future__ import annotations

import gc
import io
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio

from daemon.http import (
    HEAD_RECEIVE_SIZE,
    HttpAnswer,
    HttpLimits,
    HttpRequest,
    ListenError,
    Routes,
    ServerControl,
    _Connection,
    action_routes,
    bind_tcp_socket,
    bind_unix_socket,
    serve,
    unlink_if_ours,
)
from daemon.log import setup_logging

SECRET = "Bearer s3cret-credential-never-logged"


@pytest.fixture
def sockdir() -> Iterator[str]:
    # Short and under /tmp: sun_path holds 107 bytes, and pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="bbh", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class EchoApp:
    """Answers 200 with the body it got; remembers every request."""

    def __init__(self) -> None:
        self.seen: list[HttpRequest] = []

    async def handle(self, request: HttpRequest) -> HttpAnswer:
        self.seen.append(request)
        return HttpAnswer(200, request.body)


class SlowApp:
    """Answers after `delay` seconds; counts the requests it started and those cut short."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.started = 0
        self.cancelled = 0

    async def handle(self, request: HttpRequest) -> HttpAnswer:
        self.started += 1
        try:
            await trio.sleep(self.delay)
        except trio.Cancelled:
            self.cancelled += 1
            raise
        return HttpAnswer(200, b'{"slow":true}')


class RaisingApp:
    async def handle(self, request: HttpRequest) -> HttpAnswer:
        raise RuntimeError(f"boom {request.authorization}")


def req(
    body: bytes = b"{}",
    *,
    method: str = "POST",
    target: str = "/v1/action",
    headers: str = "",
    length: int | None = None,
) -> bytes:
    n = len(body) if length is None else length
    head = f"{method} {target} HTTP/1.1\r\nHost: broker\r\n"
    if method == "POST" or body:
        head += f"Content-Length: {n}\r\n"
    return (head + headers + "\r\n").encode() + body


class Reader:
    """Reads HTTP/1.1 responses (Content-Length framed) off a stream, one at a time."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(65536)
        self.buf += data
        return bool(data)

    async def next(self) -> tuple[int, dict[str, str], bytes] | None:
        while b"\r\n\r\n" not in self.buf:
            if not await self._fill():
                assert self.buf == b"", self.buf
                return None
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
        if status == 100:
            return status, headers, b""
        n = int(headers["content-length"])
        while len(self.buf) < n:
            assert await self._fill(), "eof inside a body"
        body, self.buf = self.buf[:n], self.buf[n:]
        return status, headers, body

    async def eof(self) -> bool:
        """True once the server has closed the connection (with nothing more to read)."""
        return self.buf == b"" and not await self._fill()


async def start(
    nursery: trio.Nursery, app: object, path: str, **limits: float
) -> ServerControl:
    control: ServerControl = await nursery.start(
        serve, action_routes(app), path, HttpLimits(**limits)  # type: ignore[arg-type]
    )
    return control


async def connect(path: str) -> tuple[trio.SocketStream, Reader]:
    stream = await trio.open_unix_socket(path)
    return stream, Reader(stream)


@asynccontextmanager
async def served(
    app: object, sockdir: str, **limits: float
) -> AsyncIterator[tuple[ServerControl, trio.SocketStream, Reader]]:
    """A server on `sockdir`/b.sock with one client connected; stopped on the way out."""
    path = os.path.join(sockdir, "b.sock")
    async with trio.open_nursery() as nursery:
        control = await start(nursery, app, path, **limits)
        stream, reader = await connect(path)
        yield control, stream, reader
        control.stop()


async def wait_until(predicate: object, timeout: float = 3.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():  # type: ignore[operator]
            await trio.sleep(0.01)


async def test_post_answered_with_app_bytes(sockdir: str) -> None:
    app = EchoApp()
    async with served(app, sockdir) as (control, stream, reader):
        await stream.send_all(req(b'{"x":1}', headers=f"Authorization: {SECRET}\r\n"))
        answer = await reader.next()
        assert answer is not None
        status, headers, body = answer
        assert (status, body) == (200, b'{"x":1}')
        assert headers["content-type"] == "application/json"
        assert app.seen[0].authorization == SECRET
        assert SECRET not in repr(app.seen[0])
        await stream.aclose()


async def test_peer_uid_and_pid_delivered(sockdir: str) -> None:
    app = EchoApp()
    async with served(app, sockdir) as (control, stream, reader):
        await stream.send_all(req())
        assert (await reader.next()) is not None
        assert app.seen[0].peer_uid == os.getuid()
        assert app.seen[0].peer_pid == os.getpid()
        assert app.seen[0].authorization is None


@pytest.mark.parametrize(
    ("method", "target", "status", "allow"),
    [
        ("GET", "/v1/action", 405, "POST"),
        ("PUT", "/v1/action", 405, "POST"),
        ("DELETE", "/v1/action", 405, "POST"),
        ("GET", "/", 404, None),
        ("POST", "/v1/actions", 404, None),
        ("POST", "/v1/action?x=1", 404, None),
        ("POST", "/v2/action", 404, None),
    ],
)
async def test_routing_refusals_have_no_body(
    sockdir: str, method: str, target: str, status: int, allow: str | None
) -> None:
    app = EchoApp()
    async with served(app, sockdir) as (control, stream, reader):
        body = b"{}" if method in ("POST", "PUT") else b""
        await stream.send_all(req(body, method=method, target=target))
        answer = await reader.next()
        assert answer is not None
        got, headers, payload = answer
        assert (got, payload, headers["content-length"]) == (status, b"", "0")
        assert "content-type" not in headers
        assert headers.get("allow") == allow
        assert app.seen == []


async def test_bodiless_refusal_keeps_the_connection(sockdir: str) -> None:
    async with served(EchoApp(), sockdir) as (control, stream, reader):
        await stream.send_all(req(b"", method="GET", target="/metrics"))
        first = await reader.next()
        await stream.send_all(req(b'"again"'))
        second = await reader.next()
        assert first is not None and second is not None
        assert (first[0], second[0], second[2]) == (404, 200, b'"again"')


async def test_keep_alive_two_sequential_requests(sockdir: str) -> None:
    app = EchoApp()
    async with served(app, sockdir) as (control, stream, reader):
        for n in range(2):
            await stream.send_all(req(f'{{"n":{n}}}'.encode()))
            answer = await reader.next()
            assert answer is not None and answer[2] == f'{{"n":{n}}}'.encode()
        assert control.connections == 1


async def test_pipelined_pair_answered_in_order(sockdir: str) -> None:
    app = EchoApp()
    async with served(app, sockdir) as (control, stream, reader):
        await stream.send_all(req(b'"first"') + req(b'"second"'))
        first, second = await reader.next(), await reader.next()
        assert first is not None and second is not None
        assert (first[2], second[2]) == (b'"first"', b'"second"')


async def test_disconnect_mid_body_leaves_no_task(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    app = EchoApp()
    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            control = await start(nursery, app, path, request_timeout=30, shutdown_grace=30)
            stream, _ = await connect(path)
            await stream.send_all(req(b'{"partial', length=100))
            await wait_until(lambda: control.connections == 1)
            await stream.aclose()
            # The connection task notices the hang-up itself, long before any timeout.
            await wait_until(lambda: control.connections == 0, timeout=1.0)
            control.stop()
    assert app.seen == []


async def test_oversize_declared_body_refused_before_reading(sockdir: str) -> None:
    app = EchoApp()
    async with served(app, sockdir, max_body_bytes=1024) as (control, stream, reader):
        # Declares 1025 bytes and waits for "100 Continue" without sending any of them:
        # the 413 can only come from the declared length.
        await stream.send_all(req(b"", length=1025, headers="Expect: 100-continue\r\n"))
        answer = await reader.next()
        assert answer is not None and answer[0] == 413 and answer[2] == b""
        assert answer[1]["connection"] == "close"
        assert await reader.eof()
        assert app.seen == []


async def test_body_at_the_limit_is_accepted_with_100_continue(sockdir: str) -> None:
    async with served(EchoApp(), sockdir, max_body_bytes=1024) as (control, stream, reader):
        await stream.send_all(req(b"", length=1024, headers="Expect: 100-continue\r\n"))
        cont = await reader.next()
        assert cont is not None and cont[0] == 100
        await stream.send_all(b"a" * 1024)
        answer = await reader.next()
        assert answer is not None and answer[0] == 200 and len(answer[2]) == 1024


async def test_oversize_chunked_body_counted_as_it_arrives(sockdir: str) -> None:
    app = EchoApp()
    async with served(app, sockdir, max_body_bytes=1024) as (control, stream, reader):
        head = b"POST /v1/action HTTP/1.1\r\nHost: b\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"200\r\n" + b"x" * 0x200 + b"\r\n"
        # Three 512-byte chunks: the third crosses 1024. The terminating chunk is never sent.
        await stream.send_all(head + chunk * 3)
        answer = await reader.next()
        assert answer is not None and answer[0] == 413
        assert app.seen == []


async def test_a_body_of_tiny_chunks_does_not_hold_the_loop(sockdir: str) -> None:
    """A body sent in 1-byte chunks is read in full, and another connection is answered
    again and again while it is being read.

    h11 parses every chunk already buffered without a read, so without yielding: one
    64 KiB read of 1-byte chunks (~11,000 of them) used to hold the event loop until the
    whole body was parsed, and no other connection got a turn meanwhile.
    """
    path = os.path.join(sockdir, "b.sock")
    app = EchoApp()
    chunks = 11_000  # 66 KB on the wire: after the 4 KiB head read, one 64 KiB read
    async with trio.open_nursery() as nursery:
        control = await start(nursery, app, path, request_timeout=30)
        victim, victim_reader = await connect(path)
        await victim.send_all(req(b"v"))  # its connection is open and waiting
        assert (await victim_reader.next() or (0,))[0] == 200
        # Written without yielding to the server: all of it is in the kernel before the
        # server reads a byte, so its reads are as few and as large as they can be.
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(path)
        raw.sendall(b"POST /v1/action HTTP/1.1\r\nHost: b\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"1\r\na\r\n" * chunks + b"0\r\n\r\n")
        flood = trio.SocketStream(trio.socket.from_stdlib_socket(raw))
        answered = 0
        while not any(len(r.body) == chunks for r in app.seen):
            await victim.send_all(req(b"v"))
            got = await victim_reader.next()
            assert got is not None and got[0] == 200 and got[2] == b"v"
            answered += 1
        # Not a speed: a count of turns. Holding the loop for the body allowed one or two.
        assert answered >= 10
        got = await Reader(flood).next()
        assert got is not None and got[0] == 200 and got[2] == b"a" * chunks
        await flood.aclose()
        control.stop()


@pytest.mark.parametrize("complete", [True, False])
async def test_header_flood_answered_431(sockdir: str, complete: bool) -> None:
    async with served(EchoApp(), sockdir, max_header_bytes=4096) as (control, stream, reader):
        flood = "".join(f"X-Flood-{i}: {'v' * 100}\r\n" for i in range(60))
        # complete: the whole head arrives at once; incomplete: it never ends.
        data = req(headers=flood) if complete else req(headers=flood)[:-4]
        try:
            await stream.send_all(data)
        except trio.BrokenResourceError:
            pass  # the server may close while we are still writing; the answer is buffered
        answer = await reader.next()
        assert answer is not None and answer[0] == 431 and answer[2] == b""


async def test_malformed_http_answered_400(sockdir: str) -> None:
    async with served(EchoApp(), sockdir) as (control, stream, reader):
        await stream.send_all(b"POST /v1/action HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        answer = await reader.next()
        assert answer is not None and answer[0] == 400
        assert await reader.eof()


async def test_slow_client_cut_off(sockdir: str) -> None:
    app = EchoApp()
    async with served(app, sockdir, request_timeout=0.3) as (control, stream, reader):
        began = trio.current_time()
        await stream.send_all(b"POST /v1/action HTTP/1.1\r\nHost: b\r\nContent-Le")
        answer = await reader.next()
        assert answer is not None and answer[0] == 408
        assert await reader.eof()
        assert 0.25 < trio.current_time() - began < 2.0
        assert app.seen == []


async def test_idle_keep_alive_closed_silently(sockdir: str) -> None:
    async with served(EchoApp(), sockdir, request_timeout=0.2) as (control, stream, reader):
        await stream.send_all(req())
        assert (await reader.next()) is not None
        with trio.fail_after(2):
            assert await reader.eof()  # no 408 for a client that sent nothing


async def test_connection_cap_makes_new_clients_wait(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    async with trio.open_nursery() as nursery:
        control = await start(nursery, EchoApp(), path, max_connections=1, request_timeout=10)
        first, first_reader = await connect(path)
        await first.send_all(req(b'"one"'))
        assert (await first_reader.next()) is not None
        second, second_reader = await connect(path)  # queued in the listen backlog
        await second.send_all(req(b'"two"'))
        with trio.move_on_after(0.3) as waited:
            await second_reader.next()
        assert waited.cancelled_caught, "served beyond max_connections"
        assert control.connections == 1
        await first.aclose()
        with trio.fail_after(2):
            answer = await second_reader.next()
        assert answer is not None and answer[2] == b'"two"'
        control.stop()


async def test_socket_permissions_and_directory(sockdir: str) -> None:
    path = os.path.join(sockdir, "run", "b.sock")
    async with trio.open_nursery() as nursery:
        control = await start(nursery, EchoApp(), path)
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o750
        info = os.lstat(path)
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
        control.stop()
    assert not os.path.exists(path), "serve removes the socket it bound"


def test_socket_mode_and_group_options(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    sock = bind_unix_socket(path, mode=0o600, group=str(os.getgid()))
    try:
        info = os.lstat(path)
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_gid == os.getgid()
    finally:
        sock.close()
    with pytest.raises(ListenError, match="does not exist"):
        bind_unix_socket(os.path.join(sockdir, "c.sock"), group="no-such-group-bb")


async def test_stale_socket_replaced(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays: a stale socket from a crashed process
    async with served(EchoApp(), sockdir) as (control, stream, reader):
        await stream.send_all(req())
        answer = await reader.next()
        assert answer is not None and answer[0] == 200


def test_live_socket_not_stolen(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    live = bind_unix_socket(path)
    try:
        with pytest.raises(ListenError, match="already listening"):
            bind_unix_socket(path)
    finally:
        live.close()


def test_regular_file_at_socket_path_is_an_error(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    with open(path, "w") as f:
        f.write("precious")
    with pytest.raises(ListenError, match="not a socket"):
        bind_unix_socket(path)
    with open(path) as f:
        assert f.read() == "precious"


def test_socket_path_too_long() -> None:
    with pytest.raises(ListenError, match="longer than"):
        bind_unix_socket("/tmp/" + "x" * 200 + ".sock")


async def test_graceful_drain_finishes_in_flight_request(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    app = SlowApp(0.4)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            control = await start(nursery, app, path, shutdown_grace=5)
            busy, busy_reader = await connect(path)
            idle, idle_reader = await connect(path)
            await busy.send_all(req())
            await wait_until(lambda: control.in_flight == 1 and control.connections == 2)
            control.stop()
            # The idle connection is cut at once, new clients are refused...
            assert await idle_reader.eof()
            with pytest.raises(OSError):
                await trio.open_unix_socket(path)
            # ...and the in-flight request still gets its answer, marked as the last one.
            answer = await busy_reader.next()
            assert answer is not None and answer[0] == 200
            assert answer[1]["connection"] == "close"
            assert await busy_reader.eof()
    assert control.connections == 0


async def test_drain_deadline_cuts_what_is_left(sockdir: str) -> None:
    # The handler would sleep an hour: that the server stopped at all, with the handler
    # cancelled and the connection closed unanswered, is what shows the grace cut it.
    app = SlowApp(3600)
    async with served(app, sockdir, shutdown_grace=0.2) as (control, stream, reader):
        await stream.send_all(req())
        await wait_until(lambda: app.started == 1)
    assert app.cancelled == 1
    assert await reader.eof()


async def test_app_exception_is_500_without_traceback(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    out = io.StringIO()
    setup_logging("info", stream=out)
    try:
        async with trio.open_nursery() as nursery:
            control = await start(nursery, RaisingApp(), path)
            stream, reader = await connect(path)
            await stream.send_all(req(headers=f"Authorization: {SECRET}\r\n"))
            answer = await reader.next()
            assert answer is not None and answer[0] == 500 and answer[2] == b""
            # The connection survives the application's fault.
            await stream.send_all(req())
            again = await reader.next()
            assert again is not None and again[0] == 500
            control.stop()
    finally:
        setup_logging("info")
    log = out.getvalue()
    assert '"event":"application_error"' in log and "RuntimeError" in log
    assert "s3cret" not in log and "Traceback" not in log


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ("", None),
        ("Authorization: Bearer abc\r\n", "Bearer abc"),
        ("Authorization: Bearer abc\r\nAuthorization: Bearer def\r\n", ""),
        ("Authorization: Basic Zm9vOmJhcg==\r\n", "Basic Zm9vOmJhcg=="),
    ],
)
async def test_authorization_handed_over_raw(
    sockdir: str, headers: str, expected: str | None
) -> None:
    app = EchoApp()
    async with served(app, sockdir) as (control, stream, reader):
        await stream.send_all(req(headers=headers))
        assert (await reader.next()) is not None
        assert app.seen[0].authorization == expected


async def test_many_clients_at_once(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    app = EchoApp()
    answers: list[bytes] = []

    async def client(n: int) -> None:
        stream, reader = await connect(path)
        await stream.send_all(req(f"{n}".encode()))
        answer = await reader.next()
        assert answer is not None
        answers.append(answer[2])
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        control = await start(nursery, app, path, max_connections=8)
        async with trio.open_nursery() as clients:
            for n in range(50):
                clients.start_soon(client, n)
        control.stop()
    assert sorted(answers) == sorted(f"{n}".encode() for n in range(50))


def test_limits_validated() -> None:
    with pytest.raises(ValueError):
        HttpLimits(max_connections=0)
    with pytest.raises(ValueError):
        HttpLimits(request_timeout=0)


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    yield
    logging.getLogger("buzz_broker").handlers.clear()


class GateApp:
    """Holds every request until `gate` is set; counts requests handed over."""

    def __init__(self) -> None:
        self.gate = trio.Event()
        self.seen = 0

    async def handle(self, request: HttpRequest) -> HttpAnswer:
        self.seen += 1
        await self.gate.wait()
        return HttpAnswer(200, b"{}")


async def test_body_is_not_read_past_the_uid_share(sockdir: str) -> None:
    # One uid alone may hold max_inflight_bytes // 2 = one 4 KiB body. While the first
    # request holds it (its app call is gated), a second connection of the same uid gets no
    # "100 Continue" and nothing of its body is read; once the first is answered, it does.
    path = os.path.join(sockdir, "b.sock")
    app = GateApp()
    async with trio.open_nursery() as nursery:
        control = await start(nursery, app, path, max_body_bytes=4096, max_inflight_bytes=8192)
        first, first_reader = await connect(path)
        await first.send_all(req(b"a" * 4096))
        await wait_until(lambda: app.seen == 1)
        assert control.budget.held(os.getuid()) == 4096
        second, second_reader = await connect(path)
        await second.send_all(req(b"", length=4096, headers="Expect: 100-continue\r\n"))
        with trio.move_on_after(0.3) as waited:
            await second_reader.next()
        assert waited.cancelled_caught, "the second body was invited past the uid's share"
        app.gate.set()
        answer = await first_reader.next()
        assert answer is not None and answer[0] == 200
        cont = await second_reader.next()
        assert cont is not None and cont[0] == 100
        await second.send_all(b"b" * 4096)
        answer = await second_reader.next()
        assert answer is not None and answer[0] == 200
        await wait_until(lambda: control.budget.used == 0)
        control.stop()


async def test_a_body_read_asks_for_no_more_than_the_body_still_to_come(sockdir: str) -> None:
    """Pipelined requests behind a body are not read with it: a read of a reserved body
    asked the kernel for 64 KiB whatever was left of it, and the surplus (the next
    requests' heads and bodies) sat in h11's buffer outside every share, some 64 KiB a
    connection. What is buffered past the body is now at most one head read's size."""
    import gc

    from daemon.http import HEAD_RECEIVE_SIZE, _Connection

    path = os.path.join(sockdir, "b.sock")
    app = GateApp()
    async with trio.open_nursery() as nursery:
        control = await start(nursery, app, path, max_body_bytes=1024)
        stream, reader = await connect(path)
        first = req(b"x")
        await stream.send_all(first[:-1])  # the head alone: its read reserves the body
        await wait_until(lambda: control.budget.used == 1)
        await stream.send_all(first[-1:] + req(b"y" * 1000) * 60)  # ~64 KiB behind it
        await wait_until(lambda: app.seen == 1)
        connection = next(o for o in gc.get_objects() if isinstance(o, _Connection))
        assert len(connection.h11.trailing_data[0]) <= HEAD_RECEIVE_SIZE
        assert control.budget.used == 1
        app.gate.set()
        for _ in range(61):
            answer = await reader.next()
            assert answer is not None and answer[0] == 200
        control.stop()


async def test_connections_past_the_uid_cap_get_503_and_close(sockdir: str) -> None:
    path = os.path.join(sockdir, "b.sock")
    async with trio.open_nursery() as nursery:
        control = await start(nursery, EchoApp(), path, max_connections_per_uid=2)
        held = [await connect(path) for _ in range(2)]
        await wait_until(lambda: control.connections == 2)
        _extra, extra_reader = await connect(path)
        answer = await extra_reader.next()
        assert answer is not None and answer[0] == 503 and answer[1]["connection"] == "close"
        assert await extra_reader.eof()
        # The held ones still work; once one closes, the uid may connect again.
        await held[0][0].send_all(req(b"{}"))
        assert (await held[0][1].next()) is not None
        await held[1][0].aclose()
        await wait_until(lambda: control.connections == 1)
        again, again_reader = await connect(path)
        await again.send_all(req(b"{}"))
        answer = await again_reader.next()
        assert answer is not None and answer[0] == 200
        control.stop()


def test_inflight_budget_must_hold_one_body() -> None:
    with pytest.raises(ValueError):
        HttpLimits(max_body_bytes=4096, max_inflight_bytes=4095)
    with pytest.raises(ValueError):
        HttpLimits(max_connections_per_uid=0)


class Tagged:
    """A handler that answers with its own tag, so a test sees which route was taken."""

    def __init__(self, tag: bytes, seen: list[bytes]) -> None:
        self.tag, self.seen = tag, seen

    async def __call__(self, request: HttpRequest) -> HttpAnswer:
        self.seen.append(self.tag)
        return HttpAnswer(200, self.tag, "text/plain")


@pytest.mark.parametrize(
    ("method", "target", "status", "allow", "body"),
    [
        ("GET", "/a", 200, None, b"get-a"),
        ("POST", "/a", 200, None, b"post-a"),
        ("POST", "/b", 200, None, b"post-b"),
        ("PUT", "/a", 405, "GET, POST", b""),
        ("GET", "/b", 405, "POST", b""),
        ("GET", "/a?x=1", 404, None, b""),  # exact targets unless the table ignores queries
        ("GET", "/c", 404, None, b""),
    ],
)
async def test_route_table_dispatch(
    sockdir: str, method: str, target: str, status: int, allow: str | None, body: bytes
) -> None:
    seen: list[bytes] = []
    routes = Routes({(b"GET", b"/a"): Tagged(b"get-a", seen), (b"POST", b"/a"): Tagged(b"post-a", seen),
                     (b"POST", b"/b"): Tagged(b"post-b", seen)})
    path = os.path.join(sockdir, "b.sock")
    async with trio.open_nursery() as nursery:
        control = await nursery.start(serve, routes, path, HttpLimits())
        stream, reader = await connect(path)
        await stream.send_all(req(b"", method=method, target=target))
        answer = await reader.next()
        assert answer is not None
        assert (answer[0], answer[1].get("allow"), answer[2]) == (status, allow, body)
        assert seen == ([body] if status == 200 else [])
        control.stop()


async def test_keep_alive_off_answers_one_request_per_connection(sockdir: str) -> None:
    app = EchoApp()
    async with served(app, sockdir, keep_alive=False) as (control, stream, reader):
        await stream.send_all(req(b'"one"') + req(b'"two"'))
        answer = await reader.next()
        assert answer is not None and answer[2] == b'"one"'
        assert answer[1]["connection"] == "close"
        assert await reader.eof()
        assert len(app.seen) == 1


async def test_tcp_peer_uid_is_the_kernels_and_pid_unknown() -> None:
    # SO_PEERCRED names a process only on a Unix socket (Linux reports a made-up uid -1 /
    # pid 0 on TCP): the uid comes from the kernel's socket table (daemon/tcp_peer.py), the
    # pid stays unknown.
    app = EchoApp()
    tcp = bind_tcp_socket("127.0.0.1", 0)
    host, port = tcp.getsockname()
    async with trio.open_nursery() as nursery:
        control = await nursery.start(serve, action_routes(app), tcp, HttpLimits())
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(req(b'"tcp"').replace(b"Host: broker", f"Host: 127.0.0.1:{port}".encode()))
        answer = await Reader(stream).next()
        assert answer is not None and answer[2] == b'"tcp"'
        assert (app.seen[0].peer_uid, app.seen[0].peer_pid) == (os.getuid(), None)
        assert app.seen[0].over_tcp
        control.stop()


async def test_a_head_of_exactly_max_header_bytes_is_served(sockdir: str) -> None:
    """The bound is "beyond max_header_bytes, 431": a head of exactly that size, measured
    as sent, is served (an off-by-one would turn it away)."""
    limit = 4096
    base = req(b"{}", headers="X-Pad: \r\n")
    head_len = base.index(b"\r\n\r\n") + 4
    pad = "v" * (limit - head_len)
    data = req(b"{}", headers=f"X-Pad: {pad}\r\n")
    assert data.index(b"\r\n\r\n") + 4 == limit
    async with served(EchoApp(), sockdir, max_header_bytes=limit) as (control, stream, reader):
        await stream.send_all(data)
        answer = await reader.next()
        assert answer is not None and answer[0] == 200, answer
    # One byte more is refused.
    async with served(EchoApp(), sockdir, max_header_bytes=limit - 1) as (control, stream, reader):
        await stream.send_all(data)
        answer = await reader.next()
        assert answer is not None and answer[0] == 431


async def test_a_credential_left_on_a_kept_alive_connection_is_no_longer_counted(
    sockdir: str,
) -> None:
    """A connection that moves to another credential stops counting under the first: else
    every switch leaks one count (the first credential is locked out at its cap, and the
    table grows by a key per credential a client cares to send)."""
    path = os.path.join(sockdir, "b.sock")
    async with trio.open_nursery() as nursery:
        control = await start(nursery, EchoApp(), path, max_connections_per_credential=1)
        first, first_reader = await connect(path)
        await first.send_all(req(b"{}", headers="Authorization: Bearer A\r\n"))
        assert (await first_reader.next() or (0,))[0] == 200
        await first.send_all(req(b"{}", headers="Authorization: Bearer B\r\n"))
        assert (await first_reader.next() or (0,))[0] == 200
        # `first` is open and counted under B only: A's one slot is free.
        second, second_reader = await connect(path)
        await second.send_all(req(b"{}", headers="Authorization: Bearer A\r\n"))
        answer = await second_reader.next()
        assert answer is not None and answer[0] == 200, answer
        await first.aclose()
        await second.aclose()
        await wait_until(lambda: control.connections == 0)
        assert control.per_credential is not None and control.per_credential._open == {}
        control.stop()


async def test_a_chunked_body_reserves_max_body_bytes_of_the_uid_share(sockdir: str) -> None:
    """A chunked body has no declared length, so it reserves max_body_bytes before one
    byte of it is read (module docstring): else chunked bodies are read outside every
    share, and max_inflight_bytes bounds nothing."""
    path = os.path.join(sockdir, "b.sock")
    app = GateApp()
    async with trio.open_nursery() as nursery:
        control = await start(nursery, app, path, max_body_bytes=4096, max_inflight_bytes=8192)
        stream, reader = await connect(path)
        await stream.send_all(b"POST /v1/action HTTP/1.1\r\nHost: b\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        await wait_until(lambda: app.seen == 1)
        assert control.budget.held(os.getuid()) == 4096
        # And while it holds the share, a second body of the uid is not invited.
        other, other_reader = await connect(path)
        await other.send_all(req(b"", length=4096, headers="Expect: 100-continue\r\n"))
        with trio.move_on_after(0.3) as waited:
            await other_reader.next()
        assert waited.cancelled_caught, "a body was invited past the uid's share"
        app.gate.set()
        answer = await reader.next()
        assert answer is not None and answer[0] == 200
        control.stop()


async def test_each_body_read_asks_only_for_what_is_left_of_the_body(sockdir: str) -> None:
    """Not only the first read of a body: once part of it has arrived, a read asks for the
    rest and no more, so requests pipelined behind a large body stay in the kernel."""
    path = os.path.join(sockdir, "b.sock")
    app = GateApp()
    size = 32768
    async with trio.open_nursery() as nursery:
        control = await start(nursery, app, path, max_body_bytes=65536)
        stream, reader = await connect(path)
        first = req(b"x" * size)
        head = first[: len(first) - size]
        await stream.send_all(head)
        await wait_until(lambda: control.budget.used == size)
        connection = next(o for o in gc.get_objects() if isinstance(o, _Connection))
        await stream.send_all(b"x" * (size // 2))
        await wait_until(lambda: connection.unread == size // 2)
        await stream.send_all(b"x" * (size // 2) + req(b"y" * 1000) * 40)
        await wait_until(lambda: app.seen == 1)
        assert len(connection.h11.trailing_data[0]) <= HEAD_RECEIVE_SIZE
        app.gate.set()
        for _ in range(41):
            answer = await reader.next()
            assert answer is not None and answer[0] == 200
        control.stop()


@pytest.mark.parametrize(("method", "target", "status"),
                         [("POST", "/other", 404), ("PUT", "/v1/action", 405)])
async def test_a_refused_request_with_a_body_closes_the_connection(
    sockdir: str, caplog: pytest.LogCaptureFixture, method: str, target: str, status: int,
) -> None:
    """Routing refuses a request that carries a body without reading it, so the
    connection cannot go on (the rest of the body would be taken for the next request):
    the refusal says ``Connection: close`` and the connection ends, with no fault logged."""
    app = EchoApp()
    caplog.set_level(logging.DEBUG, logger="buzz_broker")
    async with served(app, sockdir) as (control, stream, reader):
        await stream.send_all(req(b'{"a": 1}', method=method, target=target))
        answer = await reader.next()
        assert answer is not None and answer[0] == status and answer[2] == b""
        assert answer[1].get("connection") == "close"
        assert await reader.eof()
    assert "connection_fault" not in caplog.text
    assert app.seen == []


def test_unlink_if_ours_leaves_another_daemons_socket(sockdir: str) -> None:
    """A socket file replaced by a newer daemon (a restart racing our exit) stays: only
    the inode we bound is removed."""
    path = os.path.join(sockdir, "b.sock")
    ours = bind_unix_socket(path)
    inode = os.stat(path).st_ino
    os.unlink(path)  # ours stays open (its inode too) while the newer daemon binds
    theirs = bind_unix_socket(path)
    try:
        assert os.stat(path).st_ino != inode
        unlink_if_ours(path, inode)
        assert os.path.exists(path), "the newer daemon's socket was removed"
        unlink_if_ours(path, os.stat(path).st_ino)
        assert not os.path.exists(path)
    finally:
        theirs.close()
        ours.close()


def test_limits_refuse_a_negative_body_or_an_empty_head_bound() -> None:
    with pytest.raises(ValueError):
        HttpLimits(max_body_bytes=-1)
    with pytest.raises(ValueError):
        HttpLimits(max_header_bytes=0)
