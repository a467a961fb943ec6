"""I2 and I3 over the real socket: the session decides who acts, and a retry never acts twice."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid

import trio

from tests.fixtures.broker import BrokerHarness, raw_post, request_body
from tests.fixtures.relay import nostr_fetch


async def test_hundred_concurrent_identical_requests_execute_once(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    body = request_body("message.post", {"channelId": channel, "content": "exactly once"})
    answers: list[bytes] = []

    async def send() -> None:
        status, raw = await raw_post(broker.socket, body, cred)
        assert status == 200
        answers.append(raw)

    async with trio.open_nursery() as nursery:
        for _ in range(100):
            nursery.start_soon(send)
    originals = [a for a in answers if b'"replayed":true' not in a]
    replays = [a for a in answers if b'"replayed":true' in a]
    assert len(originals) == 1 and len(replays) == 99
    assert b'"status":"succeeded"' in originals[0]
    assert {r.replace(b',"replayed":true', b"") for r in replays} == {originals[0]}
    events = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url,
                                           [{"kinds": [9], "#h": [channel]}])
    assert len(events) == 1


async def test_another_principal_reusing_a_request_id_gets_its_own_verdict(
    broker: BrokerHarness,
) -> None:
    channel = str(uuid.uuid4())
    alice, bob = await broker.human_owned_agent("alice"), await broker.human_owned_agent("bob")
    alice_cred = broker.credential(alice, [channel])
    bob_cred = broker.credential(bob, [channel])
    request_id = "shared-id-1"
    _, a = await broker.post(request_body("message.post", {"channelId": channel, "content": "A"},
                                          request_id=request_id), alice_cred)
    _, b = await broker.post(request_body("message.post", {"channelId": channel, "content": "B"},
                                          request_id=request_id), bob_cred)
    assert a is not None and b is not None
    assert a["status"] == b["status"] == "succeeded"
    assert "replayed" not in b and a["outcome"]["eventId"] != b["outcome"]["eventId"]
    events = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url,
                                           [{"kinds": [9], "#h": [channel]}])
    assert {(e["pubkey"], e["content"]) for e in events} == {(alice, "A"), (bob, "B")}


async def test_a_retry_has_the_same_body_mac_and_a_conflict_another(
    broker: BrokerHarness,
) -> None:
    """The audit lines' `bodyMac` still tells a retry from another body (docs/operations.md,
    "Fields"): the same bytes give the same MAC on this host, a request_id_conflict's body
    another; each is HMAC-SHA256 under the host's key, and no line holds a body's sha256."""
    from daemon.state.audit import AUDIT_DIRNAME, verify

    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    request_id = str(uuid.uuid4())
    body = request_body("message.post", {"channelId": channel, "content": "said once"},
                        request_id=request_id)
    other = request_body("message.post", {"channelId": channel, "content": "said otherwise"},
                         request_id=request_id)
    answers = []
    for sent in (body, body, other):
        status, answer = await broker.post(sent, cred)
        assert status == 200 and answer is not None
        answers.append((answer["status"], answer.get("error", {}).get("code"),
                        answer.get("replayed", False)))
    assert answers == [("succeeded", None, False), ("succeeded", None, True),
                       ("failed", "request_id_conflict", False)]

    audit_dir = broker.state_dir / AUDIT_DIRNAME
    assert verify(audit_dir).ok
    written = b"".join(p.read_bytes() for p in sorted(audit_dir.iterdir()))
    mine = [line for line in map(json.loads, written.splitlines())
            if line.get("requestId") == request_id]
    assert [sorted({"bodyMac", "bodySha256"} & set(line)) for line in mine] == [["bodyMac"]] * 4
    for sent in (body, other):
        assert hashlib.sha256(sent).hexdigest().encode() not in written

    from daemon.state.audit_mac import KEY_FILE_NAME

    key = (broker.state_dir / KEY_FILE_NAME).read_bytes()

    def mac(data: bytes) -> str:
        return hmac.new(key, data, hashlib.sha256).hexdigest()

    assert [(line["phase"], line["status"], line["code"], line["replayed"], line["bodyMac"])
            for line in mine] == [
        ("intent", None, None, False, mac(body)),
        ("verdict", "succeeded", None, False, mac(body)),
        ("verdict", "succeeded", None, True, mac(body)),
        ("verdict", "failed", "request_id_conflict", False, mac(other)),
    ]
    assert mac(body) != mac(other)


async def test_bad_tokens_are_unauthenticated(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    good = broker.credential(agent, [channel])
    expired_id, expired = broker.app.sessions.issue(agent=agent, channels=[channel],
                                                actions=["message.post"], ttl_seconds=1,
                                                now=int(time.time()) - 10, uid=None)
    revoked_id, revoked = broker.app.sessions.issue(agent=agent, channels=[channel],
                                                actions=["message.post"], ttl_seconds=None,
                                                now=int(time.time()), uid=None)
    broker.app.sessions.revoke(revoked_id)
    _, wrong_uid = broker.app.sessions.issue(agent=agent, channels=[channel],
                                         actions=["message.post"], ttl_seconds=None,
                                         now=int(time.time()), uid=os.getuid() + 1)
    _, right_uid = broker.app.sessions.issue(agent=agent, channels=[channel],
                                         actions=["message.post"], ttl_seconds=None,
                                         now=int(time.time()), uid=os.getuid())
    body = request_body("message.post", {"channelId": channel, "content": "x"})
    # (A trailing space cannot reach us: HTTP strips surrounding whitespace from a header
    # value; the session tests hand that spelling to authenticate() directly.)
    for header in (expired, revoked, wrong_uid, good[:-1], good + "x", good.upper(), "x" * 4096):
        status, envelope = await broker.post(body, header)
        assert status == 200 and envelope is not None
        assert (envelope["status"], envelope["error"]["code"]) == ("failed", "unauthenticated")
    status, envelope = await broker.post(body, right_uid)
    assert envelope is not None and envelope["status"] == "succeeded"


async def test_an_unreadable_pending_record_is_indeterminate_not_a_crash(
    broker: BrokerHarness,
) -> None:
    """A pending record this version cannot read (another format, damage): its events may
    have reached the relay, so the honest answer is indeterminate + internal, and nothing is
    re-sent — never an HTTP 500."""
    import hashlib

    from daemon.state.ledger import Fresh, LedgerKey

    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    body = request_body("message.post", {"channelId": channel, "content": "unreadable"})
    request_id = json.loads(body)["requestId"]
    ledger = broker.app._ledger  # white box: plant what a future format might have written
    begun = await ledger.begin(LedgerKey(principal=agent, request_id=request_id),
                               hashlib.sha256(body).digest())
    assert isinstance(begun, Fresh)
    await ledger.record_pending(begun.ticket, b'{"v":99,"events":[]}')
    ledger.release(begun.ticket)
    status, envelope = await broker.post(body, cred)
    assert status == 200 and envelope is not None
    assert (envelope["status"], envelope["error"]["code"]) == ("indeterminate", "internal")
    events = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url,
                                           [{"kinds": [9], "#h": [channel]}])
    assert events == []
