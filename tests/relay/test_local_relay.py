"""RelayPool against a real relay: nostr-sdk's LocalRelay with NIP-42 AUTH required.

LocalRelay sends its AUTH challenge only after refusing something (``auth-required:``),
so every first publish/query here goes through "refused, authenticate, resend once".
"""

from __future__ import annotations

import logging
import signal

import pytest
import trio

from daemon.relay.pool import Accepted, NotSent, RelayPool, RelayTimeouts, RelayUnavailable, Unknown
from tests.fixtures.relay import (
    signed,
    TestKey,
    auth_signer_for,
    free_port,
    nostr_fetch,
    nostr_verify,
    start_devrelay,
)

# Generous: LocalRelay on a shared 2-core machine; these are ceilings, not latencies.
TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=60)


async def test_publish_duplicate_query_and_independent_read(local_relay: str) -> None:
    alice = TestKey()
    pool = RelayPool(local_relay, auth_signer_for(alice), timeouts=TIMEOUTS)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        event = alice.sign(1, "hello from the broker ✓", [["t", "relay-test"]])

        first = await pool.publish(alice.pubkey, signed(event))
        assert first == Accepted(duplicate=False, message=first.message)  # type: ignore[union-attr]

        again = await pool.publish(alice.pubkey, signed(event))
        assert isinstance(again, Accepted) and again.duplicate

        got = await pool.query(alice.pubkey, [{"ids": [event["id"]]}])
        assert got == [event]
        nursery.cancel_scope.cancel()

    # An independent client (nostr-sdk, its own keys and AUTH) sees the same bytes.
    seen = await trio.to_thread.run_sync(nostr_fetch, local_relay, [{"ids": [event["id"]]}])
    assert seen == [event]
    assert nostr_verify(seen[0])


async def test_two_agents_share_a_pool(local_relay: str) -> None:
    alice, bob = TestKey(), TestKey()
    pool = RelayPool(local_relay, auth_signer_for(alice, bob), timeouts=TIMEOUTS)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        events = {k.pubkey: [k.sign(1, f"{k.pubkey[:8]} #{i}") for i in range(5)] for k in (alice, bob)}
        results: dict[str, list[object]] = {alice.pubkey: [], bob.pubkey: []}

        async def post_all(agent: str) -> None:
            async with trio.open_nursery() as inner:  # concurrent on one connection
                for ev in events[agent]:
                    async def one(ev: dict[str, object] = ev) -> None:
                        results[agent].append(await pool.publish(agent, signed(ev)))
                    inner.start_soon(one)

        async with trio.open_nursery() as both:
            both.start_soon(post_all, alice.pubkey)
            both.start_soon(post_all, bob.pubkey)

        for agent in (alice.pubkey, bob.pubkey):
            assert len(results[agent]) == 5
            assert all(isinstance(r, Accepted) and not r.duplicate for r in results[agent])

        got = await pool.query(bob.pubkey, [{"authors": [alice.pubkey], "kinds": [1]}])
        assert sorted(e["id"] for e in got) == sorted(e["id"] for e in events[alice.pubkey])
        nursery.cancel_scope.cancel()

    seen = await trio.to_thread.run_sync(
        nostr_fetch, local_relay, [{"authors": [alice.pubkey, bob.pubkey]}]
    )
    assert len(seen) == 10 and all(nostr_verify(e) for e in seen)


async def test_relay_killed_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="buzz_broker")
    alice = TestKey()
    port = free_port()
    pool = RelayPool(f"ws://127.0.0.1:{port}", auth_signer_for(alice),
                     timeouts=RelayTimeouts(connect=5, ok=5, eose=5, backoff_initial=0.05, backoff_max=0.1))
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        with start_devrelay(auth=True, port=port) as (_url, proc):
            assert isinstance(await pool.publish(alice.pubkey, signed(alice.sign(1, "before"))), Accepted)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        with trio.fail_after(10):
            # Dead relay: either we notice first (NotSent) or the frame dies in flight (Unknown).
            down = await pool.publish(alice.pubkey, signed(alice.sign(1, "while down")))
            assert isinstance(down, (NotSent, Unknown))
            with pytest.raises(RelayUnavailable):
                await pool.query(alice.pubkey, [{"kinds": [1]}])
        with start_devrelay(auth=True, port=port) as (_url, proc):
            await trio.sleep(0.15)  # let the (0.1 s max) backoff pass; reconnect is on demand
            with trio.fail_after(10):
                again = await pool.publish(alice.pubkey, signed(alice.sign(1, "after")))
            assert isinstance(again, Accepted)
            proc.terminate()
            assert proc.wait(timeout=10) == 0  # the dev relay stops cleanly on SIGTERM
        nursery.cancel_scope.cancel()
    events = [r.__dict__.get("buzz_event") for r in caplog.records]
    assert {"relay_connected", "relay_disconnected", "relay_connect_failed"} <= set(events)
    # Nothing the relay client logs carries key material.
    everything = caplog.text + repr([r.__dict__ for r in caplog.records])
    assert alice.secret_hex not in everything


async def test_an_idle_pool_holds_no_connection_and_no_connect_lock(local_relay: str) -> None:
    """Agents that connected (several requests at once each: tasks waiting on the agent's
    connect lock) and then went idle past `idle_seconds` leave nothing in the pool: before,
    each agent ever connected left its connect lock until the daemon restarted, one more
    per agents.create of a create-delete loop."""
    keys = [TestKey() for _ in range(5)]
    timeouts = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=0.3)
    pool = RelayPool(local_relay, auth_signer_for(*keys), timeouts=timeouts)
    results: list[object] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)

        async def publish(key: TestKey, n: int) -> None:
            results.append(await pool.publish(key.pubkey, signed(key.sign(1, f"idle #{n}"))))

        async with trio.open_nursery() as inner:
            for key in keys:
                for n in range(3):
                    inner.start_soon(publish, key, n)
        assert len(results) == 15 and all(isinstance(r, Accepted) for r in results), results
        await trio.sleep(1.5)  # past idle_seconds, and the idle closer's next round
        assert (pool._connections, pool._connect_locks) == ({}, {})
        nursery.cancel_scope.cancel()
