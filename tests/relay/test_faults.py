"""RelayPool against the scripted relay: every fault maps as the spec says, within its timeout.

Each test runs under a generous wall-clock ceiling (`bounded`), far above the short
timeouts it configures but far below what a hang would cost: "does not wait past its
timeout" is asserted, tight latency never is.
"""

from __future__ import annotations

import collections
import json
import logging
import time
import types
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from buzzwire.nostr import SignedEvent
from daemon.operations._base import OperationRefused
from daemon.operations._events import check_builds_on_latest
from daemon.relay.gate import AuthGate
from daemon.relay.pool import (
    MAX_QUERY_BYTES,
    Accepted,
    AuthNotSigned,
    NotSent,
    Rejected,
    RelayPool,
    RelayRefused,
    RelayTimeouts,
    RelayUnavailable,
    Unknown,
)
from daemon.relay.protocol import MAX_REASON_CHARS
from tests.fixtures.relay import TestKey, auth_signer_for, signed, free_port
from tests.relay._support import HeldSigner
from daemon.state.sign_watermarks import SignWatermarks
from tests.scripted_relay import EventReply, ReqReply, Script, ScriptedRelay

Start = Callable[[Script], Awaitable[ScriptedRelay]]

SHORT = RelayTimeouts(connect=1.0, ok=0.5, eose=0.5, idle_seconds=30, backoff_initial=0.05, backoff_max=0.2)
#: A fault test finishing later than this has waited past its timeouts.
CEILING = 4.0


class bounded:
    """Fail the test if the block takes longer than CEILING seconds of real time."""

    def __enter__(self) -> None:
        self.start = trio.current_time()

    def __exit__(self, *exc: object) -> None:
        assert trio.current_time() - self.start < CEILING


async def _pool(nursery: trio.Nursery, url: str, *keys: TestKey, timeouts: RelayTimeouts = SHORT) -> RelayPool:
    pool = RelayPool(url, auth_signer_for(*keys), timeouts=timeouts)
    await nursery.start(pool.run)
    return pool


async def _scripted(
    scripted_relay: Start, nursery: trio.Nursery, script: Script, *, timeouts: RelayTimeouts = SHORT
) -> tuple[ScriptedRelay, TestKey, RelayPool]:
    """A scripted relay playing `script`, one test key, and a running pool that signs AUTH for it."""
    relay = await scripted_relay(script)
    key = TestKey()
    return relay, key, await _pool(nursery, relay.url, key, timeouts=timeouts)


async def _assert_unreachable(nursery: trio.Nursery, url: str) -> None:
    """Nothing relay-like answers at `url`: a publish is NotSent and a query RelayUnavailable."""
    key = TestKey()
    pool = await _pool(nursery, url, key)
    with bounded():
        assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), NotSent)
        with pytest.raises(RelayUnavailable):
            await pool.query(key.pubkey, [{"kinds": [1]}])


def _verbs(relay: ScriptedRelay) -> list[str]:
    return [m[0] for m in relay.received]


async def _eventually(predicate: Callable[[], bool]) -> None:
    """Wait (bounded) for the relay task to have processed what we sent."""
    with trio.fail_after(CEILING):
        while not predicate():
            await trio.sleep(0.01)


async def test_ok_false_is_rejected_with_the_reason(scripted_relay: Start, nursery: trio.Nursery) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(events=(EventReply.REJECT,), reject_reason="blocked: go away"))
    with bounded():
        assert await pool.publish(key.pubkey, signed(key.sign(1, "x"))) == Rejected(reason="blocked: go away")


async def test_ok_true_and_duplicate_are_accepted(scripted_relay: Start, nursery: trio.Nursery) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script())
    ev = key.sign(1, "x")
    first, second = await pool.publish(key.pubkey, signed(ev)), await pool.publish(key.pubkey, signed(ev))
    assert isinstance(first, Accepted) and not first.duplicate
    assert isinstance(second, Accepted) and second.duplicate


async def test_no_ok_is_unknown_within_the_timeout(scripted_relay: Start, nursery: trio.Nursery) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(events=(EventReply.SILENT,)))
    with bounded():
        result = await pool.publish(key.pubkey, signed(key.sign(1, "x")))
    assert isinstance(result, Unknown)
    # The same connection still works afterwards.
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "y"))), Accepted)


async def test_drop_after_event_is_unknown_and_reconnects(scripted_relay: Start, nursery: trio.Nursery) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(events=(EventReply.DROP,)))
    ev = key.sign(1, "x")
    with bounded():
        assert isinstance(await pool.publish(key.pubkey, signed(ev)), Unknown)
    # The ledger's retry re-sends the same event on a fresh connection.
    assert await pool.publish(key.pubkey, signed(ev)) == Accepted(duplicate=False, message="")
    assert len(relay.connections) == 2


