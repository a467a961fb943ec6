"""A relay that stops reading: every write to it is held to the timeout of its answer.

The relay here sits at the far end of a lockstep stream (`trio.testing.lockstep_stream_pair`:
a write returns only once the other end has read all of it), in place of the TCP socket
the pool opens. Once it stops reading, every byte we write waits forever, as on a socket
whose buffers a relay that accepted and stopped reading has filled. Time is the autojump
clock's: "within the timeout" is asserted on virtual time, exactly, and a request that
hangs fails its test at `HANG` (virtual) seconds instead of hanging it.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from daemon.relay.pool import (
    Accepted,
    NotSent,
    Rejected,
    RelayPool,
    RelayTimeouts,
    RelayUnavailable,
    Unknown,
)
from tests.fixtures.relay import TestKey, auth_signer_for, signed

#: ok and eose differ, so that each request is seen to end at its own timeout.
TIMEOUTS = RelayTimeouts(connect=5, ok=3, eose=7, idle_seconds=600)
#: Virtual seconds after which a request has hung.
HANG = 60
REFUSAL = "auth-required: we need to know who you are"


class _DeafRelay:
    """The relay behind every connection the pool opens. The first connection answers the
    first EVENT (OK true, or ``auth-required:`` with a challenge when `refuse_first`) and
    then never reads again; later connections answer everything (OK true, EOSE)."""

    def __init__(self, nursery: trio.Nursery, *, refuse_first: bool = False) -> None:
        self._nursery = nursery
        self._refuse_first = refuse_first
        self.connections = 0
        #: The verbs the relay read, every connection together.
        self.read: list[str] = []

    async def open_stream(self) -> trio.abc.Stream:
        """Stands in for `RelayPool._open_stream`: our end of a fresh lockstep pair."""
        ours, theirs = trio.testing.lockstep_stream_pair()
        self.connections += 1
        self._nursery.start_soon(self._serve, theirs, self.connections == 1)
        return ours

    async def _serve(self, stream: trio.abc.Stream, deaf: bool) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        text = ""
        while data := await stream.receive_some(65536):
            ws.receive_data(bytes(data))
            for event in ws.events():
                if isinstance(event, Request):
                    await stream.send_all(ws.send(AcceptConnection()))
                elif isinstance(event, TextMessage):
                    text += event.data
                    if not event.message_finished:
                        continue
                    message, text = json.loads(text), ""
                    self.read.append(message[0])
                    answer = b""
                    if message[0] == "EVENT" and deaf and self._refuse_first:
                        answer = ws.send(TextMessage(data='["AUTH", "challenge-1"]'))
                        answer += ws.send(TextMessage(
                            data=json.dumps(["OK", message[1]["id"], False, REFUSAL])))
                    elif message[0] == "EVENT":
                        answer = ws.send(TextMessage(
                            data=json.dumps(["OK", message[1]["id"], True, ""])))
                    elif message[0] == "REQ":
                        answer = ws.send(TextMessage(data=json.dumps(["EOSE", message[1]])))
                    if answer:
                        await stream.send_all(answer)
                    if message[0] == "EVENT" and deaf:
                        await trio.sleep_forever()


async def _pool(nursery: trio.Nursery, relay: _DeafRelay, key: TestKey,
                monkeypatch: pytest.MonkeyPatch) -> RelayPool:
    pool = RelayPool("ws://127.0.0.1:7777", auth_signer_for(key), timeouts=TIMEOUTS)
    monkeypatch.setattr(pool, "_open_stream", relay.open_stream)
    await nursery.start(pool.run)
    return pool


async def _deafened(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
                    ) -> tuple[TestKey, _DeafRelay, RelayPool]:
    """A pool whose relay has answered one EVENT and reads nothing more."""
    key = TestKey()
    relay = _DeafRelay(nursery)
    pool = await _pool(nursery, relay, key, monkeypatch)
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "first"))), Accepted)
    return key, relay, pool


async def test_a_relay_that_stops_reading_holds_no_request_past_its_timeout(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the EVENT written after the relay stopped reading waited forever, and so did
    # every EVENT and REQ queued behind it on the connection: nothing answered, and the
    # connection, never unused, was never closed either.
    key, relay, pool = await _deafened(nursery, monkeypatch)
    results: dict[str, object] = {}

    async def publish(text: str) -> None:
        results[text] = await pool.publish(key.pubkey, signed(key.sign(1, text * 1000)))

    async def query() -> None:
        with pytest.raises(RelayUnavailable) as info:
            await pool.query(key.pubkey, [{"kinds": [1]}])
        results["query"] = info.value.reason

    start = trio.current_time()
    with trio.fail_after(HANG):
        async with trio.open_nursery() as requests:
            # The first EVENT is being written (and never will be whole); the rest queue
            # behind it on the same connection, a second later: their own timeouts end
            # after its, so that what ends them is the connection closing.
            requests.start_soon(publish, "stuck")
            await trio.sleep(1)
            for text in ("w1", "w2"):
                requests.start_soon(publish, text)
            requests.start_soon(query)
    assert trio.current_time() - start == pytest.approx(TIMEOUTS.ok)
    # The EVENT partly written may have reached the relay; the others never left, and the
    # cut-off frame closed the connection under them.
    assert results.pop("stuck") == Unknown(reason=f"EVENT not written within {TIMEOUTS.ok}s: "
                                                   "connection closed")
    assert results == {"w1": NotSent(reason="connection closed before sending"),
                       "w2": NotSent(reason="connection closed before sending"),
                       "query": "connection closed before sending REQ"}
    # The next request gets a new connection, which works.
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "later"))), Accepted)
    assert relay.connections == 2
    assert relay.read == ["EVENT", "EVENT"]


async def test_a_req_that_cannot_be_written_is_unavailable_at_the_eose_timeout(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    key, relay, pool = await _deafened(nursery, monkeypatch)
    start = trio.current_time()
    with trio.fail_after(HANG), pytest.raises(RelayUnavailable) as info:
        await pool.query(key.pubkey, [{"kinds": [1]}])
    assert trio.current_time() - start == pytest.approx(TIMEOUTS.eose)
    assert info.value.reason == f"REQ not written within {TIMEOUTS.eose}s: connection closed"
    assert await pool.query(key.pubkey, [{"kinds": [1]}]) == []
    assert relay.connections == 2


async def test_an_auth_that_cannot_be_written_fails_as_an_unanswered_auth(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The relay refuses the EVENT with auth-required, challenges, and stops reading: our
    # AUTH cannot be written. Answered as any AUTH that did not succeed after a refusal
    # (the relay's refusal, with why), at the OK timeout, and the connection is closed.
    key = TestKey()
    relay = _DeafRelay(nursery, refuse_first=True)
    pool = await _pool(nursery, relay, key, monkeypatch)
    start = trio.current_time()
    with trio.fail_after(HANG):
        result = await pool.publish(key.pubkey, signed(key.sign(1, "x")))
    assert trio.current_time() - start == pytest.approx(TIMEOUTS.ok)
    assert result == Rejected(reason=f"{REFUSAL} (AUTH not written within {TIMEOUTS.ok}s: "
                                     "connection closed)")
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "y"))), Accepted)
    assert relay.connections == 2
