"""Faults inside one connection stay inside it (issue 13 item 1, the HTTP layer).

Invariants:
- A 5,000-digit ``Content-Length`` is answered 400 and the daemon goes on serving (h11 0.14
  raised ValueError from inside its parser for it, which ended `serve`; the pin is >= 0.16).
- An exception injected at the HTTP/application boundary - the application raising, the
  application handing back an answer that cannot be written, h11 itself raising on a
  request - ends (at most) that one connection: a bodiless 500 where a request was read and
  no response begun, else a closed connection. `serve` keeps running and the next client,
  served by the real pipeline (token, ledger, relay), gets its envelope.
- Repeating the same fault many times writes one log line for its cause, not one per
  attempt (logs are a disk a client could fill), and no traceback.
- A client that never reads its answer holds its connection only until the write
  deadline (``request_timeout``): the connection is closed and its slot freed for the
  next client.

The real `Broker` (the `broker` fixture: SoftHSM token, LocalRelay) answers every request
that is not the injected one; the injection wraps it, so the fault sits exactly at the
boundary between `daemon.http` and the application.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import h11
import pytest
import trio

from daemon.http import HttpAnswer, HttpLimits, HttpRequest, action_routes, serve
from daemon.log import setup_logging
from tests.fixtures.broker import BrokerHarness, raw_post, request_body

#: The body marker that makes `FaultyApp` misbehave; every other request goes to the broker.
CHANNEL = "0b6f6a1e-0000-4000-8000-00000000000b"
MARKER = b'"slug":"mem/inject"'
#: Times each fault is repeated: the log must still say it once.
REPEATS = 20
#: An answer far larger than a Unix socket's buffers take in (a few hundred KiB), so its
#: write waits on a client that does not read.
LARGE_ANSWER = 16 * 1024 * 1024
#: Only a bound for a failing test: the write deadline under test is 1 s.
DEADLINE = 20.0


class FaultyApp:
    """The real broker, except for requests carrying `MARKER`: those get the fault `mode`."""

    def __init__(self, inner: object, mode: str) -> None:
        self.inner = inner
        self.mode = mode

    async def handle(self, request: HttpRequest) -> HttpAnswer:
        if MARKER in request.body:
            if self.mode == "app_raises":
                raise RuntimeError("injected fault")
            if self.mode == "answer_unwritable":
                # A content type that is not ASCII cannot become a header: the write fails.
                return HttpAnswer(200, b"{}", content_type="application/jsön")
            if self.mode == "large_answer":
                return HttpAnswer(200, b'{"pad":"' + b"x" * LARGE_ANSWER + b'"}')
        answer: HttpAnswer = await self.inner.handle(request)  # type: ignore[attr-defined]
        return answer


@pytest.fixture
def captured_log() -> Iterator[io.StringIO]:
    out = io.StringIO()
    setup_logging("info", stream=out)
    yield out
    setup_logging("info")
    logging.getLogger("buzz_broker").handlers.clear()


async def _raw_exchange(socket: Path, data: bytes) -> tuple[int, bytes]:
    """Send raw bytes; return (status, body) of the answer, or (0, b"") if closed unanswered."""
    stream = await trio.open_unix_socket(str(socket))
    async with stream:
        await stream.send_all(data)
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="POST", target="/v1/action", headers=[("Host", "b")]))
        status, body = 0, b""
        with trio.fail_after(10):
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError:
                    return status, body
                if event is h11.NEED_DATA:
                    try:
                        conn.receive_data(await stream.receive_some(65536))
                    except trio.BrokenResourceError:
                        return status, body
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return status, body


async def _served(broker: BrokerHarness, socket: Path, credential: str) -> None:
    """The next client gets a real envelope from the real pipeline."""
    status, raw = await raw_post(socket, request_body("storage.address", {"slug": "core"}),
                                 credential)
    assert status == 200, status
    envelope = json.loads(raw)
    assert envelope["status"] == "succeeded", envelope


async def test_five_thousand_digit_content_length_is_400_and_serving_goes_on(
    broker: BrokerHarness, captured_log: io.StringIO
) -> None:
    agent = await broker.human_owned_agent()
    credential = broker.credential(agent, [CHANNEL])
    head = (b"POST /v1/action HTTP/1.1\r\nHost: b\r\nContent-Length: " + b"9" * 5000
            + b"\r\n\r\n")
    for _ in range(3):
        status, _body = await _raw_exchange(broker.socket, head)
        assert status == 400
    await _served(broker, broker.socket, credential)
    assert "Traceback" not in captured_log.getvalue()


@pytest.mark.parametrize(
    ("mode", "expected_status", "event", "exception"),
    [
        # The application raised: the transport's last resort, a bodiless 500.
        ("app_raises", 500, "application_error", "RuntimeError"),
        # The application's answer cannot be written: 500 (no response was begun), closed.
        ("answer_unwritable", 500, "connection_fault", "UnicodeEncodeError"),
        # h11 raised something other than its protocol error: nothing to answer, closed.
        ("h11_raises", 0, "connection_fault", "ValueError"),
    ],
)
async def test_injected_fault_ends_one_connection_and_the_next_client_is_served(
    broker: BrokerHarness, captured_log: io.StringIO, monkeypatch: pytest.MonkeyPatch,
    mode: str, expected_status: int, event: str, exception: str,
) -> None:
    agent = await broker.human_owned_agent()
    credential = broker.credential(agent, [CHANNEL])
    socket = broker.socket.with_name("faulty.sock")
    injected = request_body("storage.address", {"slug": "mem/inject"})
    if mode == "h11_raises":
        real_next_event = h11.Connection.next_event

        def next_event(self: h11.Connection) -> object:
            # What h11 0.14 did for a huge Content-Length: a bare ValueError from the parser.
            if MARKER in bytes(self._receive_buffer):  # type: ignore[attr-defined]
                raise ValueError("injected parser fault")
            return real_next_event(self)

        monkeypatch.setattr(h11.Connection, "next_event", next_event)
    async with trio.open_nursery() as nursery:
        control = await nursery.start(
            serve, action_routes(FaultyApp(broker.app, mode)), str(socket),
            HttpLimits(request_timeout=10.0, shutdown_grace=2.0))
        for _ in range(REPEATS):
            status, _body = await _raw_exchange(socket, _request_bytes(injected, credential))
            assert status == expected_status
            assert _body == b""
            await _served(broker, socket, credential)
        assert control.connections <= 1  # every faulted connection was closed
        control.stop()
    lines = [json.loads(line) for line in captured_log.getvalue().splitlines()]
    faults = [line for line in lines if line.get("event") == event]
    # Once per cause, whatever the rate: REPEATS faults, one line.
    assert len(faults) == 1, faults
    assert faults[0]["exception"] == exception
    assert "Traceback" not in captured_log.getvalue()
    assert credential not in captured_log.getvalue()


async def test_a_client_that_never_reads_its_answer_loses_the_connection_at_the_deadline(
    broker: BrokerHarness, captured_log: io.StringIO,
) -> None:
    # One connection slot (max_connections = 1), held by a client that sends a request
    # whose answer is 16 MiB and never reads: the write deadline (request_timeout, 1 s)
    # closes that connection and frees the slot, and the next client, waiting in the
    # listen backlog meanwhile, is served. The stalled client then finds the part of its
    # answer the socket buffers held, and the end of the stream.
    agent = await broker.human_owned_agent()
    credential = broker.credential(agent, [CHANNEL])
    socket = broker.socket.with_name("stalled.sock")
    injected = request_body("storage.address", {"slug": "mem/inject"})
    async with trio.open_nursery() as nursery:
        control = await nursery.start(
            serve, action_routes(FaultyApp(broker.app, "large_answer")), str(socket),
            HttpLimits(request_timeout=1.0, shutdown_grace=2.0, max_connections=1))
        stalled = await trio.open_unix_socket(str(socket))
        async with stalled:
            await stalled.send_all(_request_bytes(injected, credential))
            with trio.fail_after(DEADLINE):
                await _served(broker, socket, credential)
            received = 0
            with trio.fail_after(DEADLINE):
                try:
                    while chunk := await stalled.receive_some(1 << 20):
                        received += len(chunk)
                except trio.BrokenResourceError:
                    pass
        assert 0 < received < LARGE_ANSWER
        control.stop()
    assert "Traceback" not in captured_log.getvalue()


def _request_bytes(body: bytes, credential: str) -> bytes:
    return (b"POST /v1/action HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {credential}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
