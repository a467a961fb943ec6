"""A relay whose reply to the WebSocket upgrade is malformed: a failed connect like any other.

trio-websocket meets such a reply with h11's (or wsproto's) LocalProtocolError, raised in
its reader task and so wrapped in the ExceptionGroup of the connection's nursery. It used to leave
`publish` and `query` as that raw group: no backoff, every request connecting again at
once, and through the daemon a post that never left answered as indeterminate.
"""

from __future__ import annotations

import pytest
import trio

from daemon.relay.pool import NotSent, RelayPool, RelayTimeouts, RelayUnavailable
from tests.fixtures.relay import TestKey, auth_signer_for, free_port, signed

_UPGRADE = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
REPLIES = {
    "wrong accept key": _UPGRADE + b"Sec-WebSocket-Accept: AAAA\r\n\r\n",
    "not http": b"\x00\x01garbage\r\n\r\n",
    "oversized head": _UPGRADE + b"X-Filler: " + b"a" * 200_000 + b"\r\n\r\n",
    "refusal with a broken body":
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\n\r\n",
}
#: A backoff far longer than the connect timeout: once a connect failed, the next request
#: is answered without trying (module docstring, "Reconnection").
TIMEOUTS = RelayTimeouts(connect=2, ok=1, eose=1, backoff_initial=60, backoff_max=60)


@pytest.mark.parametrize("reply", REPLIES.values(), ids=REPLIES.keys())
async def test_a_malformed_upgrade_reply_is_a_failed_connect(
        reply: bytes, nursery: trio.Nursery) -> None:
    accepted = 0

    async def relay(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(4096)
        try:
            await stream.send_all(reply)
        except trio.BrokenResourceError:
            return  # we hung up inside an oversized head: as we should
        await trio.sleep_forever()

    port = free_port()
    await nursery.start(trio.serve_tcp, relay, port)
    key = TestKey()
    pool = RelayPool(f"ws://127.0.0.1:{port}", auth_signer_for(key), timeouts=TIMEOUTS)
    await nursery.start(pool.run)

    result = await pool.publish(key.pubkey, signed(key.sign(1, "x")))
    assert isinstance(result, NotSent)
    assert result.reason.startswith("cannot connect: malformed WebSocket handshake reply")
    # The failure started the backoff: the next requests do not connect again.
    later = await pool.publish(key.pubkey, signed(key.sign(1, "y")))
    assert isinstance(later, NotSent) and "next attempt in" in later.reason
    with pytest.raises(RelayUnavailable, match="next attempt in"):
        await pool.query(key.pubkey, [{"kinds": [1]}])
    assert accepted == 1