async def test_auth_required_on_event_authenticates_and_resends_once(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(require_auth=True))
    ev = key.sign(1, "x")
    with bounded():
        assert isinstance(await pool.publish(key.pubkey, signed(ev)), Accepted)
    assert _verbs(relay) == ["EVENT", "AUTH", "EVENT"]
    auth = relay.received[1][1]
    # NIP-42: the relay tag is the configured URL exactly as written.
    assert ["relay", relay.url] in auth["tags"] and auth["pubkey"] == key.pubkey


async def test_closed_auth_required_authenticates_and_retries_once(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(require_auth=True))
    stored = key.sign(1, "x")
    relay.stored[stored["id"]] = stored
    with bounded():
        assert await pool.query(key.pubkey, [{"kinds": [1]}]) == [stored]
    await _eventually(lambda: _verbs(relay) == ["REQ", "CLOSE", "AUTH", "REQ", "CLOSE"])
    # Every REQ is closed by us, also the one the relay CLOSED; ids are unique.
    reqs = [m[1] for m in relay.received if m[0] == "REQ"]
    closes = [m[1] for m in relay.received if m[0] == "CLOSE"]
    assert len(set(reqs)) == 2 and sorted(closes) == sorted(reqs)


async def test_auth_refused_is_a_refusal(scripted_relay: Start, nursery: trio.Nursery) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(require_auth=True, accept_auth=False))
    with bounded():
        with pytest.raises(RelayRefused):
            await pool.query(key.pubkey, [{"kinds": [1]}])
        # NIP-42: one AUTH per challenge. The refused one is spent, so that connection is
        # retired and the publish goes out on a new one, which brings its own challenge.
        result = await pool.publish(key.pubkey, signed(key.sign(1, "x")))
    assert isinstance(result, Rejected) and "AUTH refused" in result.reason
    assert len(relay.connections) == 2
    assert [[m[0] for m in c.received].count("AUTH") for c in relay.connections] == [1, 1]


async def test_auth_refused_after_event_refusal_is_rejected(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(require_auth=True, accept_auth=False))
    with bounded():
        result = await pool.publish(key.pubkey, signed(key.sign(1, "x")))
    assert isinstance(result, Rejected) and result.reason.startswith("auth-required:")


#: Fresh connections (agents) in the test below: whichever order the scheduler wakes
#: the requests waiting at the gate and the one whose AUTH was refused, each round.
REFUSED_ROUNDS = 12


async def test_nothing_waiting_behind_a_refused_auth_is_sent(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # The relay challenges at connect, needs AUTH for everything and refuses our AUTH. A
    # burst of publishes and queries waits at the gates (the AUTH held until all of them
    # are there); the AUTH is refused. The refusal opens no gate: the requests behind it
    # find the challenge spent and fail without sending (NotSent, RelayRefused), and the
    # relay receives nothing on that connection after the AUTH. (The probes may have left
    # before the challenge arrived: one EVENT and one REQ, refused auth-required.)
    relay = await scripted_relay(Script(challenge_at_connect=True, require_auth=True,
                                        accept_auth=False))
    keys = [TestKey() for _ in range(REFUSED_ROUNDS)]
    signers = {key.pubkey: HeldSigner(key) for key in keys}

    async def sign(agent: str, url: str, challenge: str, created_at: int) -> Any:
        return await signers[agent](agent, url, challenge, created_at)

    pool = RelayPool(relay.url, sign, timeouts=RelayTimeouts(connect=2, ok=2, eose=2))
    await nursery.start(pool.run)
    for key in keys:
        published: list[object] = []
        queried: list[object] = []

        async def publish(text: str) -> None:
            published.append(await pool.publish(key.pubkey, signed(key.sign(1, text))))

        async def query() -> None:
            try:
                queried.append(await pool.query(key.pubkey, [{"kinds": [1]}]))
            except (RelayRefused, RelayUnavailable) as exc:
                queried.append(exc)

        async with trio.open_nursery() as burst:
            for i in range(5):
                burst.start_soon(publish, f"m{i}")
                burst.start_soon(query)
            await trio.testing.wait_all_tasks_blocked()
            signers[key.pubkey].release.set()
        log = relay.connections[-1]
        verbs = [m[0] for m in log.received]
        assert verbs.count("AUTH") == 1 and log.authed == set()
        after = verbs[verbs.index("AUTH") + 1:]
        assert after == [], "sent after the refused AUTH as if authenticated"
        assert sum(isinstance(r, NotSent) for r in published) >= 4, published
        assert all(isinstance(r, (NotSent, Rejected)) for r in published), published
        assert all(isinstance(r, RelayRefused) for r in queried), queried
    assert len(relay.connections) == REFUSED_ROUNDS


async def test_a_refused_auth_opens_neither_gate() -> None:
    # The rule the test above shows through the scheduler, whichever task it wakes first:
    # the relay's OK false to our AUTH leaves both gates shut; its OK true opens both.
    from daemon.relay.pool import _Connection, _ResultBudget
    from daemon.relay.protocol import Ok

    pool = RelayPool("ws://127.0.0.1:1", auth_signer_for(TestKey()))
    conn = _Connection("a" * 64, _ResultBudget(1 << 30), pool._notices)
    conn.alive = True
    conn.auth_pending = "ab" * 32
    conn.dispatch(Ok(event_id="ab" * 32, accepted=False, message="restricted: not you"))
    assert not conn.write_gate.is_open and not conn.read_gate.is_open
    conn.auth_pending = "cd" * 32
    conn.dispatch(Ok(event_id="cd" * 32, accepted=True, message=""))
    assert conn.write_gate.is_open and conn.read_gate.is_open


async def test_wrong_relay_tag_is_refused_by_a_strict_relay(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # Buzz compares the relay tag with its own URL; a client writing another form fails.
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(require_auth=True, expected_relay_tag="wss://elsewhere"))
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), Rejected)


