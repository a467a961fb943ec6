"""Relay faults through the daemon's socket (issue 5 "A scripted relay for faults", end to end).

tests/relay/ proves the relay client maps each fault; here the same faults go through the
whole daemon - HTTP on the Unix socket, sessions, ledger, operations, relay pool - and we
check the verdict envelope the agent receives:

    OK false                  -> failed + action_failed, quoting the relay's reason (final);
                                 a hostile reason is quoted to the agent and the operator
                                 log bounded (200 characters) and printable
    no OK / dropped after EVENT -> indeterminate + outcome_unknown; the identical retry, once
                                 the relay behaves, -> succeeded with the SAME eventId, and
                                 the relay holds the event once
    relay down                -> failed + action_failed (publish and read)
    CLOSED auth-required      -> the daemon authenticates and retries once -> succeeded
    CLOSED restricted         -> failed + action_failed
    a CLOSED or an AUTH refusal a whole frame long, new with every answer -> every log
                                 line stays short (the relay's text cut where the pool
                                 takes it) and a read's line is one a minute however
                                 the relay words it (kept apart by the NIP-01 prefix)
    never EOSE on channel.read -> failed + action_failed
    agents.create refused at its first event -> failed, the minted key destroyed (rollback)
    agents.create silent at its second event -> indeterminate; retry -> succeeded, the
                                 relay holds each of the three events once, one agent
    agents.create refused at its second event -> indeterminate (the first is on the
                                 relay), the key kept; retry -> succeeded
    a resumed agents.create refused at its first event -> indeterminate (an earlier
                                 attempt's event may be on the relay), the key kept;
                                 the next retry -> succeeded
    Buzz's `OK false "duplicate: reaction already exists"` -> a resumed reaction.add the
                                 relay holds (read by id) succeeded, one it does not
                                 hold indeterminate; a fresh one failed, "the reaction
                                 already exists"

Every relay timeout is 1 s; each request must be answered within its timeout plus a margin
(none waits past its timeout). The daemon runs in this process on a real socket
(`daemon.wiring.running` + `daemon.http.serve`), as tests/fixtures/broker.py does.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import coincurve
import pytest
import trio

from custody import TokenConfig
from daemon.log import format_record
from daemon.relay.pool import MAX_FRAME_CHARS
from daemon.relay.protocol import MAX_REASON_CHARS
from daemon.state.directory import AgentDirectory
from daemon.wiring import running
from daemon.config import load_config
from daemon.http import HttpLimits, action_routes, serve
from tests.adversarial._daemon import ALL_ACTIONS, envelope, post, request_body, write_config
from tests.fixtures.relay import free_port
from tests.scripted_relay import EventReply, ReqReply, Script, ScriptedRelay

#: Every relay timeout of the daemon under test (connect, OK, EOSE), seconds.
TIMEOUT = 1.0
#: What a verdict may take beyond the timeout it waited (thread hops, fsync, a slow CI box).
MARGIN = 2.0


@dataclass
class Rig:
    relay: ScriptedRelay
    socket: Path
    agent: str
    credential: str
    state_dir: Path

    async def call(self, action: str, args: dict[str, Any], *,
                   body: bytes | None = None) -> tuple[dict[str, Any], float, bytes]:
        body = body or request_body(action, args)
        began = time.monotonic()
        answer = envelope(await post(self.socket, body, self.credential, timeout=15.0))
        return answer, time.monotonic() - began, body


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bb-rf-") as name:
        yield Path(name)


@pytest.fixture
async def rig(nursery: trio.Nursery, custody_state: tuple[TokenConfig, Path],
              short_dir: Path) -> Callable[..., Awaitable[Rig]]:
    token, state_dir = custody_state

    async def start(script: Script, *, relay_down: bool = False) -> Rig:
        relay = ScriptedRelay(script)
        if relay_down:
            relay.url = f"ws://127.0.0.1:{free_port()}"  # nothing listens there
        else:
            await nursery.start(relay.serve, free_port())
        socket = short_dir / "b.sock"
        config = load_config(str(write_config(
            short_dir / "broker.toml", token=token, state_dir=state_dir, socket=socket,
            relay_url=relay.url, relay_timeout=TIMEOUT)), environ={})
        ready = trio.Event()
        box: list[Rig] = []

        async def run() -> None:
            async with running(config) as app:
                owner = coincurve.PrivateKey().public_key_xonly.format().hex()
                secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
                record = await app.custody.import_agent(secret, owner=owner)
                _, credential = app.sessions.issue(
                    agent=record.pubkey, channels=frozenset({CHANNEL}),
                    actions=frozenset(ALL_ACTIONS), ttl_seconds=None, uid=None,
                    now=int(time.time()))
                box.append(Rig(relay, socket, record.pubkey, credential, state_dir))
                async with trio.open_nursery() as inner:
                    await inner.start(serve, action_routes(app), str(socket),
                                      HttpLimits(request_timeout=30.0, shutdown_grace=2.0))
                    ready.set()
                    await trio.sleep_forever()

        nursery.start_soon(run)
        with trio.fail_after(20):
            await ready.wait()
        return box[0]

    return start


CHANNEL = str(uuid.uuid4())


def _post_args(text: str = "hello") -> dict[str, Any]:
    return {"channelId": CHANNEL, "content": text}


def _code(answer: dict[str, Any]) -> tuple[str, str | None]:
    return answer["status"], answer.get("error", {}).get("code")


#: Success only on the relay's positive acceptance (NIP-BA "Actions"), for a post and for
#: the live signals alike: (action, args).
_ACCEPTANCE_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("message.post", _post_args()),
    ("presence.set", {"status": "online"}),
    ("typing.set", {"channelId": CHANNEL}),
]


@pytest.mark.parametrize("action,args", _ACCEPTANCE_ROWS, ids=[a for a, _ in _ACCEPTANCE_ROWS])
async def test_ok_false_is_failed_action_failed_with_the_reason(
        rig: Any, action: str, args: dict[str, Any]) -> None:
    r: Rig = await rig(Script(default_event=EventReply.REJECT,
                              reject_reason="blocked: scripted refusal 42"))
    answer, took, body = await r.call(action, args)
    assert _code(answer) == ("failed", "action_failed")
    assert "blocked: scripted refusal 42" in answer["error"]["message"]
    assert took < TIMEOUT + MARGIN
    # failed is final: the identical retry replays it, nothing is sent again.
    sent = len([m for m in r.relay.received if m[0] == "EVENT"])
    replay, _, _ = await r.call(action, {}, body=body)
    assert replay == {**answer, "replayed": True}
    assert len([m for m in r.relay.received if m[0] == "EVENT"]) == sent == 1


async def test_a_hostile_reason_is_quoted_bounded_and_printable(
        rig: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker")
    # Terminal escapes, a bidi override, NUL and a line break around a reason far past
    # what is quoted: each unprintable character becomes a space, then the quote is cut.
    hostile = "blocked: \x1b[2J\u202e\x00" + "x" * 5000 + "\r\n"
    r: Rig = await rig(Script(default_event=EventReply.REJECT, reject_reason=hostile))
    answer, _, _ = await r.call("message.post", _post_args())
    assert _code(answer) == ("failed", "action_failed")
    quoted = "blocked:  [2J  " + "x" * (MAX_REASON_CHARS - 15)
    assert answer["error"]["message"] == f"the relay did not accept the event: {quoted}"
    logged = [getattr(rec, "buzz_fields")["reason"] for rec in caplog.records
              if getattr(rec, "buzz_event", None) == "relay.not_accepted"]
    assert logged == [quoted]


async def test_the_quote_is_cut_at_200_characters(rig: Any) -> None:
    # Pins the cut itself (the test above reads it from MAX_REASON_CHARS): a longer one
    # would let a hostile relay fill more of the agent's answer and the operator log.
    r: Rig = await rig(Script(default_event=EventReply.REJECT, reject_reason="y" * 5000))
    answer, _, _ = await r.call("message.post", _post_args())
    assert _code(answer) == ("failed", "action_failed")
    assert answer["error"]["message"] == "the relay did not accept the event: " + "y" * 200


@pytest.mark.parametrize("action,args", _ACCEPTANCE_ROWS, ids=[a for a, _ in _ACCEPTANCE_ROWS])
@pytest.mark.parametrize("fault", [EventReply.SILENT, EventReply.DROP])
async def test_no_ok_is_indeterminate_then_the_retry_succeeds_with_the_same_event(
    rig: Any, fault: EventReply, action: str, args: dict[str, Any],
) -> None:
    r: Rig = await rig(Script(events=(fault,)))  # then ACCEPT: the relay is fixed
    first, took, body = await r.call(action, args)
    assert _code(first) == ("indeterminate", "outcome_unknown")
    assert took < TIMEOUT + MARGIN
    assert r.relay.stored == {}
    retried, took, _ = await r.call(action, {}, body=body)
    assert retried["status"] == "succeeded", retried
    assert "replayed" not in retried  # resumed and finished now, not replayed
    assert took < TIMEOUT + MARGIN
    sent = [m[1]["id"] for m in r.relay.received if m[0] == "EVENT"]
    assert sent == [retried["outcome"]["eventId"]] * 2  # the same event both times
    assert list(r.relay.stored) == [retried["outcome"]["eventId"]]
    replay, _, _ = await r.call(action, {}, body=body)
    assert replay == {**retried, "replayed": True}


async def test_publishes_left_unanswered_are_a_warning_a_minute_not_one_each(
        rig: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A stalled relay (no OK to any EVENT) showed at warning level not at all: each publish
    was an INFO `relay.not_accepted` only. Now its first is a WARNING `relay.outcome_unknown`
    as well, and the rest are counted into the next one (a minute on), as a read's
    `read.relay_unavailable` is."""
    caplog.set_level(logging.INFO, logger="buzz_broker")
    r: Rig = await rig(Script(default_event=EventReply.SILENT))
    posts = 3
    for n in range(posts):
        posted, _, _ = await r.call("message.post", _post_args(f"unanswered {n}"))
        assert _code(posted) == ("indeterminate", "outcome_unknown")

    def lines(event: str) -> list[logging.LogRecord]:
        return [rec for rec in caplog.records if getattr(rec, "buzz_event", None) == event]

    assert len(lines("relay.not_accepted")) == posts  # each request's own line stays
    assert all(rec.levelno == logging.INFO for rec in lines("relay.not_accepted"))
    [warning] = lines("relay.outcome_unknown")
    assert warning.levelno == logging.WARNING
    assert getattr(warning, "buzz_fields")["reason"] == f"no OK within {TIMEOUT}s"


