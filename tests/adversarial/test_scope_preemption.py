"""A narrow credential's refusal does not pre-empt a requestId (issue 13, item 7).

Attack: the ledger is the agent's, shared by all of its credentials (spec I3 keys it on the
principal; a credential rotated between attempts must still replay). A refusal that came
from the credential's own scope used to be recorded there too, so a narrow credential (or
whoever holds it) could burn a requestId the agent's wide credential was about to use: the
wide credential's request then replayed `failed` instead of running.

Now a request outside its credential's own actions or channels is recorded under
`<agent>/<credential id>` (daemon/pipeline/broker.py `_ledger_principal`). Proven here: the wide
credential's request with the same requestId (the very same bytes) runs and succeeds; the
narrow credential's refusal is still recorded (its retry replays it), per credential (a
second narrow credential is judged afresh), and never handed the wide one's success.

An invalid request is no way around it: one the contract cannot read is judged by the
action and channel its envelope names (`policy.envelope_within_credential`). Naming what
the credential lacks (or naming nothing readable), its `invalid_request` is the
credential's own record, and the wide credential's valid request with that requestId
runs; naming what the credential holds, it is the agent's, so the same credential's valid
request with that requestId is still a `request_id_conflict`.
"""

from __future__ import annotations

import uuid

import pytest

from tests.fixtures.broker import BrokerHarness, request_body

CHANNEL = str(uuid.uuid4())
OTHER_CHANNEL = str(uuid.uuid4())


def _verdict(envelope: dict[str, object] | None) -> tuple[object, object, object]:
    assert envelope is not None
    error = envelope.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return envelope["status"], code, envelope.get("replayed", False)


#: name -> the narrow credential's scope (channels, actions): each leaves out what the
#: request needs.
NARROW = {
    "action": ([CHANNEL], ["channel.read"]),
    "channel": ([OTHER_CHANNEL], ["message.post"]),
}


@pytest.mark.parametrize("left_out", sorted(NARROW))
async def test_a_scope_refusal_does_not_pre_empt_the_wide_credential(
    broker: BrokerHarness, left_out: str
) -> None:
    agent = await broker.human_owned_agent("scoped")
    channels, actions = NARROW[left_out]
    narrow = broker.credential(agent, channels, actions=actions)
    other_narrow = broker.credential(agent, channels, actions=actions)
    wide = broker.credential(agent, [CHANNEL])
    body = request_body("message.post", {"channelId": CHANNEL, "content": "mine"},
                        request_id=str(uuid.uuid4()))

    assert _verdict((await broker.post(body, narrow))[1]) == ("failed", "unauthorized", False)
    # Recorded, for that credential: the identical retry replays the refusal.
    assert _verdict((await broker.post(body, narrow))[1]) == ("failed", "unauthorized", True)
    # The wide credential's request under the same requestId runs, and is then the agent's.
    assert _verdict((await broker.post(body, wide))[1]) == ("succeeded", None, False)
    assert _verdict((await broker.post(body, wide))[1]) == ("succeeded", None, True)
    # Per credential: another narrow credential is judged afresh, and is handed nothing.
    assert _verdict((await broker.post(body, other_narrow))[1]) == ("failed", "unauthorized", False)
    assert _verdict((await broker.post(body, narrow))[1]) == ("failed", "unauthorized", True)


#: An invalid message.post (an unknown argument member), as the narrow credential sends it.
INVALID = {
    "args": request_body("message.post", {"channelId": CHANNEL, "content": "x", "bogus": 1},
                         request_id="{rid}"),
    "action": request_body("message.post", {"channelId": CHANNEL, "content": "x"},
                           request_id="{rid}").replace(b'"message.post"', b'"message.pots"'),
    "not_an_object": b'{"requestId":"{rid}","action":"message.post","args":[]}',
}


@pytest.mark.parametrize("left_out", sorted(NARROW))
@pytest.mark.parametrize("invalid", sorted(INVALID))
async def test_an_invalid_request_does_not_pre_empt_the_wide_credential(
    broker: BrokerHarness, left_out: str, invalid: str
) -> None:
    agent = await broker.human_owned_agent("scoped")
    channels, actions = NARROW[left_out]
    narrow = broker.credential(agent, channels, actions=actions)
    wide = broker.credential(agent, [CHANNEL])
    rid = str(uuid.uuid4())
    bad = INVALID[invalid].replace(b"{rid}", rid.encode())
    good = request_body("message.post", {"channelId": CHANNEL, "content": "mine"}, request_id=rid)

    first = (await broker.post(bad, narrow))[1]
    assert first is not None and first["status"] == "failed"
    assert first["error"]["code"] in {"invalid_request", "unknown_action"}
    # Recorded, for that credential: the identical retry replays the refusal.
    assert (await broker.post(bad, narrow))[1] == {**first, "replayed": True}
    assert _verdict((await broker.post(good, wide))[1]) == ("succeeded", None, False)
    assert _verdict((await broker.post(good, wide))[1]) == ("succeeded", None, True)


async def test_an_invalid_request_within_scope_still_conflicts_with_a_valid_one(
    broker: BrokerHarness,
) -> None:
    """NIP-BA's conflict rule holds for one credential: an invalid request naming what it
    holds, then a valid one with that requestId, are one requestId with two bodies."""
    agent = await broker.human_owned_agent("scoped")
    wide = broker.credential(agent, [CHANNEL])
    other = broker.credential(agent, [CHANNEL])
    rid = str(uuid.uuid4())
    bad = request_body("message.post", {"channelId": CHANNEL.upper(), "content": "x", "bogus": 1},
                       request_id=rid)
    good = request_body("message.post", {"channelId": CHANNEL, "content": "mine"}, request_id=rid)
    assert _verdict((await broker.post(bad, wide))[1]) == ("failed", "invalid_request", False)
    assert _verdict((await broker.post(good, wide))[1]) == ("failed", "request_id_conflict", False)
    # The agent's record: the agent's other credential replays it (spec I3).
    assert _verdict((await broker.post(bad, other))[1]) == ("failed", "invalid_request", True)
