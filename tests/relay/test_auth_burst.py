"""A burst of requests on a cold connection that needs NIP-42 AUTH (real LocalRelay).

LocalRelay challenges only after refusing something, sends a new challenge with every
refusal (the challenge first, then the OK false / CLOSED), and forgets all of its
challenges once more than 20 are outstanding on one connection. When more than 20 requests
reach a fresh connection before its first refusal comes back, an AUTH answering the first
challenge arrives after that challenge was forgotten: ``auth-required: received invalid
challenge``, the publish NotSent or Rejected, the query RelayRefused. The pool's AUTH gate
lets one request through until the relay has answered one without ``auth-required:``, so
a burst costs one refusal and one AUTH whatever the relay's speed.

How the race is made to happen every round: left alone, the relay usually answers the
first refusal after a handful of sends, and the old code failed about one round in twenty
here (more under load: the relay slower than the client). The test freezes the relay
(SIGSTOP) the moment the pool reports the connection open, for PAUSE_SECONDS, which is a
relay busy for a moment: the whole burst is sent (or, with the gate, waits) before the
first answer. On the code before the gate every round failed; ten rounds make it certain.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from daemon.relay.pool import Accepted, RelayPool, RelayTimeouts
from tests.fixtures.relay import TestKey, auth_signer_for, signed, start_devrelay

# Generous: LocalRelay on a shared 2-core machine; these are ceilings, not latencies.
TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=60)
#: Fresh connections per test.
ROUNDS = 10
#: Requests per burst: three times the 20 outstanding challenges LocalRelay keeps.
BURST = 60
#: How long the relay is frozen after each connect: far longer than sending the burst
#: takes (a few ms), far shorter than any timeout.
PAUSE_SECONDS = 0.2


class _FreezeOnConnect(logging.Handler):
    """Freezes the relay process when the pool logs ``relay_connected``; `thaw` wakes it."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid
        self.frozen = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "buzz_event", None) == "relay_connected":
            os.kill(self.pid, signal.SIGSTOP)
            self.frozen.set()

    async def thaw_after(self, seconds: float) -> None:
        await self.frozen.wait()
        self.frozen = trio.Event()
        await trio.sleep(seconds)
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture
def frozen_relay() -> Iterator[tuple[str, _FreezeOnConnect]]:
    """A LocalRelay of this test's own (it is frozen at times), and the freezing handler."""
    logger = logging.getLogger("buzz_broker.relay")
    with start_devrelay(auth=True) as (url, proc):
        handler = _FreezeOnConnect(proc.pid)
        logger.addHandler(handler)
        try:
            yield url, handler
        finally:
            logger.removeHandler(handler)
            proc.send_signal(signal.SIGCONT)


def _auth_events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [e for r in caplog.records
            if (e := getattr(r, "buzz_event", None)) in ("relay_authenticated", "relay_auth_refused")]


async def _burst(pool: RelayPool, key: TestKey, publishes: int, queries: int
                 ) -> tuple[list[object], bool]:
    """`publishes` publishes and `queries` queries as `key`, all started at once; what
    each came to, and whether the relay then holds exactly the events published."""
    events = [key.sign(1, f"burst {i}") for i in range(publishes)]
    mine = [{"authors": [key.pubkey], "kinds": [1]}]
    outcomes: list[object] = []

    async def publish(ev: dict[str, Any]) -> None:
        outcomes.append(await pool.publish(key.pubkey, signed(ev)))

    async def query() -> None:
        try:
            got = await pool.query(key.pubkey, mine)
        except Exception as exc:  # the failure under test is RelayRefused; keep it to report
            outcomes.append(exc)
            return
        assert {e["id"] for e in got} <= {e["id"] for e in events}
        outcomes.append("eose")

    async with trio.open_nursery() as nursery:
        for ev in events:
            nursery.start_soon(publish, ev)
        for _ in range(queries):
            nursery.start_soon(query)
    stored = await pool.query(key.pubkey, mine)
    return outcomes, sorted(e["id"] for e in stored) == sorted(e["id"] for e in events)


def _what_failed(outcomes: list[object], all_stored: bool) -> list[str]:
    """A round's failures (`_burst`): how many, and the first two; [] when none."""
    bad = [repr(o) for o in outcomes
           if not (isinstance(o, Accepted) and not o.duplicate or o == "eose")]
    if not all_stored:
        bad.append("the relay does not hold exactly the events published")
    return [f"{len(bad)} failed", *bad[:2]] if bad else []


@pytest.mark.parametrize(("publishes", "queries"), [(BURST, 0), (BURST // 2, BURST // 2)],
                         ids=["publishes", "publishes+queries"])
async def test_burst_on_a_cold_connection_authenticates_once(
    frozen_relay: tuple[str, _FreezeOnConnect], caplog: pytest.LogCaptureFixture,
    publishes: int, queries: int,
) -> None:
    url, freezer = frozen_relay
    caplog.set_level(logging.INFO, logger="buzz_broker.relay")
    keys = [TestKey() for _ in range(ROUNDS)]
    pool = RelayPool(url, auth_signer_for(*keys), timeouts=TIMEOUTS)
    #: round -> what went wrong in it (the first few outcomes that were not a success)
    failures: dict[int, list[str]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for n, key in enumerate(keys):  # a new agent: a new, unauthenticated connection
            async with trio.open_nursery() as round_:
                round_.start_soon(freezer.thaw_after, PAUSE_SECONDS)
                outcomes, all_stored = await _burst(pool, key, publishes, queries)
            assert len(outcomes) == publishes + queries
            if bad := _what_failed(outcomes, all_stored):
                failures[n] = bad
        nursery.cancel_scope.cancel()
    assert failures == {}
    # One AUTH per connection, none refused.
    assert _auth_events(caplog) == ["relay_authenticated"] * ROUNDS


async def test_a_write_burst_after_reads_on_a_relay_that_guards_writes_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # LocalRelay with AUTH for writes only: the first read of a connection goes through
    # without AUTH, which says nothing about writes. A burst of publishes then must wait
    # behind one probe as on a cold connection, not all leave on the read's word: sent at
    # once, they drew a challenge each, and the AUTH for an early one was refused
    # ("received invalid challenge"), its publish Rejected. The relay is frozen while
    # the burst starts, so all of it would be sent before the first refusal.
    caplog.set_level(logging.INFO, logger="buzz_broker.relay")
    keys = [TestKey() for _ in range(ROUNDS)]
    failures: dict[int, list[str]] = {}

    async def thaw_after(pid: int, seconds: float) -> None:
        await trio.sleep(seconds)
        os.kill(pid, signal.SIGCONT)

    with start_devrelay(auth=True, writes_only=True) as (url, proc):
        pool = RelayPool(url, auth_signer_for(*keys), timeouts=TIMEOUTS)
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            for n, key in enumerate(keys):
                assert await pool.query(key.pubkey, [{"authors": [key.pubkey]}]) == []
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    async with trio.open_nursery() as round_:
                        round_.start_soon(thaw_after, proc.pid, PAUSE_SECONDS)
                        outcomes, all_stored = await _burst(pool, key, BURST, 0)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                if bad := _what_failed(outcomes, all_stored):
                    failures[n] = bad
            nursery.cancel_scope.cancel()
    assert failures == {}
    assert _auth_events(caplog) == ["relay_authenticated"] * ROUNDS