async def test_challenge_at_connect_is_answered_before_the_next_send(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # The relay challenges at connect but does not insist: the first EVENT may race the
    # challenge; once it has been seen, AUTH goes out before the next EVENT.
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(challenge_at_connect=True))
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), Accepted)
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "y"))), Accepted)
    assert _verbs(relay) in (["EVENT", "AUTH", "EVENT"], ["AUTH", "EVENT", "EVENT"])
    assert relay.connections[0].authed == {key.pubkey}


async def test_challenge_at_connect_with_auth_required(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(challenge_at_connect=True, require_auth=True))
    with bounded():
        assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), Accepted)
        assert await pool.query(key.pubkey, [{"kinds": [1]}]) != []
    assert _verbs(relay).count("AUTH") == 1


async def test_a_burst_after_a_challenge_at_connect_waits_for_one_auth(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # Buzz's way: the challenge comes at connect and everything needs AUTH. Of a burst on
    # the fresh connection at most one request goes out before the AUTH (the gate's
    # probe, if it left before the challenge arrived); the rest wait for its OK.
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(challenge_at_connect=True, require_auth=True))
    events = [key.sign(1, f"m{i}") for i in range(20)]
    results: list[object] = []

    async def one(ev: dict[str, Any]) -> None:
        results.append(await pool.publish(key.pubkey, signed(ev)))

    with bounded():
        async with trio.open_nursery() as inner:
            for ev in events:
                inner.start_soon(one, ev)
    assert len(results) == 20 and all(isinstance(r, Accepted) for r in results)
    verbs = _verbs(relay)
    assert verbs.count("AUTH") == 1 and verbs.index("AUTH") <= 1
    assert verbs.count("EVENT") == 20 + verbs.index("AUTH")


async def test_a_cancelled_probe_hands_the_gate_on(scripted_relay: Start, nursery: trio.Nursery) -> None:
    # The first publish on a fresh connection gets no OK and is cancelled while it waits
    # for one; the publishes waiting behind it go on (one probes next) long before their
    # own timeout. Cancelled once the relay has its EVENT and the waiters are queued, not
    # on a timer: a slow start must not move the cancellation into the connect or send.
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(events=(EventReply.SILENT,)),
                                       timeouts=RelayTimeouts(connect=1, ok=2, eose=2))
    results: list[object] = []
    probing = trio.CancelScope()

    async def probe() -> None:
        with probing:
            await pool.publish(key.pubkey, signed(key.sign(1, "silent")))

    async def waiter(i: int) -> None:
        results.append(await pool.publish(key.pubkey, signed(key.sign(1, f"w{i}"))))

    with bounded():
        async with trio.open_nursery() as inner:
            inner.start_soon(probe)
            await _eventually(lambda: _verbs(relay) == ["EVENT"])
            for i in range(5):
                inner.start_soon(waiter, i)
            await trio.testing.wait_all_tasks_blocked()
            probing.cancel()
    assert len(results) == 5 and all(isinstance(r, Accepted) for r in results)
    assert _verbs(relay) == ["EVENT"] * 6


