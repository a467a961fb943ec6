"""observer.emit and liveness.ping end to end: the real daemon, the SoftHSM token, LocalRelay.

What is proven here (docs/protocol.md, "observer.emit" and "liveness.ping"):
- each accepted frame reaches the relay as a kind 24200 event signed by the agent, with one
  `p` = the owner, `agent`, `frame` = telemetry, whose content nostr-sdk decrypts with the
  owner's key into the host-built ObserverEvent (seq, timestamp with three millisecond
  digits, kind, channelId, payload: JSON spliced in, other text a string kept literal);
- the 65,535-byte NIP-44 bound on the wrapped plaintext, at the byte;
- a replay answers the recorded count and enqueues nothing again;
- a flood from one credential stays within its share of the queue, and another
  credential's frames still get through to the relay; a nearly full share signs only what
  it admits, and a full one costs custody and the seq store nothing, as do frames none of
  which can be admitted;
- liveness.ping is `unsupported` for valid arguments, `invalid_request` for invalid ones,
  `unauthorized` outside the credential's channel.

Ephemeral events are not stored by a relay, so the owner's side is a live nostr-sdk
subscription (tests/fixtures/observer.py), proven live before anything is sent.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import coincurve
import nostr_sdk
import pytest
import trio

from custody import TokenConfig
from daemon.config import load_config
from daemon.http import HttpLimits, action_routes, serve
from buzzwire.nostr import SignedEvent
from custody import _nip44 as nip44
from daemon.operations.liveness_ping import UNBOUND_TURNS
from daemon.operations.observer_emit import observer_event, rfc3339_millis
from daemon.relay.protocol import encode_event
from daemon.wiring import running
from tests.docs.snippets import REPO, blocks
from tests.fixtures.broker import BrokerHarness, raw_post, request_body, write_config
from tests.fixtures.observer import OwnerWatch, decrypt
from tests.fixtures.relay import TestKey, nostr_verify

CHANNEL = "5df7dfa8-e919-43df-8efd-f1dcb8af7071"


async def owned_agent(harness: BrokerHarness, owner: TestKey, name: str) -> str:
    secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
    return await harness.hold(secret, owner=owner.pubkey, name=name)


def emit(frames: list[tuple[str, str]], request_id: str | None = None) -> bytes:
    return request_body("observer.emit", {"frames": [{"kind": k, "payload": p} for k, p in frames]},
                        request_id=request_id)


def tags_of(event: dict[str, Any], name: str) -> list[list[str]]:
    return [t for t in event["tags"] if t and t[0] == name]


_RFC3339_MILLIS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.mark.parametrize(("fraction", "millis"), [
    (0.0, "000"), (0.0055, "005"), (0.05, "050"), (0.5, "500"), (0.9999, "999")])
def test_the_timestamp_keeps_three_millisecond_digits(fraction: float, millis: str) -> None:
    # NIP-AO's timestamp: 5 ms is ".005", never ".5" (500 ms to a reader); the e2e check of
    # the pattern sees a short one only when the clock is in a second's first 100 ms.
    assert rfc3339_millis(1_796_158_841 + fraction) == f"2026-12-01T21:00:41.{millis}Z"


async def test_each_frame_reaches_the_relay_as_24200_the_owner_decrypts(broker: BrokerHarness) -> None:
    owner = TestKey()
    agent = await owned_agent(broker, owner, "watched")
    credential = broker.credential(agent, [CHANNEL])
    acp = '{"jsonrpc":"2.0","method":"session/update","params":{"n":[1,2.5,"é"]}}'
    frames = [("acp_read", acp), ("turn_started", "plain text, not JSON"),
              ("acp_write", ' {"spaced": true}\n'), ("odd", "NaN")]
    async with OwnerWatch(broker.relay_url, owner, want=len(frames)) as watch:
        status, envelope = await broker.post(emit(frames), credential)
        assert status == 200 and envelope is not None
        assert envelope["status"] == "succeeded", envelope
        assert envelope["outcome"] == {"accepted": len(frames)}
        events = await watch.collected()
    assert len(events) == len(frames)
    opened = []
    for event in events:
        assert event["kind"] == 24200 and event["pubkey"] == agent
        assert nostr_verify(event)
        assert tags_of(event, "p") == [["p", owner.pubkey]]
        assert tags_of(event, "agent") == [["agent", agent]]
        assert tags_of(event, "frame") == [["frame", "telemetry"]]
        opened.append(decrypt(owner, event))
    opened.sort(key=lambda o: o["seq"])
    seqs = [o["seq"] for o in opened]
    assert seqs == list(range(seqs[0], seqs[0] + len(frames)))
    for o, (kind, payload) in zip(opened, frames):
        assert o["kind"] == kind and o["channelId"] == CHANNEL
        assert _RFC3339_MILLIS.fullmatch(o["timestamp"])
    # JSON payloads are spliced in (so they parse as the value); others travel as a string.
    assert opened[0]["payload"] == json.loads(acp)
    assert opened[1]["payload"] == "plain text, not JSON"
    assert opened[2]["payload"] == {"spaced": True}
    assert opened[3]["payload"] == "NaN"  # not RFC 8259 JSON


async def _plaintext_of_one_frame(broker: BrokerHarness, name: str, payload: str) -> str:
    """Emit one frame as a new agent `name` and return the NIP-44 plaintext its owner reads."""
    owner = TestKey()
    agent = await owned_agent(broker, owner, name)
    credential = broker.credential(agent, [CHANNEL])
    async with OwnerWatch(broker.relay_url, owner, want=1) as watch:
        await broker.call(credential, "observer.emit", {"frames": [{"kind": "k", "payload": payload}]})
        [event] = await watch.collected()
    return str(nostr_sdk.nip44_decrypt(nostr_sdk.SecretKey.parse(owner.secret_hex),
                                       nostr_sdk.PublicKey.parse(agent), event["content"]))


async def test_payload_is_spliced_byte_for_byte(broker: BrokerHarness) -> None:
    acp = '{"b":1,  "a":[1.0,1e3]}'
    plain = await _plaintext_of_one_frame(broker, "verbatim", acp)
    assert plain.endswith(f',"payload":{acp}}}')


async def test_a_string_payload_keeps_its_characters_literal(broker: BrokerHarness) -> None:
    # A payload carried as a JSON string keeps non-ASCII as UTF-8, not \u escapes: what the
    # owner reads is the agent's text, and the 65,535-byte cap measures the payload's bytes.
    payload = "café \u2014 not JSON 🐝"
    plain = await _plaintext_of_one_frame(broker, "literal", payload)
    assert plain.endswith(f',"payload":"{payload}"}}')


def _fill(target: int) -> int:
    """The payload length (of x's) that makes a new agent's first ObserverEvent `target` bytes.

    A new agent's first two seq numbers are 1 and 2: the same width, the same overhead."""
    overhead = len(observer_event(seq=1, timestamp="2026-12-01T21:00:41.500Z", kind="k",
                                  payload="", channel_id=CHANNEL).encode())
    return target - overhead


#: NIP-44 pads a plaintext of 32,769..65,536 bytes to a multiple of 8,192: up to 40,960 the
#: kind 24200 event stays within the 65,536 bytes of JSON the relay takes; from 40,961 it
#: is padded to 49,152 and its base64 content alone is 65,628 characters.
_LARGEST_ON_THIS_RELAY = 40_960


async def test_the_largest_frame_the_relay_takes_arrives_and_one_byte_more_is_not_counted(
        broker: BrokerHarness) -> None:
    owner = TestKey()
    agent = await owned_agent(broker, owner, "big")
    credential = broker.credential(agent, [CHANNEL])
    fill = _fill(_LARGEST_ON_THIS_RELAY)
    async with OwnerWatch(broker.relay_url, owner, want=1) as watch:
        fits = await broker.call(credential, "observer.emit",
                                 {"frames": [{"kind": "k", "payload": "x" * fill}]})
        assert fits["outcome"] == {"accepted": 1}
        [event] = await watch.collected()
    opened = decrypt(owner, event)
    assert opened["payload"] == "x" * fill and opened["seq"] == 1
    assert len(json.dumps(opened, separators=(",", ":")).encode()) == _LARGEST_ON_THIS_RELAY
    too_big = await broker.call(credential, "observer.emit",
                                {"frames": [{"kind": "k", "payload": "x" * (fill + 1)}]})
    assert too_big["status"] == "succeeded" and too_big["outcome"] == {"accepted": 0}


async def test_the_wrapped_plaintext_holds_at_65535_bytes_and_not_one_more(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    # A relay taking larger events (max_event_bytes raised): now NIP-44's own cap binds.
    # This relay refuses such events, so what is shown is intake; nostr-sdk reading a
    # 65,535-byte plaintext is tests/custody/test_nip44.py's.
    async with observer_daemon(custody_state, local_relay, tmp_path,
                               {"max_event_bytes": 200_000}) as harness:
        owner = TestKey()
        agent = await owned_agent(harness, owner, "biggest")
        credential = harness.credential(agent, [CHANNEL])
        fill = _fill(65_535)
        fits = await harness.call(credential, "observer.emit",
                                  {"frames": [{"kind": "k", "payload": "x" * fill}]})
        assert fits["outcome"] == {"accepted": 1}
        over = await harness.call(credential, "observer.emit",
                                  {"frames": [{"kind": "k", "payload": "x" * (fill + 1)}]})
        assert over["status"] == "succeeded" and over["outcome"] == {"accepted": 0}


async def test_a_replay_answers_the_count_and_enqueues_nothing(broker: BrokerHarness) -> None:
    owner = TestKey()
    agent = await owned_agent(broker, owner, "replayed")
    credential = broker.credential(agent, [CHANNEL])
    body = emit([("k", "one"), ("k", "two")], request_id="obs-replay-1")
    queue = broker.app._observer.queue  # type: ignore[union-attr]
    status, first = await broker.post(body, credential)
    admitted = queue.counts.admitted
    status, again = await broker.post(body, credential)
    assert again is not None and again.get("replayed") is True
    assert again["outcome"] == first["outcome"] == {"accepted": 2}  # type: ignore[index]
    assert queue.counts.admitted == admitted
    other = await broker.post(emit([("k", "one")], request_id="obs-replay-1"), credential)
    assert other[1] is not None and other[1]["error"]["code"] == "request_id_conflict"


async def test_channel_id_is_null_when_the_credential_names_several(broker: BrokerHarness) -> None:
    owner = TestKey()
    agent = await owned_agent(broker, owner, "several")
    credential = broker.credential(agent, [CHANNEL, str(uuid.uuid4())])
    async with OwnerWatch(broker.relay_url, owner, want=1) as watch:
        await broker.call(credential, "observer.emit", {"frames": [{"kind": "k", "payload": "p"}]})
        [event] = await watch.collected()
    assert decrypt(owner, event)["channelId"] is None


# ------------------------------------------------------------------ a flood, and fairness

#: The smallest share the configuration allows, and a total of two shares.
_SHARE = 65_536


@asynccontextmanager
async def observer_daemon(custody_state: tuple[TokenConfig, Path], relay_url: str,
                          tmp_path: Path, observer: dict[str, object]
                          ) -> AsyncIterator[BrokerHarness]:
    """The daemon as the `broker` fixture runs it, with these [observer] settings."""
    token, state_dir = custody_state
    socket = tmp_path / "broker.sock"
    config_path = write_config(tmp_path / "broker.toml", token=token, state_dir=state_dir,
                               socket=socket, relay_url=relay_url,
                               sections={"observer": observer})
    config = load_config(str(config_path))
    async with running(config) as app:
        async with trio.open_nursery() as inner:
            control = await inner.start(serve, action_routes(app), str(socket),
                                        HttpLimits(request_timeout=10.0, shutdown_grace=5.0))
            yield BrokerHarness(socket=socket, config=config, config_path=config_path,
                                state_dir=state_dir, relay_url=relay_url, app=app,
                                control=control, custody=app.custody, _sessions=app.sessions)
            inner.cancel_scope.cancel()


@pytest.fixture
async def small_queue(custody_state: tuple[TokenConfig, Path], local_relay: str,
                      tmp_path: Path) -> AsyncIterator[BrokerHarness]:
    async with observer_daemon(custody_state, local_relay, tmp_path,
                               {"max_queued_bytes": 2 * _SHARE,
                                "max_queued_bytes_per_credential": _SHARE,
                                "publish_per_second": 20}) as harness:
        yield harness


async def test_a_flood_stays_in_its_share_and_others_still_get_through(small_queue: BrokerHarness) -> None:
    harness = small_queue
    queue = harness.app._observer.queue  # type: ignore[union-attr]
    flooder_owner, quiet_owner = TestKey(), TestKey()
    flooder = await owned_agent(harness, flooder_owner, "flooder")
    quiet = await owned_agent(harness, quiet_owner, "quiet")
    flood_cred = harness.credential(flooder, [CHANNEL])
    quiet_cred = harness.credential(quiet, [CHANNEL])
    flood_id = harness.app.sessions.authenticate(f"Bearer {flood_cred}", None, int(time.time())).credential_id  # type: ignore[union-attr]
    sent = accepted = 0
    for _ in range(4):
        frames = [("acp_read", "f" * 200)] * 256
        envelope = await harness.call(flood_cred, "observer.emit",
                                      {"frames": [{"kind": k, "payload": p} for k, p in frames]})
        assert envelope["status"] == "succeeded", envelope
        sent += len(frames)
        accepted += envelope["outcome"]["accepted"]
        # The bound holds after every request, whatever was sent.
        assert queue.queued_bytes_of(flood_id) <= _SHARE
        assert queue.queued_bytes <= 2 * _SHARE
    assert 0 < accepted < sent
    async with OwnerWatch(harness.relay_url, quiet_owner, want=3) as watch:
        envelope = await harness.call(quiet_cred, "observer.emit", {"frames": [
            {"kind": "turn_started", "payload": f"quiet {i}"} for i in range(3)]})
        assert envelope["outcome"] == {"accepted": 3}
        events = await watch.collected()
    assert sorted(decrypt(quiet_owner, e)["payload"] for e in events) == [
        "quiet 0", "quiet 1", "quiet 2"]


class _CountingSigner:
    """The broker's signer, counting the events it is asked to sign and the calls (hops),
    empty ones included."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.signed = 0
        self.hops = 0

    async def sign(self, requests: Any) -> Any:
        self.signed += len(requests)
        self.hops += 1
        return await self.inner.sign(requests)


class _CountingCustody:
    """The broker's custody, counting the plaintexts it is asked to encrypt and the calls
    (hops), empty ones included."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encrypted = 0
        self.hops = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def encrypt_to_owner(self, agent: str, plaintexts: Any) -> Any:
        self.encrypted += len(plaintexts)
        self.hops += 1
        return await self.inner.encrypt_to_owner(agent, plaintexts)


def frame_bytes(event: SignedEvent) -> int:
    """What the queue charges an event: the bytes of its relay frame."""
    return len(encode_event(event).encode("utf-8"))


def _held_bytes(agent: str, total: int) -> list[SignedEvent]:
    """Unsigned-looking events of `total` frame bytes together, to fill a share with: the
    queue counts bytes and never checks a signature."""
    def made(content: int) -> SignedEvent:
        return SignedEvent(id="0" * 64, pubkey=agent, created_at=0, kind=24200, tags=(),
                           content="a" * content, sig="0" * 128)
    base = frame_bytes(made(0))
    count = -(-total // 60_000)
    sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
    return [made(size - base) for size in sizes]


@pytest.mark.parametrize("owned_by", ["a human", "an agent held here"])
async def test_a_nearly_full_share_signs_only_what_it_admits(small_queue: BrokerHarness,
                                                             owned_by: str) -> None:
    """Custody encrypts and signs only the frames the queue has room for: one `live` unit
    of a credential whose share is nearly full buys one signature, not 256. The room is
    worked out before the event exists, to the byte, with and without the NIP-OA `auth`
    tag custody adds for an agent whose owner is held here."""
    harness = small_queue
    broker = harness.app
    queue = broker._observer.queue  # type: ignore[union-attr]
    if owned_by == "a human":
        agent = await owned_agent(harness, TestKey(), "nearly-full")
    else:
        parent = await owned_agent(harness, TestKey(), "parent")
        secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
        agent = await harness.hold(secret, owner=parent, name="nearly-full")
        assert harness.custody.agent(agent).auth_tag is not None  # type: ignore[union-attr]
    credential = harness.credential(agent, [CHANNEL])
    other = harness.credential(agent, [CHANNEL])
    credential_id = harness.app.sessions.authenticate(f"Bearer {credential}", None, int(time.time())).credential_id  # type: ignore[union-attr]
    frames = {"frames": [{"kind": "k", "payload": "p" * 40}] * 256}
    # One frame's relay bytes, from the same agent's other credential (its own share): the
    # frame is the same but for its seq, whose width stays inside one NIP-44 padding step.
    held: list[int] = []
    reserved: list[int] = []
    real_hold, real_reserve = queue.hold, getattr(queue, "reserve", None)

    def reserve(key: Any, credential_id: str, sizes: Any) -> Any:
        taken = real_reserve(key, credential_id, sizes)  # type: ignore[misc]
        reserved.extend(size for size, ok in zip(sizes, taken) if ok)
        return taken

    def hold(key: Any, credential_id: str, agent: str, events: Any) -> Any:
        held.extend(frame_bytes(e) for e in events if e is not None)
        return real_hold(key, credential_id, agent, events)

    queue.hold = hold  # type: ignore[method-assign]
    if real_reserve is not None:
        queue.reserve = reserve  # type: ignore[method-assign]
    signer, custody = _CountingSigner(broker.signer), _CountingCustody(broker._custody)
    filler = object()
    try:
        one = await harness.call(other, "observer.emit", {"frames": frames["frames"][:1]})
        assert one["outcome"] == {"accepted": 1}
        [size] = held
        # Fill the share to within one and a half events, held under a key of its own and
        # never settled, so the pacer does not drain it meanwhile.
        fill = _SHARE - size - size // 2
        assert all(real_hold(filler, credential_id, agent, _held_bytes(agent, fill)))
        assert size <= queue.room(credential_id) < 2 * size
        broker.signer, broker._custody = signer, custody  # type: ignore[assignment]
        envelope = await harness.call(credential, "observer.emit", frames)
    finally:
        broker.signer, broker._custody = signer.inner, custody.inner  # type: ignore[assignment]
        queue.hold = real_hold  # type: ignore[method-assign]
        if real_reserve is not None:
            queue.reserve = real_reserve  # type: ignore[method-assign]
        queue.settle(filler, keep=False)
    assert envelope["status"] == "succeeded", envelope
    assert envelope["outcome"] == {"accepted": 1}
    assert signer.signed <= envelope["outcome"]["accepted"]
    assert custody.encrypted <= envelope["outcome"]["accepted"]
    assert held[1:] == [size]
    assert reserved == held  # what was reserved is what the events then took, to the byte


async def test_a_full_share_costs_custody_and_the_seq_store_nothing(
        small_queue: BrokerHarness) -> None:
    """With the credential's share already full, observer.emit answers `accepted` 0
    before any work: nothing is encrypted or signed, and no seq numbers are taken (every
    BLOCK of them is a committed ceiling, and a client could send full requests as fast
    as it likes): the next number handed out is still the agent's first."""
    harness = small_queue
    broker = harness.app
    intake = broker._observer
    assert intake is not None
    queue = intake.queue
    agent = await owned_agent(harness, TestKey(), "full")
    credential = harness.credential(agent, [CHANNEL])
    credential_id = harness.app.sessions.authenticate(f"Bearer {credential}", None, int(time.time())).credential_id  # type: ignore[union-attr]
    filler = object()
    signer, custody = _CountingSigner(broker.signer), _CountingCustody(broker._custody)
    try:
        # Filled to the byte, held under a key of its own and never settled, so the pacer
        # does not drain it meanwhile.
        assert all(queue.hold(filler, credential_id, agent, _held_bytes(agent, _SHARE)))
        assert queue.room(credential_id) == 0
        broker.signer, broker._custody = signer, custody  # type: ignore[assignment]
        envelope = await harness.call(credential, "observer.emit",
                                      {"frames": [{"kind": "k", "payload": "p"}] * 256})
    finally:
        broker.signer, broker._custody = signer.inner, custody.inner  # type: ignore[assignment]
        queue.settle(filler, keep=False)
    assert envelope["status"] == "succeeded", envelope
    assert envelope["outcome"] == {"accepted": 0}
    assert (signer.signed, custody.encrypted) == (0, 0)
    assert list(await intake.seq.take(agent, 1)) == [1]


async def test_frames_none_of_which_can_be_admitted_cost_no_custody_hop(
        broker: BrokerHarness) -> None:
    """A request whose every frame is refused at intake (here each ObserverEvent is one
    byte over NIP-44's 65,535-byte plaintext cap) answers `accepted` 0 without a custody
    or signer call, not even an empty one: a client can send such requests at will."""
    app = broker.app
    agent = await owned_agent(broker, TestKey(), "oversized")
    credential = broker.credential(agent, [CHANNEL])
    over = "x" * _fill(65_536)
    signer, custody = _CountingSigner(app.signer), _CountingCustody(app._custody)
    try:
        app.signer, app._custody = signer, custody  # type: ignore[assignment]
        envelope = await broker.call(credential, "observer.emit",
                                     {"frames": [{"kind": "k", "payload": over}]})
    finally:
        app.signer, app._custody = signer.inner, custody.inner  # type: ignore[assignment]
    assert envelope["status"] == "succeeded", envelope
    assert envelope["outcome"] == {"accepted": 0}
    assert (signer.hops, custody.hops) == (0, 0)


def test_the_payload_length_observer_emit_charges_is_nip44s() -> None:
    """`nip44_payload_chars` (what the queue is asked to reserve) is the length of the
    payload custody's NIP-44 v2 writes, across every padding step's edges."""
    from daemon.operations.observer_emit import nip44_payload_chars
    conv_key, nonce = bytes(range(32)), bytes(32)
    for n in (1, 31, 32, 33, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1000, 4096, 4097,
              40_960, 40_961, 65_535):
        assert nip44_payload_chars(n) == len(nip44.encrypt(conv_key, b"x" * n, nonce)), n


# ------------------------------------------------------------------ liveness.ping


async def test_liveness_ping_is_unsupported_after_strict_validation(broker: BrokerHarness) -> None:
    agent = await broker.human_owned_agent("pinger")
    credential = broker.credential(agent, [CHANNEL])
    body = request_body("liveness.ping", {"channelId": CHANNEL, "turnId": "turn-1"},
                        request_id="ping-1")
    status, answer = await broker.post(body, credential)
    assert status == 200 and answer is not None
    assert answer["status"] == "failed" and answer["error"]["code"] == "unsupported"
    status, again = await broker.post(body, credential)
    assert again is not None and again["error"]["code"] == "unsupported"
    for args in ({"channelId": CHANNEL, "turnId": ""}, {"channelId": CHANNEL, "turnId": "t" * 301},
                 {"channelId": CHANNEL}, {"channelId": "nope", "turnId": "t"},
                 {"channelId": CHANNEL, "turnId": 1}):
        refused = await broker.call(credential, "liveness.ping", args)
        assert refused["error"]["code"] == "invalid_request", args
    elsewhere = await broker.call(credential, "liveness.ping",
                                  {"channelId": str(uuid.uuid4()), "turnId": "t"})
    assert elsewhere["error"]["code"] == "unauthorized"


@pytest.mark.broker_config(limits={"live": "2/min"})
async def test_a_ping_is_a_refusal_not_an_effect(broker: BrokerHarness) -> None:
    """liveness.ping is refused before anything runs (policy `UNOFFERED`): each one is
    charged to its credential's refusal share, never to its agent's account, leaves no
    tombstone, and takes no `live` unit (more pings than the bucket holds are all the same
    `unsupported`), with the same envelope as ever."""
    agent = await broker.human_owned_agent("pinger")
    pinger = broker.credential(agent, [CHANNEL], actions=["liveness.ping"])
    pinger_id = broker.app.sessions.authenticate(f"Bearer {pinger}", None, int(time.time())).credential_id  # type: ignore[union-attr]
    ledger = broker.app._ledger
    account, tombstones = ledger.usage(agent), await ledger.tombstones()
    first: dict[str, Any] | None = None
    for i in range(5):
        answer = await broker.call(pinger, "liveness.ping", {"channelId": CHANNEL, "turnId": f"t{i}"},
                                   request_id=f"ping-{i}")
        first = first or answer
        assert answer == {**first, "requestId": f"ping-{i}"}
    assert first is not None and first["status"] == "failed"
    assert first["error"] == {"code": "unsupported", "message": UNBOUND_TURNS}
    assert ledger.usage(agent) == account
    assert await ledger.tombstones() == tombstones
    assert ledger.refusal_usage(agent, pinger_id) > 0
    # Still recorded: the identical retry replays its refusal.
    _, again = await broker.post(request_body("liveness.ping", {"channelId": CHANNEL, "turnId": "t0"},
                                              request_id="ping-0"), pinger)
    assert again == {**first, "replayed": True}


# ------------------------------------------------------------------ docs/protocol.md's examples


@pytest.mark.parametrize("action", ["observer.emit", "liveness.ping"])
async def test_the_protocol_doc_examples_get_the_documented_answers(broker: BrokerHarness,
                                                                     action: str) -> None:
    examples = {label: text.strip() for lang, label, text in blocks(REPO / "docs" / "protocol.md")
                if lang == "json" and label in (f"request-{action}", f"response-{action}")}
    request = json.loads(examples[f"request-{action}"])
    owner = TestKey()
    agent = await owned_agent(broker, owner, "documented")
    channel = request["args"].get("channelId", CHANNEL)
    credential = broker.credential(agent, [channel])
    status, raw = await raw_post(broker.socket, examples[f"request-{action}"].encode(), credential)
    assert status == 200
    assert raw.decode() == examples[f"response-{action}"]


async def test_an_intake_verdict_is_kept_as_long_as_an_effect_not_as_briefly_as_a_read(
        broker: BrokerHarness) -> None:
    # A read's page is kept `read_retention` (15 min); observer.emit had an effect (its
    # intake), so its verdict is kept the whole `ledger_retention`: a late replay must find
    # it and never queue the frames again.
    import sqlite3

    from daemon.state.ledger import request_key

    agent = await broker.human_owned_agent("kept")
    credential = broker.credential(agent, [CHANNEL])
    before = int(time.time())
    await broker.post(emit([("k", "kept")], request_id="obs-kept-1"), credential)
    conn = sqlite3.connect(str(broker.state_dir / "ledger.db"))
    try:
        [(expires,)] = conn.execute(
            "SELECT e.expires FROM entries AS e JOIN principals AS p ON p.id = e.pid"
            " WHERE p.principal = ? AND e.rid = ?", (agent, request_key("obs-kept-1"))).fetchall()
    finally:
        conn.close()
    assert expires >= before + broker.config.state.ledger_retention_seconds