async def test_relay_down_fails_publish_and_read_within_the_connect_timeout(rig: Any) -> None:
    r: Rig = await rig(Script(), relay_down=True)
    posted, took, _ = await r.call("message.post", _post_args())
    assert _code(posted) == ("failed", "action_failed")
    assert took < TIMEOUT + MARGIN
    read, took, _ = await r.call("channel.read", {"channelId": CHANNEL})
    assert _code(read) == ("failed", "action_failed")
    assert took < TIMEOUT + MARGIN


async def test_auth_required_is_answered_and_the_request_succeeds(rig: Any) -> None:
    r: Rig = await rig(Script(require_auth=True))
    posted, _, _ = await r.call("message.post", _post_args("needs auth"))
    assert posted["status"] == "succeeded", posted
    read, _, _ = await r.call("channel.read", {"channelId": CHANNEL})
    assert read["status"] == "succeeded", read
    assert [m["id"] for m in read["outcome"]["messages"]] == [posted["outcome"]["eventId"]]
    assert any(r.agent in c.authed for c in r.relay.connections)


async def test_restricted_read_is_failed_action_failed(rig: Any) -> None:
    r: Rig = await rig(Script(default_req=ReqReply.RESTRICTED))
    read, took, _ = await r.call("channel.read", {"channelId": CHANNEL})
    assert _code(read) == ("failed", "action_failed")
    assert took < TIMEOUT + MARGIN