async def test_waiting_at_the_gate_is_bounded_by_the_callers_timeout(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # The probe (a query) was CLOSED auth-required and waits for its AUTH to be signed
    # (the signer held until the end); a query behind it gives up after its own
    # eose=0.3 s, unavailable, having sent nothing.
    relay = await scripted_relay(Script(require_auth=True))
    key = TestKey()
    signer = HeldSigner(key)
    pool = RelayPool(relay.url, signer, timeouts=RelayTimeouts(connect=1, ok=2, eose=0.3))
    await nursery.start(pool.run)
    outcome: list[object] = []

    async def probe() -> None:
        outcome.append(await pool.query(key.pubkey, [{"kinds": [1]}]))

    with bounded():
        async with trio.open_nursery() as inner:
            inner.start_soon(probe)
            await _eventually(lambda: _verbs(relay) == ["REQ", "CLOSE"])
            with pytest.raises(RelayUnavailable):
                await pool.query(key.pubkey, [{"kinds": [1]}])
            assert _verbs(relay) == ["REQ", "CLOSE"]
            signer.release.set()
    assert outcome == [[]]


async def test_a_dropped_connection_wakes_everyone_at_the_gate(nursery: trio.Nursery) -> None:
    # A relay that takes the probe's EVENT, says nothing, and hangs up when told: the
    # probe is Unknown, and every request waiting behind it answers at once (long before
    # ok=eose=5 s), none of them sent.
    import trio_websocket

    received: list[str] = []
    hang_up = trio.Event()

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        received.append(str(await ws.get_message()))
        await hang_up.wait()
        await ws.aclose()

    port = free_port()
    await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", port, None)
    key = TestKey()
    pool = await _pool(nursery, f"ws://127.0.0.1:{port}", key, timeouts=RelayTimeouts(connect=1, ok=5, eose=5))
    results: dict[str, object] = {}

    async def publish(text: str) -> None:
        results[text] = await pool.publish(key.pubkey, signed(key.sign(1, text)))

    async def query() -> None:
        with pytest.raises(RelayUnavailable):
            await pool.query(key.pubkey, [{"kinds": [1]}])
        results["query"] = "unavailable"

    with bounded():
        async with trio.open_nursery() as inner:
            inner.start_soon(publish, "probe")
            await _eventually(lambda: len(received) == 1)
            for i in range(3):
                inner.start_soon(publish, f"w{i}")
            inner.start_soon(query)
            await trio.testing.wait_all_tasks_blocked()
            hang_up.set()
    assert isinstance(results.pop("probe"), Unknown)
    assert results == {**{f"w{i}": NotSent(reason="connection closed before sending") for i in range(3)},
                       "query": "unavailable"}
    assert len(received) == 1


async def test_restricted_is_refused(scripted_relay: Start, nursery: trio.Nursery) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(default_req=ReqReply.RESTRICTED))
    with bounded():
        with pytest.raises(RelayRefused) as info:
            await pool.query(key.pubkey, [{"kinds": [1]}])
    assert info.value.reason.startswith("restricted:")
    await _eventually(lambda: _verbs(relay) == ["REQ", "CLOSE"])


async def test_never_eose_times_out_and_closes(scripted_relay: Start, nursery: trio.Nursery) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(default_req=ReqReply.NEVER_EOSE))
    with bounded():
        with pytest.raises(RelayUnavailable):
            await pool.query(key.pubkey, [{"kinds": [1]}])
    await _eventually(lambda: _verbs(relay) == ["REQ", "CLOSE"])


async def test_relay_down_is_not_sent_and_unavailable(nursery: trio.Nursery) -> None:
    await _assert_unreachable(nursery, f"ws://127.0.0.1:{free_port()}")


async def test_reconnects_after_the_relay_comes_back(scripted_relay: Start, nursery: trio.Nursery) -> None:
    port = free_port()
    key = TestKey()
    pool = await _pool(nursery, f"ws://127.0.0.1:{port}", key)
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), NotSent)
    relay = ScriptedRelay(Script())
    await nursery.start(relay.serve, port)
    with bounded():
        # The backoff (<= 0.2 s here) is shorter than the connect timeout: we wait it out.
        assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "y"))), Accepted)


async def test_a_relay_back_waits_for_the_backoff_then_the_next_request_connects(
    nursery: trio.Nursery,
) -> None:
    """docs/reliability.md, "Relay away and back": the pool does not try a relay that came
    back before the backoff its last failed connect set has run out. Until the next attempt
    is within the connect timeout, a request is answered at once, "relay unreachable; next
    attempt in N s"; the next one waits for the attempt, which connects. So the first
    success comes `backoff_max` at most after the last failed connect (the daemon's: 30 s),
    not at the relay's return. Scaled down: a 3 s backoff, a 1 s connect timeout."""
    backoff, connect = 3.0, 1.0
    timeouts = RelayTimeouts(connect=connect, ok=1.0, eose=1.0, idle_seconds=30,
                             backoff_initial=backoff, backoff_max=backoff)
    port = free_port()
    key = TestKey()
    pool = await _pool(nursery, f"ws://127.0.0.1:{port}", key, timeouts=timeouts)
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "down"))), NotSent)
    failed_at = trio.current_time()
    relay = ScriptedRelay(Script())
    await nursery.start(relay.serve, port)  # back at once
    early = await pool.publish(key.pubkey, signed(key.sign(1, "early")))
    assert isinstance(early, NotSent) and "relay unreachable; next attempt in" in early.reason
    assert relay.connections == []  # not tried: the backoff holds it off
    refused = 1
    with trio.fail_after(backoff + CEILING):
        while True:
            result = await pool.publish(key.pubkey, signed(key.sign(1, "later")))
            if not isinstance(result, NotSent):
                break
            assert "next attempt in" in result.reason
            refused += 1
            await trio.sleep(0.1)
    assert isinstance(result, Accepted)
    took = trio.current_time() - failed_at
    # Not before the backoff ran out, and at most a scheduling margin after it.
    assert backoff - 0.1 <= took <= backoff + 1.0, took
    assert refused > 1  # answered at once until the attempt came within `connect`


