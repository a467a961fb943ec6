"""The fleet client's connection pool (tests/fleet/buzz_agent.py `Transport`).

A host closes a keep-alive connection it has kept idle past its deadline (daemon/http.py,
`request_timeout`). An HTTP client's pool checks an idle connection before reusing it
(urllib3's `is_connection_dropped`, hyper's readiness poll), so Buzz's runtime does not
send a request down a connection its host already closed. The fleet's client must not
either: it did, and about one post in a few thousand came back "no answer" in the
benchmark, charged to the host.
"""

from __future__ import annotations

import h11
import trio

from tests.fixtures.relay import free_port
from tests.fleet.buzz_agent import Transport, parse_endpoint


async def _answer_once_then_hang_up(stream: trio.SocketStream) -> None:
    """One keep-alive answer, then close, as a host does to a connection idle too long."""
    conn = h11.Connection(h11.SERVER)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.EndOfMessage):
            break
    body = b'{"ok":true}'
    await stream.send_all(
        conn.send(h11.Response(status_code=200, headers=[("Content-Length", str(len(body)))]))
        + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    await stream.aclose()


async def test_an_idle_connection_the_host_closed_is_not_reused(nursery: trio.Nursery) -> None:
    port = free_port()
    listeners = await nursery.start(trio.serve_tcp, _answer_once_then_hang_up, port)
    assert listeners
    transport = Transport(parse_endpoint(f"http://127.0.0.1:{port}"), "credential")
    try:
        assert await transport.post(b"{}", 1024) == b'{"ok":true}'
        await trio.sleep(0.2)  # the host's FIN reaches us while the connection sits idle
        assert await transport.post(b"{}", 1024) == b'{"ok":true}'
    finally:
        await transport.aclose()
