"""AUTH that a relay asks for only later: after it let a first request through without it.

A relay may let anyone read and ask for AUTH only to write (NIP-42 allows it, nostr-sdk's
LocalRelay has the mode, tests/relay/test_auth_burst.py runs it), or ask for it only for
some kinds (DMs, protected events). The connection's AUTH gate (daemon/relay/gate.py) must
not take a read's answer as the word on writes, nor one kind's answer as the word on
another: a burst sent on that word draws one refusal each, and from a relay that sends a
new challenge with every refusal (only the newest valid, as NIP-42 says), an AUTH for any
but the last is refused. What a client expects: one AUTH for the connection, every request
resent once after it, and no answer but the relay's own (an ``auth-required`` OK false
means the event was not taken: never ``indeterminate``).

The scripted relay plays these relays (tests/scripted_relay.py); a real LocalRelay cannot
be made to send a challenge per refusal at will, nor to protect a kind.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from daemon.relay.pool import Accepted, RelayPool, RelayTimeouts
from tests.fixtures.relay import TestKey, auth_signer_for, signed
from tests.relay._support import HeldSigner, publish_all, query_all
from tests.scripted_relay import Script, ScriptedRelay

Start = Callable[[Script], Awaitable[ScriptedRelay]]

TIMEOUTS = RelayTimeouts(connect=2, ok=2, eose=2, idle_seconds=30)
#: A relay that sends a new challenge with every refusal and asks for AUTH to write only.
WRITES_NEED_AUTH = Script(require_auth=True, auth_for=frozenset({"EVENT"}),
                          challenge_every_refusal=True)
#: Kind 4 (NIP-04 DMs) needs AUTH to read or write; everything else does not.
DMS_NEED_AUTH = Script(protected_kinds=frozenset({4}), challenge_every_refusal=True)
BURST = 20


def _verbs(relay: ScriptedRelay) -> list[str]:
    return [m[0] for m in relay.received]


def _auth_challenges(relay: ScriptedRelay) -> list[str]:
    """The challenge each AUTH we sent answered, in order."""
    return [t[1] for m in relay.received if m[0] == "AUTH"
            for t in m[1]["tags"] if t[0] == "challenge"]


async def test_a_write_burst_after_a_read_authenticates_once(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    relay = await scripted_relay(WRITES_NEED_AUTH)
    key = TestKey()
    pool = RelayPool(relay.url, auth_signer_for(key), timeouts=TIMEOUTS)
    await nursery.start(pool.run)
    # The read goes through without AUTH: the relay has said nothing about writes.
    assert await pool.query(key.pubkey, [{"kinds": [1]}]) == []
    events = [key.sign(1, f"m{i}") for i in range(BURST)]
    results = await publish_all(pool, key, events)
    assert len(results) == BURST and all(isinstance(r, Accepted) for r in results), results
    assert set(relay.stored) == {e["id"] for e in events}
    # One refused EVENT (the probe), one AUTH, then every EVENT once.
    assert _verbs(relay).count("AUTH") == 1
    assert _verbs(relay).count("EVENT") == BURST + 1
    assert len(relay.connections) == 1


async def test_a_read_burst_for_a_protected_kind_authenticates_once(
    scripted_relay: Start, nursery: trio.Nursery
) -> None:
    # The read gate opened on a public read; the relay then CLOSES a REQ for DMs with
    # auth-required. While that AUTH is being signed (the signer held here), the next DM
    # reads wait for it (the challenge is seen): sent meanwhile, each would draw a newer
    # challenge than the one signed. (This held before the gates were split too.)
    relay = await scripted_relay(DMS_NEED_AUTH)
    key = TestKey()
    signer = HeldSigner(key)
    pool = RelayPool(relay.url, signer, timeouts=TIMEOUTS)
    await nursery.start(pool.run)
    stored = key.sign(4, "a dm")
    relay.stored[stored["id"]] = stored  # the scripted relay returns everything stored
    dms = [{"kinds": [4], "authors": [key.pubkey]}]
    assert await pool.query(key.pubkey, [{"kinds": [1]}]) == [stored]
    answers: list[object] = []

    async def first_read() -> None:
        answers.append(await pool.query(key.pubkey, dms))

    async def the_rest() -> None:
        answers.extend(await query_all(pool, key.pubkey, dms, BURST - 1))

    async with trio.open_nursery() as inner:
        inner.start_soon(first_read)
        # Its REQ refused and CLOSEd, it waits in the signer.
        with trio.fail_after(5):
            while _verbs(relay) != ["REQ", "CLOSE", "REQ", "CLOSE"]:
                await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        inner.start_soon(the_rest)
        await trio.testing.wait_all_tasks_blocked()
        signer.release.set()
    assert answers == [[stored]] * BURST
    # One AUTH, answering the one challenge the relay had sent: nothing went out between
    # the refusal and the AUTH.
    assert len(_auth_challenges(relay)) == 1
    assert [m[0] for m in relay.received].count("REQ") == 2 + BURST


@pytest.mark.parametrize("op", ["publish", "query"])
async def test_a_burst_in_flight_for_a_protected_kind_succeeds(
    scripted_relay: Start, nursery: trio.Nursery, op: str
) -> None:
    # A first request of the kind opened the gate (kind 1 is open); then a burst for DMs
    # leaves at once, and each refusal brings a new challenge. The first AUTH, answering
    # a challenge the relay has since replaced, is refused for that alone: the newest is
    # answered (one AUTH per challenge) and every request is resent once.
    relay = await scripted_relay(DMS_NEED_AUTH)
    key = TestKey()
    pool = RelayPool(relay.url, auth_signer_for(key), timeouts=TIMEOUTS)
    await nursery.start(pool.run)
    dms = [key.sign(4, f"dm {i}") for i in range(BURST)]
    if op == "publish":
        assert isinstance(await pool.publish(key.pubkey, signed(key.sign(1, "open"))), Accepted)
        results = await publish_all(pool, key, dms)
        assert len(results) == BURST and all(isinstance(r, Accepted) for r in results), results
        assert {e["id"] for e in dms} <= set(relay.stored)
    else:
        relay.stored.update((e["id"], e) for e in dms)
        assert len(await pool.query(key.pubkey, [{"kinds": [1]}])) == BURST
        assert await query_all(pool, key.pubkey, [{"kinds": [4]}], BURST) == [dms] * BURST
    challenges = _auth_challenges(relay)
    assert 1 <= len(challenges) <= 2 and len(set(challenges)) == len(challenges)
    assert len(relay.connections) == 1


#: Answers to nothing we sent, the moment the connection opens: an OK for an event never
#: published, and an EOSE for a subscription id this client has not used yet.
UNSOLICITED = (json.dumps(["OK", "ab" * 32, True, ""]), json.dumps(["EOSE", "q7"]))


@pytest.mark.parametrize("op", ["publish", "query"])
async def test_answers_to_nothing_we_sent_do_not_open_the_gate(
    scripted_relay: Start, nursery: trio.Nursery, op: str
) -> None:
    # Taken as the relay's word, they released the whole burst on a relay that needs
    # AUTH and challenges with every refusal: a challenge per request, AUTH refused.
    relay = await scripted_relay(Script(require_auth=True, challenge_every_refusal=True,
                                        greeting=UNSOLICITED))
    key = TestKey()
    pool = RelayPool(relay.url, auth_signer_for(key), timeouts=TIMEOUTS)
    await nursery.start(pool.run)
    if op == "publish":
        events = [key.sign(1, f"m{i}") for i in range(BURST)]
        results = await publish_all(pool, key, events)
        assert len(results) == BURST and all(isinstance(r, Accepted) for r in results), results
        assert _verbs(relay).count("EVENT") == BURST + 1
    else:
        assert await query_all(pool, key.pubkey, [{"kinds": [1]}], BURST) == [[]] * BURST
        assert _verbs(relay).count("REQ") == BURST + 1
    assert len(_auth_challenges(relay)) == 1