async def test_concurrent_publishes_are_matched_by_event_id(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # Alternate accept/reject so a mismatched OK would show up as a wrong verdict.
    replies = tuple(EventReply.ACCEPT if i % 2 == 0 else EventReply.REJECT for i in range(20))
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(events=replies))
    events = [key.sign(1, f"m{i}") for i in range(20)]
    results: dict[str, Any] = {}

    async def one(ev: dict[str, Any]) -> None:
        results[ev["id"]] = await pool.publish(key.pubkey, signed(ev))

    async with trio.open_nursery() as inner:
        for ev in events:
            inner.start_soon(one, ev)
    accepted = {i for i, r in results.items() if isinstance(r, Accepted)}
    assert accepted == set(relay.stored)
    assert len(accepted) == 10 and len(relay.connections) == 1


async def test_idle_connections_are_closed(scripted_relay: Start, nursery: trio.Nursery) -> None:
    timeouts = RelayTimeouts(connect=1, ok=0.5, eose=0.5, idle_seconds=0.2)
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(), timeouts=timeouts)
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), Accepted)
    await trio.sleep(0.6)
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "y"))), Accepted)
    assert len(relay.connections) == 2


async def test_protocol_garbage_drops_the_connection_fast(nursery: trio.Nursery) -> None:
    import trio_websocket

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()
        await ws.send_message('["OK", "not-an-id", true, ""]')
        await trio.sleep(10)

    port = free_port()
    await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", port, None)
    key = TestKey()
    pool = await _pool(nursery, f"ws://127.0.0.1:{port}", key, timeouts=RelayTimeouts(ok=30))
    with bounded():
        result = await pool.publish(key.pubkey, signed(key.sign(1, "x")))
    assert isinstance(result, Unknown)


async def test_a_signer_that_cannot_sign_auth_is_not_sent(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # Custody refusing to sign AUTH arrives as AuthNotSigned, its own type (issue 16), and
    # is a failed AUTH like any other: nothing sent, the read unavailable, no crash.
    relay = await scripted_relay(Script(require_auth=True, challenge_at_connect=True))
    key = TestKey()

    async def refuses(agent: str, relay_url: str, challenge: str, created_at: int) -> Any:
        raise AuthNotSigned("UnsealFailed")

    pool = RelayPool(relay.url, refuses, timeouts=SHORT)
    await nursery.start(pool.run)
    with bounded():
        with pytest.raises(RelayUnavailable):
            await pool.query(key.pubkey, [{"kinds": [1]}])
        result = await pool.publish(key.pubkey, signed(key.sign(1, "x")))
    assert isinstance(result, NotSent) and "AUTH not signed: UnsealFailed" in result.reason
    assert "EVENT" not in _verbs(relay)


def test_transport_rule() -> None:
    signer = auth_signer_for(TestKey())
    for ok in ("ws://127.0.0.1:7777", "ws://localhost/", "ws://[::1]:80", "wss://relay.example.com"):
        RelayPool(ok, signer)
    for bad in ("ws://relay.example.com", "ws://10.0.0.1:80", "http://127.0.0.1", "wss://", " wss://x"):
        with pytest.raises(ValueError):
            RelayPool(bad, signer)


async def test_not_running_is_a_bug() -> None:
    key = TestKey()
    pool = RelayPool("ws://127.0.0.1:1", auth_signer_for(key))
    with pytest.raises(RuntimeError):
        await pool.publish(key.pubkey, signed(key.sign(1, "x")))


async def test_a_server_that_is_not_a_relay_is_not_sent(nursery: trio.Nursery) -> None:
    async def http_404(stream: trio.SocketStream) -> None:
        await stream.receive_some(4096)
        await stream.send_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
        await stream.aclose()

    async def hang_up(stream: trio.SocketStream) -> None:
        await stream.aclose()

    for handler in (http_404, hang_up):
        port = free_port()
        await nursery.start(trio.serve_tcp, handler, port)
        await _assert_unreachable(nursery, f"ws://127.0.0.1:{port}")


async def test_cancelled_query_still_sends_close(scripted_relay: Start, nursery: trio.Nursery) -> None:
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(default_req=ReqReply.NEVER_EOSE), timeouts=RelayTimeouts(eose=30))
    with trio.move_on_after(0.3) as scope:
        await pool.query(key.pubkey, [{"kinds": [1]}])
    assert scope.cancelled_caught
    await _eventually(lambda: _verbs(relay) == ["REQ", "CLOSE"])