#: Longest log line a relay's text may make (a line with a MAX_REASON_CHARS quote and its
#: fields is ~500 bytes; a whole frame of text escaped was 6 MB).
MAX_LINE_BYTES = 1024
#: Requests each hostile-text test makes: more than one, so a line per distinct message
#: would show as more than one line.
HOSTILE_REQUESTS = 6


def _frame_long(prefix: str) -> Callable[[int], str]:
    """The n-th answer's message: `prefix`, n (so every answer is new), then line
    separators up to a whole frame (1 Mi characters less the frame's own; each is 3 bytes
    on the wire and 6 in a JSON log line, `printable_json`)."""
    def reason(n: int) -> str:
        head = f"{prefix} {n} "
        return head + "\u2028" * (MAX_FRAME_CHARS - 100 - len(head))
    return reason


def _log_lines(caplog: pytest.LogCaptureFixture) -> list[bytes]:
    """Every line the daemon wrote, as its log handler writes it (`format_record`)."""
    return [format_record(rec).encode("utf-8") for rec in caplog.records
            if rec.name.startswith("buzz_broker")]


def _assert_short(lines: list[bytes]) -> None:
    longest = max(lines, key=len)
    assert len(longest) <= MAX_LINE_BYTES, longest[:300]


async def test_a_frame_long_closed_new_each_time_costs_the_log_one_short_line(
        rig: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker")
    r: Rig = await rig(Script(default_req=ReqReply.RESTRICTED,
                              restricted_reason=_frame_long("restricted:")))
    for _ in range(HOSTILE_REQUESTS):
        read, _, _ = await r.call("channel.read", {"channelId": CHANNEL})
        assert _code(read) == ("failed", "action_failed")
    # A publishing action reads first (its target): the same CLOSED, in its refusal's line.
    reacted, _, _ = await r.call("reaction.add", {
        "channelId": CHANNEL, "targetEventId": "ab" * 32, "reaction": "+"})
    assert _code(reacted) == ("failed", "action_failed")
    assert r.relay.restricted_sent > HOSTILE_REQUESTS  # each answer new, each a frame
    lines = _log_lines(caplog)
    _assert_short(lines)
    # One line for every read refused: they share the prefix `restricted`, whatever the
    # text after it (a line per distinct text was a line per read, each 6 MB).
    refused = [line for line in lines if b'"event":"read.relay_refused"' in line]
    assert len(refused) == 1, refused
    assert re.search(rb'"reason":"restricted: \d+"', refused[0]), refused[0]  # the quote
    assert [line for line in lines if b'"event":"operation.refused"' in line]


async def test_a_frame_long_auth_refusal_new_each_time_costs_the_log_short_lines(
        rig: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker")
    r: Rig = await rig(Script(require_auth=True, accept_auth=False,
                              auth_refusal=_frame_long("blocked:")))
    for _ in range(HOSTILE_REQUESTS):
        read, _, _ = await r.call("channel.read", {"channelId": CHANNEL})
        assert _code(read) == ("failed", "action_failed")
    posted, _, _ = await r.call("message.post", _post_args())
    assert _code(posted) == ("failed", "action_failed")
    assert r.relay.auth_refused > HOSTILE_REQUESTS
    lines = _log_lines(caplog)
    _assert_short(lines)
    refused = [line for line in lines if b'"event":"read.relay_refused"' in line]
    assert len(refused) == 1, refused
    assert re.search(rb"\(AUTH refused: blocked: \d+\)", refused[0]), refused[0]


async def test_never_eose_read_fails_within_the_eose_timeout(rig: Any) -> None:
    r: Rig = await rig(Script(default_req=ReqReply.NEVER_EOSE))
    read, took, _ = await r.call("channel.read", {"channelId": CHANNEL})
    assert _code(read) == ("failed", "action_failed")
    assert took < TIMEOUT + MARGIN
    # A CLOSE follows every REQ, even one abandoned on a timeout.
    reqs = [m[1] for m in r.relay.received if m[0] == "REQ"]
    closes = [m[1] for m in r.relay.received if m[0] == "CLOSE"]
    with trio.fail_after(5):
        while len(closes) < len(reqs):
            await trio.sleep(0.05)
            closes = [m[1] for m in r.relay.received if m[0] == "CLOSE"]
    assert sorted(reqs) == sorted(closes)


def _minted(state_dir: Path, owner: str) -> list[Any]:
    return [a for a in AgentDirectory.open(state_dir).agents(include_deleted=True)
            if a.owner == owner]


async def test_create_refused_at_first_event_fails_and_destroys_the_minted_key(rig: Any) -> None:
    r: Rig = await rig(Script(events=(EventReply.REJECT,)))
    created, _, _ = await r.call("agents.create", {
        "channelId": CHANNEL, "displayName": "Nope", "systemPrompt": "x"})
    assert _code(created) == ("failed", "action_failed")
    minted = _minted(r.state_dir, r.agent)
    assert len(minted) == 1 and minted[0].deleted_at is not None  # tombstone, key destroyed
    assert r.relay.stored == {}


async def test_create_silent_midway_is_indeterminate_then_finished_once(rig: Any) -> None:
    r: Rig = await rig(Script(events=(EventReply.ACCEPT, EventReply.SILENT)))
    first, took, body = await r.call("agents.create", {
        "channelId": CHANNEL, "displayName": "Midway", "systemPrompt": "x"})
    assert _code(first) == ("indeterminate", "outcome_unknown")
    assert took < TIMEOUT + MARGIN
    assert len(r.relay.stored) == 1
    retried, _, _ = await r.call("agents.create", {}, body=body)
    assert retried["status"] == "succeeded", retried
    agent = retried["outcome"]["agentPubkey"]
    assert [a.pubkey for a in _minted(r.state_dir, r.agent)] == [agent]
    stored = list(r.relay.stored.values())
    assert sorted(e["kind"] for e in stored) == [0, 9000, 30177]
    first_ids = [m[1]["id"] for m in r.relay.received if m[0] == "EVENT"][:2]
    assert set(first_ids) <= set(r.relay.stored)  # the retry re-sent the same events


async def test_create_refused_after_an_accepted_event_is_indeterminate_and_keeps_its_key(
        rig: Any) -> None:
    # A fresh plan refused at its second event, the first already on the relay: partial
    # effects exist, so `failed` would lie (and would destroy the key the stored put-user
    # names). `indeterminate` + `outcome_unknown`, the key kept; the retry finishes it.
    r: Rig = await rig(Script(events=(EventReply.ACCEPT, EventReply.REJECT),
                              reject_reason="rate-limited: slow down"))
    first, _, body = await r.call("agents.create", {
        "channelId": CHANNEL, "displayName": "Halfway", "systemPrompt": "x"})
    assert _code(first) == ("indeterminate", "outcome_unknown"), first
    assert "rate-limited: slow down" in first["error"]["message"]
    [put_user] = r.relay.stored.values()
    [minted] = _minted(r.state_dir, r.agent)
    assert minted.live and put_user["kind"] == 9000
    retried, _, _ = await r.call("agents.create", {}, body=body)
    assert retried["status"] == "succeeded" and "replayed" not in retried, retried
    assert retried["outcome"]["agentPubkey"] == minted.pubkey
    assert sorted(e["kind"] for e in r.relay.stored.values()) == [0, 9000, 30177]
    first_ids = [m[1]["id"] for m in r.relay.received if m[0] == "EVENT"][:2]
    assert set(first_ids) <= set(r.relay.stored)  # the same signed events, re-sent


async def test_resumed_create_refused_at_its_first_event_stays_indeterminate(rig: Any) -> None:
    # Attempt 1: the relay stores the put-user (9000) and never answers the 30177. The
    # retry's resend of that 9000 is refused (a relay's rate limit answers before its
    # duplicate check): the relay still holds attempt 1's 9000, so the retry may not
    # answer failed nor destroy the agent that event names.
    r: Rig = await rig(Script(events=(EventReply.ACCEPT, EventReply.SILENT, EventReply.REJECT),
                              reject_reason="rate-limited: slow down"))
    first, _, body = await r.call("agents.create", {
        "channelId": CHANNEL, "displayName": "Midway", "systemPrompt": "x"})
    assert _code(first) == ("indeterminate", "outcome_unknown")
    [put_user] = r.relay.stored.values()
    refused, _, _ = await r.call("agents.create", {}, body=body)
    assert _code(refused) == ("indeterminate", "outcome_unknown"), refused
    assert "rate-limited: slow down" in refused["error"]["message"]
    [minted] = _minted(r.state_dir, r.agent)
    assert minted.live and put_user["kind"] == 9000
    # Not final: the next identical retry (the relay takes events again) finishes it.
    retried, _, _ = await r.call("agents.create", {}, body=body)
    assert retried["status"] == "succeeded" and "replayed" not in retried, retried
    assert retried["outcome"]["agentPubkey"] == minted.pubkey
    assert [a.pubkey for a in _minted(r.state_dir, r.agent) if a.live] == [minted.pubkey]
    assert sorted(e["kind"] for e in r.relay.stored.values()) == [0, 9000, 30177]


# --- Buzz refuses a reaction already active, its own resend included -----------------------


async def _reaction_target(r: Rig) -> dict[str, Any]:
    posted, _, _ = await r.call("message.post", _post_args("react to me"))
    assert posted["status"] == "succeeded", posted
    return {"channelId": CHANNEL, "targetEventId": posted["outcome"]["eventId"],
            "reaction": "\U0001F44D"}


async def test_a_resumed_reaction_the_relay_holds_succeeds_on_its_duplicate_refusal(
        rig: Any) -> None:
    # Attempt 1: Buzz stores the reaction and its OK is lost. The retry re-sends the same
    # bytes and Buzz answers `OK false "duplicate: reaction already exists"` (its reactions
    # upsert runs before its event insert), as it would to every later retry. The host
    # looks the event up by id: the relay holds ours, so the reaction was added.
    r: Rig = await rig(Script(events=(EventReply.ACCEPT, EventReply.LOST_OK),
                              buzz_reactions=True))
    args = await _reaction_target(r)
    first, _, body = await r.call("reaction.add", args)
    assert _code(first) == ("indeterminate", "outcome_unknown"), first
    [reaction] = [e for e in r.relay.stored.values() if e["kind"] == 7]
    retried, took, _ = await r.call("reaction.add", {}, body=body)
    assert retried["status"] == "succeeded" and "replayed" not in retried, retried
    assert retried["outcome"]["eventId"] == reaction["id"]
    assert took < 2 * TIMEOUT + MARGIN
    assert [e["id"] for e in r.relay.stored.values() if e["kind"] == 7] == [reaction["id"]]
    replay, _, _ = await r.call("reaction.add", {}, body=body)
    assert replay == {**retried, "replayed": True}


async def test_a_resumed_reaction_the_relay_does_not_hold_stays_indeterminate(
        rig: Any) -> None:
    # The retry's `duplicate:` refusal names some other reaction (the relay holds none of
    # ours: attempt 1 went unanswered and unstored): nothing proves ours was added.
    r: Rig = await rig(Script(events=(EventReply.ACCEPT, EventReply.SILENT, EventReply.REJECT),
                              reject_reason="duplicate: reaction already exists"))
    args = await _reaction_target(r)
    first, _, body = await r.call("reaction.add", args)
    assert _code(first) == ("indeterminate", "outcome_unknown"), first
    retried, _, _ = await r.call("reaction.add", {}, body=body)
    assert _code(retried) == ("indeterminate", "outcome_unknown"), retried
    assert "duplicate: reaction already exists" in retried["error"]["message"]
    assert not [e for e in r.relay.stored.values() if e["kind"] == 7]


async def test_a_fresh_reaction_already_active_fails_saying_the_reaction_exists(
        rig: Any) -> None:
    # A new request for a reaction this agent already made on that target: nothing of
    # this request took hold, so `failed` (NIP-BA names no other answer), and the agent
    # reads why.
    r: Rig = await rig(Script(buzz_reactions=True))
    args = await _reaction_target(r)
    added, _, _ = await r.call("reaction.add", args)
    assert added["status"] == "succeeded", added
    again, _, _ = await r.call("reaction.add", args)
    assert _code(again) == ("failed", "action_failed"), again
    assert again["error"]["message"].startswith("the reaction already exists"), again
    assert [e["id"] for e in r.relay.stored.values() if e["kind"] == 7] == [
        added["outcome"]["eventId"]]