async def test_a_notice_flood_costs_the_log_one_line(
    scripted_relay: Start, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # NOTICE is operator text, and a relay may send it without end: each was one log
    # line, so a relay could fill the journal (and push every other line out of its rate
    # limit). The connection serves on.
    flood = tuple(json.dumps(["NOTICE", f"notice {i}"]) for i in range(2000))
    caplog.set_level(logging.INFO, logger="buzz_broker.relay")
    # What is measured is lines, not time: the OK waits behind 2,000 frames, which took
    # longer than SHORT's 0.5 s on a loaded CI machine, so the OK deadline is wide here.
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(greeting=flood), timeouts=RelayTimeouts(ok=30))
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), Accepted)
    lines = [r for r in caplog.records if getattr(r, "buzz_event", None) == "relay_notice"]
    assert len(lines) == 1 and "notice 0" in repr(getattr(lines[0], "buzz_fields", None))
    assert len(relay.connections) == 1


@pytest.mark.parametrize("script", [
    Script(require_auth=True, accept_auth=False),
    Script(challenge_at_connect=True, require_auth=True, accept_auth=False),
    Script(require_auth=True, accept_auth=False, challenge_every_refusal=True),
    Script(require_auth=True, auth_spent_by_each_request=True),
    Script(default_event=EventReply.DROP, default_req=ReqReply.DROP),
], ids=["refuses-auth", "refuses-auth-at-connect", "new-challenge-each-refusal",
        "auth-spent-by-each-request", "drops-every-connection"])
async def test_a_relay_that_costs_every_request_a_connection_or_an_auth_costs_the_log_a_line(
    scripted_relay: Start, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture,
    script: Script,
) -> None:
    # Refusing every AUTH (or dropping every connection) makes each request open a
    # connection of its own, and forgetting every AUTH makes each sign one: the
    # connection's lines were three per request (connected, refused, disconnected), one
    # line per request for a forgetful relay. Now one line a minute per agent and event,
    # and every request is answered as before; another agent's lines are its own.
    caplog.set_level(logging.INFO, logger="buzz_broker.relay")
    relay = await scripted_relay(script)
    key, other = TestKey(), TestKey()
    pool = await _pool(nursery, relay.url, key, other)
    accepted = script.accept_auth and script.default_event is EventReply.ACCEPT
    for i in range(20):
        result = await pool.publish(key.pubkey, signed(key.sign(1, f"x{i}")))
        assert isinstance(result, Accepted) if accepted else not isinstance(result, Accepted)
        if accepted:
            await pool.query(key.pubkey, [{"kinds": [1]}])
        else:
            with pytest.raises((RelayRefused, RelayUnavailable)):
                await pool.query(key.pubkey, [{"kinds": [1]}])
    await pool.publish(other.pubkey, signed(other.sign(1, "y")))
    await _eventually(lambda: any(getattr(r, "buzz_fields", {}).get("agent") == other.pubkey
                                  for r in caplog.records))
    lines = collections.Counter(
        (getattr(r, "buzz_event", None), getattr(r, "buzz_fields", {}).get("agent"))
        for r in caplog.records if r.name == "buzz_broker.relay")
    assert lines and max(lines.values()) == 1, lines
    assert {agent for _, agent in lines} == {key.pubkey, other.pubkey}
    # What happened is still counted, and did happen as often as before.
    costly = ("relay_authenticated" if accepted else
              "relay_disconnected" if script.default_event is EventReply.DROP else
              "relay_auth_refused")
    assert pool._lines.total(costly) >= 40  # white box: one per request, one line shown
    assert len(relay.connections) >= (2 if accepted else 40)


async def test_backoff_stays_bounded_however_long_the_relay_is_down(nursery: trio.Nursery) -> None:
    # The delay was backoff_initial * 2**failures: past 1,023 failed connects in a row
    # (8.5 hours down at the default 30 s cap) the float overflowed, and every publish and
    # read raised OverflowError instead of answering NotSent / RelayUnavailable.
    key = TestKey()
    tiny = RelayTimeouts(connect=1, ok=1, eose=1, backoff_initial=1e-6, backoff_max=1e-6)
    pool = await _pool(nursery, f"ws://127.0.0.1:{free_port()}", key, timeouts=tiny)
    event = signed(key.sign(1, "x"))
    for _ in range(1100):
        assert isinstance(await pool.publish(key.pubkey, event), NotSent)
    with pytest.raises(RelayUnavailable):
        await pool.query(key.pubkey, [{"kinds": [1]}])


async def test_a_query_that_never_sees_eose_gives_its_result_bytes_back(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # The relay sends its events and never EOSE: the query fails at its timeout, and what
    # it collected is given back to max_result_bytes. Kept, each such read would leak its
    # bytes for the daemon's life, until every read fails with "max_result_bytes".
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(default_req=ReqReply.NEVER_EOSE))
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x" * 1000))), Accepted)
    for _ in range(3):
        with bounded():
            with pytest.raises(RelayUnavailable):
                await pool.query(key.pubkey, [{"kinds": [1]}])
    assert pool.result_bytes_held == 0


async def test_a_waiter_at_the_gate_sleeps_until_its_turn() -> None:
    # While a probe is out, the others wait on an event, not in a loop: a waiter that
    # spins costs a core for as long as the probe takes (up to timeouts.ok).
    gate = AuthGate()
    steps = collections.Counter[str]()

    class Count(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            steps[task.name] += 1

    async def wait(name: str, hold: float) -> None:
        async with gate.passage(5.0) as through:
            assert through
            await trio.sleep(hold)

    trio.lowlevel.add_instrument(Count())
    async with trio.open_nursery() as inner:
        inner.start_soon(wait, "A", 0.05, name="A")
        await trio.testing.wait_all_tasks_blocked()
        inner.start_soon(wait, "B", 0.2, name="B")
        inner.start_soon(wait, "C", 0.0, name="C")
    assert steps["C"] < 50, steps


def test_timeouts_and_pool_limits_are_checked_where_they_are_built() -> None:
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError):
            RelayTimeouts(ok=bad)
    with pytest.raises(ValueError):
        RelayTimeouts(backoff_initial=2.0, backoff_max=1.0)
    signer = auth_signer_for(TestKey())
    with pytest.raises(ValueError):
        RelayPool("ws://127.0.0.1:1", signer, max_result_bytes=MAX_QUERY_BYTES - 1)
    with pytest.raises(ValueError):
        RelayPool("ws://127.0.0.1:1", signer, max_live_subscriptions=-1)


async def test_an_unanswered_event_leaves_nothing_behind_on_its_connection(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # A relay that never answers OK costs each publish its timeout (Unknown), not a
    # waiter entry kept for the warm connection's life.
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(default_event=EventReply.SILENT))
    for i in range(3):
        with bounded():
            assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, str(i)))), Unknown)
    conn = pool._connections[key.pubkey]  # white box: the connection is still warm
    assert conn.alive and conn.ok_waiters == {}


async def test_an_auth_required_answer_to_our_event_keeps_the_write_gate_shut() -> None:
    # OK false "auth-required:" to an EVENT we sent shows the relay does not take our
    # writes yet: opening the gate would release a burst that draws one challenge each.
    from daemon.relay.pool import _Connection, _ResultBudget
    from daemon.relay.protocol import Ok

    pool = RelayPool("ws://127.0.0.1:1", auth_signer_for(TestKey()))
    conn = _Connection("a" * 64, _ResultBudget(1 << 30), pool._notices)
    conn.alive = True
    waiter = conn.expect_ok("ab" * 32)
    conn.dispatch(Ok(event_id="ab" * 32, accepted=False, message="auth-required: who are you"))
    assert waiter.done.is_set() and not conn.write_gate.is_open and not conn.read_gate.is_open
    conn.expect_ok("cd" * 32)
    conn.dispatch(Ok(event_id="cd" * 32, accepted=False, message="blocked: not here"))
    assert conn.write_gate.is_open and not conn.read_gate.is_open


class _NullSink:
    def event(self, event: dict[str, Any], *, live: bool) -> None:
        pass

    def ended(self, reason: str) -> None:
        pass


async def test_a_subscription_whose_connection_drops_before_eose_is_not_established(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # No EOSE, the connection gone: there is no live subscription to hand a window (it
    # would never hear of the drop, and answer reads from nothing).
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(reqs=(ReqReply.DROP,)))
    with bounded():
        with pytest.raises(RelayUnavailable):
            await pool.subscribe(key.pubkey, [{"kinds": [1]}], _NullSink())


async def test_refused_subscriptions_do_not_use_up_the_connections_slots(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    relay = await scripted_relay(Script(default_req=ReqReply.RESTRICTED))
    key = TestKey()
    pool = RelayPool(relay.url, auth_signer_for(key), timeouts=SHORT, max_live_subscriptions=1)
    await nursery.start(pool.run)
    for _ in range(3):
        with bounded():
            with pytest.raises(RelayRefused):
                await pool.subscribe(key.pubkey, [{"kinds": [1]}], _NullSink())


async def test_no_new_challenge_means_no_second_auth_for_the_old_one(nursery: trio.Nursery) -> None:
    # NIP-42: one AUTH per challenge. A relay that accepted our AUTH and still answers
    # "auth-required:" without a new challenge gets a refusal from us, not the same AUTH again.
    import trio_websocket

    received: list[list[Any]] = []

    async def handle(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.send_message(json.dumps(["AUTH", "only-challenge"]))
        try:
            while True:
                msg = json.loads(await ws.get_message())
                received.append(msg)
                if msg[0] == "AUTH":
                    await ws.send_message(json.dumps(["OK", msg[1]["id"], True, ""]))
                elif msg[0] == "EVENT" and [m[0] for m in received].count("EVENT") == 1:
                    await ws.send_message(json.dumps(["OK", msg[1]["id"], True, ""]))
                elif msg[0] == "EVENT":
                    await ws.send_message(json.dumps(["OK", msg[1]["id"], False, "auth-required: again"]))
        except trio_websocket.ConnectionClosed:
            pass

    port = free_port()
    await nursery.start(trio_websocket.serve_websocket, handle, "127.0.0.1", port, None)
    key = TestKey()
    pool = await _pool(nursery, f"ws://127.0.0.1:{port}", key)
    with bounded():
        assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), Accepted)
        result = await pool.publish(key.pubkey, signed(key.sign(1, "y")))
    assert isinstance(result, Rejected) and "no new AUTH challenge" in result.reason, result
    assert sorted(m[0] for m in received) == ["AUTH", "EVENT", "EVENT"], received


async def test_a_protocol_error_quoting_a_frame_long_key_is_logged_cut(
    scripted_relay: Start, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # A duplicate key is quoted in the parser's detail (`_no_duplicate_keys`): a relay
    # choosing a key of 200,000 characters chose a 200 kB log line, before the cut.
    key_text = "k" * 200_000
    frame = '["NOTICE", {"%s": 1, "%s": 2}]' % (key_text, key_text)
    caplog.set_level(logging.INFO, logger="buzz_broker.relay")
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(greeting=(frame,)))
    await pool.publish(key.pubkey, signed(key.sign(1, "x")))
    lines = [getattr(r, "buzz_fields") for r in caplog.records
             if getattr(r, "buzz_event", None) == "relay_protocol_error"]
    assert lines and all(f["code"] == "not_json" for f in lines), lines
    assert all(len(f["detail"]) <= MAX_REASON_CHARS for f in lines), [len(f["detail"]) for f in lines]


async def test_a_frame_long_notice_is_logged_cut_and_printable(
    scripted_relay: Start, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # A NOTICE may be a whole frame: its line quotes at most MAX_REASON_CHARS printable
    # characters of it (`quote_reason`), as every relay text we keep.
    notice = json.dumps(["NOTICE", "slow down \x1b[2J" + "\u2028" * 500_000],
                        ensure_ascii=False)
    caplog.set_level(logging.INFO, logger="buzz_broker.relay")
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(greeting=(notice,)))
    assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "x"))), Accepted)
    lines = [getattr(r, "buzz_fields") for r in caplog.records
             if getattr(r, "buzz_event", None) == "relay_notice"]
    assert [f["notice"] for f in lines] == ["slow down  [2J"]


async def test_requests_waiting_on_a_refused_auth_quote_the_refusal_cut(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # Reads in flight on one connection when its AUTH is refused fail with the refusal
    # kept on the connection (`conn.refused`): the cut quote, like the first's, not the
    # relay's frame-long text in every request's reason and read line.
    def refusal(n: int) -> str:
        return f"blocked: {n} " + "\u2028" * 500_000

    relay, key, pool = await _scripted(scripted_relay, nursery, Script(
        require_auth=True, accept_auth=False, auth_refusal=refusal))
    reasons: list[str] = []

    async def read() -> None:
        try:
            await pool.query(key.pubkey, [{"kinds": [9]}])
        except RelayRefused as exc:
            reasons.append(exc.reason)

    with bounded():
        async with trio.open_nursery() as readers:
            for _ in range(4):
                readers.start_soon(read)
    assert len(reasons) == 4 and relay.auth_refused == 1, (len(reasons), relay.auth_refused)
    assert all(len(r) <= 3 * MAX_REASON_CHARS for r in reasons), [len(r) for r in reasons]


async def test_a_version_that_lost_a_same_second_tie_does_not_stop_the_next_build(
    scripted_relay: Start, nursery: trio.Nursery, tmp_path: Any
) -> None:
    # Buzz answers a replaceable write that loses to the version it holds (the same second,
    # a higher id) `OK true "duplicate:"` (buzz-db replace_addressable_event: not
    # inserted). The pool records the watermark of what it sent, and the relay keeps
    # serving its own head: NIP-01 keeps the lowest id of one second, so that head is not
    # older than ours, and the next build on it must go ahead. A head that loses to the
    # watermark by the same rule is still refused (the guard stands).
    relay, key, pool = await _scripted(scripted_relay, nursery, Script(
        default_event=EventReply.DUPLICATE))
    pool.watermarks = SignWatermarks.open(tmp_path)
    t = int(time.time())
    head, middle, ours = sorted(
        (key.sign(0, json.dumps({"name": n}), [], t) for n in ("other", "x", "ours")),
        key=lambda e: e["id"])
    result = await pool.publish(key.pubkey, signed(ours))
    assert isinstance(result, Accepted) and result.duplicate
    assert pool.watermarks.get(key.pubkey, 0, "") is not None
    ctx: Any = types.SimpleNamespace(relay=pool)
    check_builds_on_latest(ctx, key.pubkey, 0, "", SignedEvent.from_json_obj(head))
    check_builds_on_latest(ctx, key.pubkey, 0, "", SignedEvent.from_json_obj(ours))
    pool.watermarks.forget([key.pubkey])
    await pool.publish(key.pubkey, signed(middle))  # now the watermark is the middle id
    for loser in (ours, key.sign(0, "{}", [], t - 1)):
        with pytest.raises(OperationRefused, match="older than the last one"):
            check_builds_on_latest(ctx, key.pubkey, 0, "", SignedEvent.from_json_obj(loser))
