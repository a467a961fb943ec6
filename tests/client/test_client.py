"""The agent client against a scripted host: every wrong answer the spec names (I3–I6, [C1]).

Each test scripts what the host answers and then asserts two things: what the client
reported (a verdict, or no answer, exactly as spec §Results and §HTTP binding say), and
what reached the wire (every retry's bytes identical to the first). Every coroutine test
runs twice, on asyncio and on trio (`any_loop`, tests/client/conftest.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import grp
import json
import logging
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any
from dataclasses import replace
from pathlib import Path

import anyio
import anyio.abc
import pytest

from buzz_broker_client import (
    BrokerClient,
    CredentialRefused,
    NotConfigured,
    NothingListening,
    SocketMissing,
    SocketPermissionDenied,
    _transport,
)
from buzz_broker_client._bounds import PAGE_VALUES, response_bytes, response_values
from buzz_broker_client.client import (
    _ECHO_CHECKS,
    AsyncBrokerClient,
    EventVerification,
    Failed,
    FateUnknown,
    Indeterminate,
    NoAnswer,
    NoAnswerReason,
    ReadEnd,
    Result,
    RetryPolicy,
    Succeeded,
    Unsupported,
)
from buzzwire.contract import (
    ACTIONS,
    MAX_PAGE_BYTES,
    AgentsCreateOutcome,
    ContractError,
    ErrorCode,
    Event,
    PublishOutcome,
    ReadOutcome,
    Verdict,
    build_request,
    encode_request,
    encode_response,
    page_bytes,
    parse_response,
)
from buzzwire.jsonvalues import values_at_most
from tests.client.scripted_host import (
    HttpAnswer,
    Received,
    ScriptedHost,
    Signer,
    Step,
    drop,
    errored,
    publish_outcome,
    dumps,
    raw,
    socket_dir,
    stall,
    succeeded,
)

CHANNEL = "5df7dfa8-e919-43df-8efd-f1dcb8af7071"
CREDENTIAL = "bb1.test-credential-9f3c2e10b5d4e8a9c713f2b6d8e4a10"
OTHER = "d31d54af61c73c47053822d496ce341eac337252ee1aa7c41c9751fa3060d121"
pytestmark = pytest.mark.any_loop

FAST = RetryPolicy(max_attempts=3, first_delay=0.001, max_delay=0.005,
                   attempt_seconds=5.0, total_seconds=20.0)

#: FAST's attempts, with room for judging a body at the client's value bound under load.
SLOW_JUDGING = RetryPolicy(max_attempts=3, first_delay=0.001, max_delay=0.005,
                           attempt_seconds=60.0, total_seconds=180.0)


def client(host: ScriptedHost, **kw: object) -> AsyncBrokerClient:
    kw.setdefault("retry", FAST)
    return AsyncBrokerClient(host.path, CREDENTIAL, **kw)  # type: ignore[arg-type]


def assert_identical_retries(host: ScriptedHost, attempts: int) -> None:
    assert len(host.received) == attempts
    assert all(body == host.bodies[0] for body in host.bodies), "a retry re-rendered the request"
    assert len({r.json()["requestId"] for r in host.received}) == 1


async def test_each_run_is_on_the_loop_it_names(loop_backend: str) -> None:
    # Guards the harness in conftest.py: "asyncio" must really be asyncio.
    import sniffio

    assert sniffio.current_async_library() == loop_backend


# ------------------------------------------------------------------ verdicts


async def test_succeeded_sends_frozen_bytes_with_bearer_header(host: ScriptedHost) -> None:
    host.script = [succeeded(None, publish_outcome())]
    c = client(host)
    answer = await c.message_post(f"  {CHANNEL.upper()}  ", "hi  ", mentions=[OTHER.upper()],
                                  request_id="req-1")
    assert isinstance(answer, Succeeded)
    assert isinstance(answer.outcome, PublishOutcome)
    assert (answer.replayed, answer.attempts, answer.request_id) == (False, 1, "req-1")
    [got] = host.received
    assert (got.method, got.target) == (b"POST", b"/v1/action")
    assert got.headers[b"authorization"] == b"Bearer " + CREDENTIAL.encode()
    assert got.headers[b"content-type"] == b"application/json"
    # The body is the contract's one serialization of the normalized request.
    assert got.body == encode_request(c.freeze("message.post", {
        "channelId": CHANNEL, "content": "hi  ", "mentions": [OTHER]}, "req-1"))
    body = got.json()
    assert set(body) == {"type", "protocolVersion", "requestId", "actionVersion", "action", "args"}
    assert body["args"] == {"channelId": CHANNEL, "content": "hi  ", "mentions": [OTHER]}
    assert CREDENTIAL not in got.body.decode()


async def test_absent_members_are_omitted_never_null(host: ScriptedHost) -> None:
    host.script = [succeeded(None, {"messages": []})]
    answer = await client(host).channel_read(CHANNEL)
    assert isinstance(answer, Succeeded)
    assert host.received[0].json()["args"] == {"channelId": CHANNEL}
    assert b"null" not in host.bodies[0]


async def test_http_500_with_valid_envelope_is_that_verdict(host: ScriptedHost) -> None:
    host.script = [errored("failed", "unauthorized", status=500)]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Failed) and answer.code is ErrorCode.UNAUTHORIZED
    assert len(host.received) == 1  # failed is final: never retried


async def test_unauthenticated_is_a_failed_verdict_not_a_transport_error(host: ScriptedHost) -> None:
    host.script = [errored("failed", "unauthenticated", status=401)]
    with pytest.raises(CredentialRefused) as refused:
        await client(host).message_post(CHANNEL, "hi")
    # The verdict rides on the exception: failed, nothing happened, never retried.
    answer = refused.value.answer
    assert isinstance(answer, Failed) and answer.code is ErrorCode.UNAUTHENTICATED
    assert answer.envelope == host.answered[0]
    assert len(host.received) == 1
    assert "credential issue" in str(refused.value) and "BUZZ_BROKER_CREDENTIAL_FILE" in str(refused.value)
    assert CREDENTIAL not in str(refused.value)


async def test_unsupported_is_normal_on_reaction_add_and_failed_elsewhere(host: ScriptedHost) -> None:
    host.script = [errored("failed", "unsupported"), errored("failed", "unsupported")]
    c = client(host)
    reaction = await c.reaction_add(CHANNEL, OTHER, "👍")
    assert isinstance(reaction, Unsupported)
    post = await c.message_post(CHANNEL, "hi")
    assert isinstance(post, Failed) and post.code is ErrorCode.UNSUPPORTED
    assert {spec.name for spec in ACTIONS.values() if spec.best_effort} >= {
        "reaction.add", "presence.set", "typing.set", "observer.emit", "liveness.ping"}


async def test_indeterminate_then_replayed_success_sends_identical_bytes(host: ScriptedHost) -> None:
    host.script = [errored("indeterminate", "outcome_unknown"),
                   succeeded(None, publish_outcome(), replayed=True)]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Succeeded)
    assert answer.replayed is True and answer.attempts == 2
    assert_identical_retries(host, 2)


async def test_indeterminate_every_time_reports_fate_unknown(host: ScriptedHost) -> None:
    host.default = errored("indeterminate", "internal")
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Indeterminate) and isinstance(answer, FateUnknown)
    assert answer.code is ErrorCode.INTERNAL and answer.attempts == 3
    assert_identical_retries(host, 3)


async def test_fate_unknown_can_be_resent_later_with_the_same_bytes(host: ScriptedHost) -> None:
    host.script = [drop(), drop(), drop(), succeeded(None, publish_outcome(), replayed=True)]
    c = client(host)
    first = await c.message_post(CHANNEL, "hi")
    assert isinstance(first, NoAnswer)
    later = await c.send(first.request)
    assert isinstance(later, Succeeded) and later.replayed
    assert_identical_retries(host, 4)


@pytest.mark.parametrize(("dribble", "chunked"), [(True, False), (False, True), (True, True)])
async def test_response_reassembled_whatever_its_framing(
    host: ScriptedHost, dribble: bool, chunked: bool
) -> None:
    def step(got: Received) -> HttpAnswer:
        answer = succeeded(None, publish_outcome())(got)
        assert isinstance(answer, HttpAnswer)
        return replace(answer, dribble=dribble, chunked=chunked)

    host.script = [step]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Succeeded) and answer.envelope == host.answered[0]


async def test_loopback_http_carries_the_same_exchange(task_group: anyio.abc.TaskGroup) -> None:
    host = ScriptedHost(path="")
    port = await task_group.start(host.serve_tcp)
    host.script = [drop(), succeeded(None, publish_outcome(), replayed=True)]
    c = AsyncBrokerClient(f"http://127.0.0.1:{port}", CREDENTIAL, retry=FAST)
    answer = await c.message_post(CHANNEL, "hi")
    assert isinstance(answer, Succeeded) and answer.replayed
    assert host.received[0].headers[b"host"] == f"127.0.0.1:{port}".encode()
    assert_identical_retries(host, 2)


# ------------------------------------------------------------------ no answer (I5)


async def test_dropped_connection_is_retried_then_verdict(host: ScriptedHost) -> None:
    host.script = [drop(), succeeded(None, publish_outcome())]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Succeeded) and answer.attempts == 2
    assert_identical_retries(host, 2)


async def test_dropped_connection_every_time_is_no_answer(host: ScriptedHost) -> None:
    host.default = drop()
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert_identical_retries(host, 3)


async def test_proxy_401_without_envelope_is_no_answer(host: ScriptedHost) -> None:
    host.default = raw(401, b"<html>401 Authorization Required</html>")
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.NO_ENVELOPE
    assert "401" in answer.detail
    assert_identical_retries(host, 3)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(errored("failed", "unauthorized", request_id="someone-else"), id="failed-other-id"),
        pytest.param(succeeded(None, publish_outcome(), requestId="other"), id="succeeded-other-id"),
        pytest.param(succeeded("message.reply", publish_outcome()), id="another-action"),
        pytest.param(succeeded(None, {"messages": []}), id="another-actions-outcome-shape"),
    ],
)
async def test_response_for_another_request_is_no_answer(host: ScriptedHost, step: object) -> None:
    host.default = step  # type: ignore[assignment]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer)
    assert answer.reason in (NoAnswerReason.MISMATCH, NoAnswerReason.NO_ENVELOPE)
    assert_identical_retries(host, 3)


@pytest.mark.parametrize(
    ("status_word", "code"),
    [("failed", "outcome_unknown"), ("indeterminate", "unauthorized"),
     ("indeterminate", "invalid_request"), ("succeeded", "internal")],
)
async def test_forbidden_status_code_pair_is_no_answer(
    host: ScriptedHost, status_word: str, code: str
) -> None:
    host.default = errored(status_word, code)
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(errored("failed", "unauthorized", outcome=None), id="null-outcome-beside-failure"),
        pytest.param(succeeded(None, {**publish_outcome(), "kind": None}), id="null-in-outcome"),
        pytest.param(succeeded(None, publish_outcome(), replayed=False, error=None), id="null-error"),
        pytest.param(succeeded(None, publish_outcome(), extra="x"), id="extra-top-member"),
        pytest.param(succeeded(None, {**publish_outcome(), "secretKey": "00" * 32}), id="extra-outcome-member"),
        pytest.param(errored("failed", "unauthorized", action="message.post"), id="action-beside-failure"),
        pytest.param(raw(200, b'{"type":"broker_result"'), id="truncated-json"),
        pytest.param(raw(200, b""), id="empty-body"),
    ],
)
async def test_malformed_envelope_is_no_answer(host: ScriptedHost, step: object) -> None:
    host.default = step  # type: ignore[assignment]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.NO_ENVELOPE
    assert_identical_retries(host, 3)


async def test_agents_create_echo_compared_as_parsed_identity(host: ScriptedHost) -> None:
    pub = Signer().pubkey
    c = client(host)
    # The channel asked for in another spelling, echoed canonical: a verdict. (An echo
    # that is not canonical is no answer: test_non_canonical_host_output_is_no_answer.)
    host.script = [succeeded(None, {"agentPubkey": pub, "displayName": "Scout",
                                    "channelId": CHANNEL})]
    ok = await c.agents_create(CHANNEL.replace("-", "").upper(), "Scout", "Be brief.")
    assert isinstance(ok, Succeeded) and isinstance(ok.outcome, AgentsCreateOutcome)
    # Another channel is not an answer to this request.
    host.default = succeeded(None, {"agentPubkey": pub, "displayName": "Scout",
                                    "channelId": "6df7dfa8-e919-43df-8efd-f1dcb8af7071"})
    bad = await c.agents_create(CHANNEL, "Scout", "Be brief.")
    assert isinstance(bad, NoAnswer) and bad.reason is NoAnswerReason.MISMATCH


@pytest.mark.parametrize("action", ["agents.update", "agents.delete"])
async def test_agent_target_pubkey_echo(host: ScriptedHost, action: str) -> None:
    target = Signer().pubkey
    c = client(host)
    extra = {"updatedFields": ["displayName"]} if action == "agents.update" else {}
    patch = {"displayName": "New"} if action == "agents.update" else {}

    host.script = [succeeded(None, {"agentPubkey": target, "displayName": "New", **extra})]
    ok = await c.call(action, {"target": {"pubkey": target.upper()}, **patch})
    assert isinstance(ok, Succeeded)

    host.script = [succeeded(None, {"agentPubkey": OTHER, "displayName": "New", **extra})] * 3
    bad = await c.call(action, {"target": {"pubkey": target}, **patch})
    assert isinstance(bad, NoAnswer) and bad.reason is NoAnswerReason.MISMATCH

    # By name the reply cannot be checked (spec I5 Limits): any pubkey is a verdict.
    host.script = [succeeded(None, {"agentPubkey": OTHER, "displayName": "New", **extra})]
    by_name = await c.call(action, {"target": {"name": "Old"}, **patch})
    assert isinstance(by_name, Succeeded)


async def test_storage_address_for_another_author_is_no_answer(host: ScriptedHost) -> None:
    me = Signer().pubkey
    c = client(host, agent_pubkey=me)
    host.script = [succeeded(None, {"authorPubkey": me, "kind": 30174, "dTag": "ab" * 32})]
    assert isinstance(await c.storage_address("core"), Succeeded)
    host.default = succeeded(None, {"authorPubkey": OTHER, "kind": 30174, "dTag": "ab" * 32})
    bad = await c.storage_address("core")
    assert isinstance(bad, NoAnswer) and bad.reason is NoAnswerReason.MISMATCH


async def test_storage_put_of_another_kind_is_no_answer_and_get_reads_the_value(
    host: ScriptedHost
) -> None:
    """NIP-BA: a client checks the published kind per action (storage.put: 30174)."""
    c = client(host)
    host.script = [succeeded(None, {"eventId": "ab" * 32, "kind": 30174, "createdAt": 1})]
    assert isinstance(await c.storage_put("mem/a", "v"), Succeeded)
    host.default = succeeded(None, {"eventId": "ab" * 32, "kind": 9, "createdAt": 1})
    bad = await c.storage_put("mem/a", "v")
    assert isinstance(bad, NoAnswer) and bad.reason is NoAnswerReason.MISMATCH
    host.default = None
    host.script = [succeeded(None, {"value": ""}), succeeded(None, {})]
    got = await c.storage_get("mem/a")
    assert isinstance(got, Succeeded) and got.outcome.value == ""
    absent = await c.storage_get("mem/a")
    assert isinstance(absent, Succeeded) and absent.outcome.value is None


async def test_observer_receipt_must_fit_the_frames_sent(host: ScriptedHost) -> None:
    # NIP-BA: "observer receipts [must fit] the submitted frame count"; more is no answer.
    c = client(host)
    frames = [("acp_read", '{"id":1}'), ("turn_started", "t")]
    host.script = [succeeded(None, {"accepted": 2}), succeeded(None, {"accepted": 0})]
    full = await c.observer_emit(frames)
    assert isinstance(full, Succeeded) and full.outcome.accepted == 2
    none = await c.observer_emit(frames)
    assert isinstance(none, Succeeded) and none.outcome.accepted == 0
    host.default = succeeded(None, {"accepted": 3})
    bad = await c.observer_emit(frames)
    assert isinstance(bad, NoAnswer) and bad.reason is NoAnswerReason.MISMATCH
    sent = json.loads(host.received[0].body)
    assert sent["action"] == "observer.emit" and sent["args"] == {
        "frames": [{"kind": "acp_read", "payload": '{"id":1}'},
                   {"kind": "turn_started", "payload": "t"}]}


async def test_liveness_ping_unsupported_is_normal(host: ScriptedHost) -> None:
    host.script = [errored("failed", "unsupported")]
    answer = await client(host).liveness_ping(CHANNEL, "turn-1")
    assert isinstance(answer, Unsupported)
    assert json.loads(host.received[0].body)["args"] == {"channelId": CHANNEL, "turnId": "turn-1"}


def test_every_action_has_an_echo_check() -> None:
    assert set(_ECHO_CHECKS) == set(ACTIONS)


# ------------------------------------------------------------------ reads (I4, I5)


def page(events: list[dict[str, object]], cursor: str | None = None) -> dict[str, object]:
    out: dict[str, object] = {"messages": events}
    if cursor is not None:
        out["nextCursor"] = cursor
    return out


async def test_read_returns_verified_events(host: ScriptedHost) -> None:
    s = Signer()
    events = [s.event(content=f"m{i}", tags=[["h", CHANNEL]]) for i in range(3)]
    host.script = [succeeded(None, page(events))]
    answer = await client(host).channel_read(CHANNEL, limit=3)
    assert isinstance(answer, Succeeded) and isinstance(answer.outcome, ReadOutcome)
    assert [e.id for e in answer.outcome.messages] == [e["id"] for e in events]
    assert answer.outcome.next_cursor is None


async def test_more_events_than_the_limit_is_no_answer(host: ScriptedHost) -> None:
    s = Signer()
    host.default = succeeded(None, page([s.event(content=f"m{i}", tags=[["h", CHANNEL]])
                                         for i in range(3)]))
    answer = await client(host).channel_read(CHANNEL, limit=2)
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.MISMATCH
    assert_identical_retries(host, 3)


async def test_default_limit_is_the_bound_when_absent(host: ScriptedHost) -> None:
    s = Signer()
    one = s.event(content="x", tags=[["h", CHANNEL]])
    host.default = succeeded(None, page([one] * 101))
    answer = await client(host).channel_read(CHANNEL)
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.MISMATCH


async def test_event_with_bad_signature_is_no_answer_by_default(host: ScriptedHost) -> None:
    s = Signer()
    forged = s.event(content="original", tags=[["h", CHANNEL]])
    forged["content"] = "tampered"  # id and signature no longer match
    host.default = succeeded(None, page([s.event(content="ok", tags=[["h", CHANNEL]]), forged]))
    answer = await client(host).channel_read(CHANNEL)
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.UNVERIFIED_EVENT
    # The caller may choose, by name, to trust the host for authorship.
    trusting = client(host, events=EventVerification.SKIP)
    assert isinstance(await trusting.channel_read(CHANNEL), Succeeded)


def test_events_are_verified_under_python_O() -> None:
    """I4 holds with asserts stripped: verification is buzzwire.nostr's, not an assert."""
    s = Signer()
    good = s.event(content="ok", tags=[["h", CHANNEL]])
    forged = {**s.event(content="original", tags=[["h", CHANNEL]]), "content": "tampered"}
    script = (
        "import json, sys\n"
        "from buzz_broker_client import judge, NoAnswer, Succeeded\n"
        "from buzz_broker_client._transport import HttpReply\n"
        "from buzzwire.contract import ReadOutcome, build_request\n"
        f"request = build_request('channel.read', {{'channelId': {CHANNEL!r}}}, request_id='r1')\n"
        "for events in json.loads(sys.argv[1]):\n"
        "    body = json.dumps({'type': 'broker_result', 'protocolVersion': 1, 'requestId': 'r1',\n"
        "        'status': 'succeeded', 'action': 'channel.read', 'outcome': {'messages': events}})\n"
        "    answer = judge(request, HttpReply(200, body.encode()), ReadOutcome, attempt=1)\n"
        "    print(type(answer).__name__, getattr(answer, 'reason', None))\n"
    )
    done = subprocess.run([sys.executable, "-O", "-c", script, json.dumps([[good], [good, forged]])],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Succeeded None", "NoAnswer NoAnswerReason.UNVERIFIED_EVENT"]


async def test_event_with_extra_or_null_member_is_no_answer(host: ScriptedHost) -> None:
    s = Signer()
    extra = {**s.event(content="x", tags=[["h", CHANNEL]]), "relay": "wss://x"}
    host.script = [succeeded(None, page([extra]))] * 3
    assert isinstance(await client(host).channel_read(CHANNEL), NoAnswer)
    nulled = {**s.event(content="x", tags=[["h", CHANNEL]]), "content": None}
    host.script = [succeeded(None, page([nulled]))] * 3
    assert isinstance(await client(host).channel_read(CHANNEL), NoAnswer)


async def test_event_from_another_channel_or_thread_is_no_answer(host: ScriptedHost) -> None:
    s = Signer()
    root = s.event(content="root", tags=[["h", CHANNEL]])
    elsewhere = s.event(content="x", tags=[["h", "6df7dfa8-e919-43df-8efd-f1dcb8af7071"]])
    host.script = [succeeded(None, page([elsewhere]))] * 3
    assert isinstance(await client(host).channel_read(CHANNEL), NoAnswer)

    in_thread = s.event(content="r", tags=[["h", CHANNEL.upper()], ["e", str(root["id"]), "", "root"]])
    host.script = [succeeded(None, page([root, in_thread]))]
    ok = await client(host).channel_read(CHANNEL, root_event_id=str(root["id"]))
    assert isinstance(ok, Succeeded)
    stray = s.event(content="s", tags=[["h", CHANNEL]])
    host.script = [succeeded(None, page([stray]))] * 3
    assert isinstance(await client(host).channel_read(CHANNEL, root_event_id=str(root["id"])), NoAnswer)


async def test_mentions_only_page_must_mention_me_when_known(host: ScriptedHost) -> None:
    s, me = Signer(), Signer().pubkey
    mention = s.event(content="hey", tags=[["h", CHANNEL], ["p", me]])
    other = s.event(content="hey", tags=[["h", CHANNEL], ["p", OTHER]])
    host.script = [succeeded(None, page([mention]))] + [succeeded(None, page([mention, other]))] * 3
    c = client(host, agent_pubkey=me)
    assert isinstance(await c.channel_read(CHANNEL, mentions_only=True), Succeeded)
    bad = await c.channel_read(CHANNEL, mentions_only=True)
    assert isinstance(bad, NoAnswer) and bad.reason is NoAnswerReason.MISMATCH
    assert host.received[0].json()["args"] == {"channelId": CHANNEL, "mentionsOnly": True}


async def test_read_all_follows_cursors_verbatim_until_absent(host: ScriptedHost) -> None:
    s = Signer()
    pages = [[s.event(content=f"p{p}m{i}", tags=[["h", CHANNEL]]) for i in range(2)] for p in range(3)]
    # Cursors a client must not touch: odd spellings round-trip exactly.
    host.script = [succeeded(None, page(pages[0], "Cur/1+=")),
                   succeeded(None, page(pages[1], "x~Y_z.9")),
                   succeeded(None, page(pages[2]))]
    result = await client(host).read_all(CHANNEL, limit=2)
    assert result.end is ReadEnd.EXHAUSTED and result.pages == 3
    assert [r.json()["args"].get("cursor") for r in host.received] == [None, "Cur/1+=", "x~Y_z.9"]
    assert [e.content for e in result.messages] == [e["content"] for p in pages for e in p]
    assert len({r.json()["requestId"] for r in host.received}) == 3  # one request per page


async def test_read_all_stops_at_seen_event_and_at_max_pages(host: ScriptedHost) -> None:
    s = Signer()
    first = [s.event(content=f"n{i}", tags=[["h", CHANNEL]]) for i in range(2)]
    host.script = [succeeded(None, page(first, "c1")), succeeded(None, page(first, "c2"))]
    stopped = await client(host).read_all(CHANNEL, stop_when=lambda e: e.id == first[1]["id"])
    assert stopped.end is ReadEnd.STOPPED and [e.id for e in stopped.messages] == [first[0]["id"]]
    capped = await client(host).read_all(CHANNEL, max_pages=1)
    assert capped.end is ReadEnd.MAX_PAGES and capped.resume_cursor == "c2"


# ------------------------------------------------------------------ bounds, doors, secrets


async def test_attempt_timeout_is_no_answer(host: ScriptedHost) -> None:
    host.default = stall()
    policy = RetryPolicy(max_attempts=2, first_delay=0.001, attempt_seconds=0.2, total_seconds=5)
    start = anyio.current_time()
    answer = await client(host, retry=policy).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert answer.attempts == 2 and anyio.current_time() - start < 2
    assert_identical_retries(host, 2)


async def test_total_time_bounds_the_attempts(host: ScriptedHost) -> None:
    host.default = stall()
    policy = RetryPolicy(max_attempts=50, first_delay=0.01, attempt_seconds=5, total_seconds=0.3)
    start = anyio.current_time()
    answer = await client(host, retry=policy).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and anyio.current_time() - start < 1.5
    assert answer.attempts < 50


async def test_no_socket_is_socket_missing_after_the_retries(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    c = AsyncBrokerClient("/tmp/bbc-nonexistent/broker.sock", CREDENTIAL, retry=FAST)
    with pytest.raises(SocketMissing) as missing:
        await c.message_post(CHANNEL, "hi")
    message = str(missing.value)
    assert "no broker socket at unix:/tmp/bbc-nonexistent/broker.sock" in message
    assert "BUZZ_BROKER_SOCKET" in message and "start buzz-broker" in message
    # Retried first (a restarting broker has no socket for a moment), then told.
    assert caplog.text.count("retrying identical bytes") == FAST.max_attempts - 1


async def test_socket_file_with_nobody_listening_is_nothing_listening() -> None:
    directory = socket_dir()
    path = f"{directory}/broker.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # bound, never listening: what a killed broker leaves behind
    try:
        with pytest.raises(NothingListening) as refused:
            await AsyncBrokerClient(path, CREDENTIAL, retry=FAST).message_post(CHANNEL, "hi")
    finally:
        stale.close()
        shutil.rmtree(directory)
    assert "nothing is listening" in str(refused.value) and "not running" in str(refused.value)
    assert not isinstance(refused.value, SocketMissing)


async def test_loopback_port_with_nobody_listening_is_nothing_listening(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a port that was free a moment ago: nobody listens on it
    with pytest.raises(NothingListening) as refused:
        await AsyncBrokerClient(f"http://127.0.0.1:{port}", CREDENTIAL,
                                retry=FAST).message_post(CHANNEL, "hi")
    assert f"http://127.0.0.1:{port}" in str(refused.value)
    assert "broker unreachable, nothing sent" in caplog.text and "fate unknown" not in caplog.text


async def test_lost_request_then_missing_socket_is_fate_unknown(host: ScriptedHost) -> None:
    # The first attempt reached the host, which vanished mid-request: its fate is unknown,
    # so the later "no socket" attempts must not turn that into "nothing happened".
    def vanish(got: Received) -> object:
        os.unlink(host.path)
        return drop()(got)

    host.script = [vanish]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert answer.attempts == FAST.max_attempts and len(host.received) == 1


async def test_credential_refused_after_indeterminate_is_fate_unknown(host: ScriptedHost) -> None:
    # The host may have published on the first attempt; the credential then expired. The
    # host checks credentials before its record and records no refusal, so the refusal
    # says nothing about the first attempt: "nothing happened" would invite a second post.
    host.script = [errored("indeterminate", "outcome_unknown"), errored("failed", "unauthenticated")]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Indeterminate) and answer.code is ErrorCode.OUTCOME_UNKNOWN
    assert answer.envelope == host.answered[0]
    assert answer.attempts == 2
    assert_identical_retries(host, 2)  # no retry after the refusal: none can cure it


async def test_credential_refused_after_a_dropped_attempt_is_fate_unknown(host: ScriptedHost) -> None:
    host.script = [drop(), errored("failed", "unauthenticated")]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert answer.attempts == 2
    assert_identical_retries(host, 2)


async def test_credential_refused_on_the_first_attempt_is_still_credential_refused(
        host: ScriptedHost) -> None:
    # Nothing reached the host before: the refusal is the whole truth about this call.
    host.script = [errored("failed", "unauthenticated")]
    with pytest.raises(CredentialRefused):
        await client(host).message_post(CHANNEL, "hi")
    assert len(host.received) == 1


async def test_unreplayed_internal_failure_after_indeterminate_is_fate_unknown(
        host: ScriptedHost) -> None:
    # failed + internal from a fault before the host read its record (custody, the
    # ledger's database) speaks for that attempt only; the retries go on.
    host.script = [errored("indeterminate", "outcome_unknown"), errored("failed", "internal"),
                   errored("failed", "internal")]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Indeterminate) and answer.envelope == host.answered[0]
    assert answer.attempts == FAST.max_attempts
    assert_identical_retries(host, FAST.max_attempts)


async def test_replayed_internal_failure_after_a_drop_is_the_recorded_verdict(
        host: ScriptedHost) -> None:
    # `replayed` means the host's record of this request holds that failure: it is final.
    host.script = [drop(), errored("failed", "internal", replayed=True)]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Failed) and answer.code is ErrorCode.INTERNAL
    assert answer.attempts == 2


async def test_internal_failure_on_the_first_attempt_is_failed(host: ScriptedHost) -> None:
    host.script = [errored("failed", "internal")]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Failed) and answer.code is ErrorCode.INTERNAL
    assert len(host.received) == 1


def test_socket_permission_problem_is_its_own_error(tmp_path: Path) -> None:
    """A real EACCES from the kernel: the socket is mode 0000 and the client runs without
    the root capability that would bypass it (or as a user that is not root)."""
    directory = socket_dir()
    path = f"{directory}/broker.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    os.chmod(path, 0)
    script = _permission_agent(tmp_path, path)
    prefix = (["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
              if os.geteuid() == 0 else [])
    try:
        done = subprocess.run([*prefix, sys.executable, str(script)], capture_output=True,
                              text=True, timeout=60, check=False)
    finally:
        listener.close()
        shutil.rmtree(directory)
    assert done.returncode == 3, done.stderr
    assert f"permission denied on the broker socket unix:{path}" in done.stdout
    assert "server.socket_group" in done.stdout and CREDENTIAL not in done.stdout + done.stderr


def _permission_agent(tmp_path: Path, path: str) -> Path:
    """An agent script posting over `path` that prints a SocketPermissionDenied, exit 3."""
    script = tmp_path / "agent.py"
    script.write_text(
        "import sys\n"
        "from buzz_broker_client import BrokerClient, SocketPermissionDenied\n"
        f"client = BrokerClient({path!r}, {CREDENTIAL!r})\n"
        "try:\n"
        f"    client.message_post({CHANNEL!r}, 'hi')\n"
        "except SocketPermissionDenied as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    return script


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory owned by another user needs root to make")
@pytest.mark.parametrize("mode", [0o700, 0o750])
def test_a_closed_directory_above_the_socket_is_named_not_the_socket_group(
        tmp_path: Path, mode: int) -> None:
    """A real EACCES from a directory above a socket the user could open (0660, its own):
    the demo's run/ as root (0700), or /run/buzz-broker (0750, group buzz-agents). The
    message names that directory and the fix its mode allows; the client runs without the
    root capabilities that would bypass it, and the directory belongs to another user."""
    nobody = pwd.getpwnam("nobody")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    closed = f"{socket_dir()}/closed"
    os.mkdir(closed)
    path = f"{closed}/broker.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    os.chmod(path, 0o660)
    os.chown(closed, nobody.pw_uid, nobody.pw_gid)
    os.chmod(closed, mode)
    script = _permission_agent(tmp_path, path)
    try:
        done = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--",
                               sys.executable, str(script)], capture_output=True, text=True,
                              timeout=60, check=False)
    finally:
        listener.close()
        shutil.rmtree(os.path.dirname(closed))
    assert done.returncode == 3, done.stderr
    said = done.stdout
    assert said.startswith(f"permission denied on the broker socket unix:{path}: "
                           f"the directory {closed} above it (mode {mode:04o}, owner nobody, "
                           f"group {group}) does not let this user through"), said
    if mode == 0o700:
        assert "its mode, not the socket's group, is the problem" in said
        assert "server.socket_group" not in said and "start a new login session" not in said
    else:
        assert f"add the agent's user to group {group} and start a new login session" in said
    assert CREDENTIAL not in done.stdout + done.stderr


async def test_contract_violation_raises_and_sends_nothing(host: ScriptedHost) -> None:
    c = client(host)
    for bad in (
        lambda: c.message_post("not-a-uuid", "hi"),
        lambda: c.message_post(CHANNEL, ""),
        lambda: c.channel_read(CHANNEL, limit=501),
        lambda: c.agents_delete(target_pubkey=OTHER, target_name="both"),
        lambda: c.call("sign", {"event": {}}),
        lambda: c.call("message.post", {"channelId": CHANNEL, "content": "hi", "owner": OTHER}),
        lambda: c.message_post(CHANNEL, "hi", request_id="has space"),
    ):
        with pytest.raises(ContractError):
            await bad()
    assert host.received == []


@pytest.mark.parametrize(
    "address",
    ["http://10.0.0.1:8080", "http://example.com", "http://192.168.1.2", "https://127.0.0.1:1",
     "ftp://127.0.0.1", "unix://host/x.sock", "http://127.0.0.1/v1/action",
     "http://[::ffff:10.0.0.1]:80", "http://0.0.0.0:80", ""],
)
def test_plain_http_is_refused_except_to_loopback(address: str) -> None:
    with pytest.raises(ValueError):
        AsyncBrokerClient(address, CREDENTIAL)


@pytest.mark.parametrize(
    "address", ["http://127.0.0.1:8080", "http://127.9.9.9", "http://[::1]:80",
                "http://localhost:1", "http://LOCALHOST:2/", "/run/b.sock", "unix:/run/b.sock",
                "relative/b.sock"],
)
def test_loopback_and_sockets_are_accepted(address: str) -> None:
    AsyncBrokerClient(address, CREDENTIAL)


#: The longest socket path sockaddr_un holds: 107 bytes and its NUL.
LONGEST_SOCKET = "/tmp/" + "x" * 97 + ".sock"


@pytest.mark.parametrize("address", [
    LONGEST_SOCKET[:-5] + "x.sock", "unix:" + LONGEST_SOCKET[:-5] + "x.sock",
    "/tmp/" + "é" * 50 + ".sock", "x" * 100 + ".sock", "/tmp/a\x00b.sock",
], ids=["108-bytes", "unix-108-bytes", "108-bytes-of-utf8", "relative-made-long", "nul"])
def test_a_socket_path_no_socket_can_have_is_refused_at_construction(
        address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # It could only ever fail to connect, and nothing would have left: refused where it is
    # read, as a setup error saying why, rather than a call's "fate unknown" (NoAnswer).
    monkeypatch.chdir("/tmp")  # a relative path is measured as the absolute one it becomes
    assert len(LONGEST_SOCKET.encode()) == 107
    AsyncBrokerClient(LONGEST_SOCKET, CREDENTIAL)
    AsyncBrokerClient("unix:" + LONGEST_SOCKET, CREDENTIAL)
    with pytest.raises(ValueError) as refused:
        AsyncBrokerClient(address, CREDENTIAL)
    message = str(refused.value)
    assert address.strip("/").split("/")[-1][:20] not in message  # the path is not echoed
    assert ("107 bytes" in message) if "\x00" not in address else ("NUL" in message)


def test_the_socket_path_bound_is_the_hosts() -> None:
    # The client cannot import the daemon: its bound is its own, held to the host's here.
    from buzz_broker_client import _transport
    from daemon import config, http

    assert _transport.MAX_SOCKET_PATH_BYTES == http.MAX_SOCKET_PATH_BYTES == config.MAX_SOCKET_PATH_BYTES


@pytest.mark.parametrize("bad", ["", "has space", "new\nline", "é" * 3, "x" * 2000])
def test_malformed_credential_refused_without_quoting_it(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        AsyncBrokerClient("/run/b.sock", bad)
    assert not bad or bad not in str(info.value)


async def test_credential_never_in_repr_results_or_logs(
    host: ScriptedHost, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    host.script = [drop(), errored("indeterminate", "outcome_unknown"),
                   succeeded(None, publish_outcome(), replayed=True)]
    c = client(host)
    answer = await c.message_post(CHANNEL, "hi")
    assert isinstance(answer, Succeeded)
    seen = " ".join([repr(c), str(c), repr(BrokerClient(host.path, CREDENTIAL)), repr(answer),
                     caplog.text, repr(c.__dict__)])
    assert CREDENTIAL not in seen
    assert "retrying" in caplog.text  # the retries were logged, by request id
    assert answer.request_id in caplog.text


async def test_sync_client_is_the_same_client(host: ScriptedHost) -> None:
    host.script = [errored("indeterminate", "outcome_unknown"),
                   succeeded(None, publish_outcome(), replayed=True),
                   errored("failed", "unsupported")]
    sync = BrokerClient(host.path, CREDENTIAL, retry=FAST)
    answer = await anyio.to_thread.run_sync(lambda: sync.message_post(CHANNEL, "hi"))
    assert isinstance(answer, Succeeded) and answer.replayed and answer.attempts == 2
    assert_identical_retries(host, 2)
    reaction = await anyio.to_thread.run_sync(lambda: sync.reaction_add(CHANNEL, OTHER, "+"))
    assert isinstance(reaction, Unsupported)


def test_base_answer_types_are_not_answers() -> None:
    with pytest.raises(TypeError):
        FateUnknown(request_id="r", action="message.post", attempts=1, request=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Result(request_id="r", action="message.post", attempts=1)


def test_retry_policy_rejects_nonsense() -> None:
    for bad in ({"max_attempts": 0}, {"first_delay": -1}, {"multiplier": 0.5},
                {"attempt_seconds": 0}, {"total_seconds": -1}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


@pytest.mark.parametrize("bad", [
    {"total_seconds": float("inf")}, {"total_seconds": float("nan")},
    {"attempt_seconds": float("inf")}, {"attempt_seconds": float("nan")},
    {"first_delay": float("nan")}, {"max_delay": float("inf")}, {"multiplier": float("nan")},
    {"max_attempts": 10**9}, {"max_attempts": 101}, {"max_attempts": 2.5}, {"max_attempts": True},
    {"first_delay": 0.0}, {"first_delay": 0.0, "multiplier": 1.0},
], ids=str)
def test_retry_policy_refuses_an_unbounded_retry_loop(bad: dict[str, Any]) -> None:
    # NIP-BA: "clients MUST use bounded backoff, not an unbounded retry loop".
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


def test_retry_policy_bounds_still_admit_what_is_bounded() -> None:
    RetryPolicy(max_attempts=1, first_delay=0.0)  # no retry, so no wait needed
    RetryPolicy(max_attempts=100, first_delay=0.001, multiplier=1.0, max_delay=0.001)


# ------------------------------------------------------------------ what Buzz's client tolerates


def _replayed_false(got: Received) -> HttpAnswer:
    env = {"type": "broker_result", "protocolVersion": 1, "requestId": got.json()["requestId"],
           "status": "succeeded", "action": "message.post", "outcome": publish_outcome(),
           "replayed": False}
    return HttpAnswer(200, dumps(env))


async def test_replayed_false_is_read_as_absent(host: ScriptedHost) -> None:
    # wire-schema.md "What Buzz's client tolerates": the reference client reads the member
    # with a default. The host must still omit it: the contract's strict reading (the one
    # the daemon's own tests use) refuses it, and only the client chooses to accept it.
    host.script = [_replayed_false]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Succeeded) and answer.replayed is False and answer.attempts == 1
    with pytest.raises(ContractError):
        parse_response(host.answered[0])
    assert parse_response(host.answered[0], accept_replayed_false=True).replayed is False


@pytest.mark.parametrize("value", ["false", "0", '"false"', "null"])
async def test_replayed_other_than_true_or_false_is_still_no_answer(
    host: ScriptedHost, value: str
) -> None:
    def step(got: Received) -> HttpAnswer:
        body = _replayed_false(got).body.replace(b'"replayed":false', f'"replayed":{value}'.encode())
        return HttpAnswer(200, body)

    host.default = step
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Succeeded if value == "false" else NoAnswer)


# ------------------------------------------------------------------ environment defaults


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("BUZZ_BROKER_SOCKET", "BUZZ_BROKER_CREDENTIAL", "BUZZ_BROKER_CREDENTIAL_FILE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


async def test_socket_and_credential_from_the_environment(
    host: ScriptedHost, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("BUZZ_BROKER_SOCKET", host.path)
    clean_env.setenv("BUZZ_BROKER_CREDENTIAL", CREDENTIAL)
    host.script = [succeeded(None, publish_outcome())]
    assert isinstance(await AsyncBrokerClient(retry=FAST).message_post(CHANNEL, "hi"), Succeeded)
    assert host.received[0].headers[b"authorization"] == b"Bearer " + CREDENTIAL.encode()


async def test_credential_file_from_the_environment(
    host: ScriptedHost, clean_env: pytest.MonkeyPatch, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "credential"
    path.write_text(CREDENTIAL + "\n")
    path.chmod(0o400)
    clean_env.setenv("BUZZ_BROKER_SOCKET", host.path)
    clean_env.setenv("BUZZ_BROKER_CREDENTIAL_FILE", str(path))
    host.script = [succeeded(None, publish_outcome())]
    assert isinstance(await AsyncBrokerClient(retry=FAST).message_post(CHANNEL, "hi"), Succeeded)
    assert host.received[0].headers[b"authorization"] == b"Bearer " + CREDENTIAL.encode()
    assert "readable by others" not in caplog.text
    path.chmod(0o644)
    AsyncBrokerClient()
    assert "readable by others (mode 0644)" in caplog.text and CREDENTIAL not in caplog.text


def test_address_defaults_to_the_brokers_default_socket(clean_env: pytest.MonkeyPatch) -> None:
    c = AsyncBrokerClient(credential=CREDENTIAL)
    assert repr(c) == "AsyncBrokerClient('unix:/run/buzz-broker/broker.sock', credential=<redacted>)"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "no credential: set $BUZZ_BROKER_CREDENTIAL_FILE to the file the operator handed "
             "this agent (or $BUZZ_BROKER_CREDENTIAL), or pass credential_file="),
        ({"BUZZ_BROKER_CREDENTIAL": CREDENTIAL, "BUZZ_BROKER_CREDENTIAL_FILE": "/x"}, "set only one"),
        ({"BUZZ_BROKER_CREDENTIAL_FILE": "/tmp/bbc-nonexistent/credential"},
         "cannot read credential file /tmp/bbc-nonexistent/credential: there is no such file"),
    ],
)
def test_missing_or_ambiguous_credential_says_what_to_do(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(NotConfigured) as info:
        AsyncBrokerClient("/run/b.sock")
    assert expected in str(info.value) and CREDENTIAL not in str(info.value)


#: What the broker issues: `bzb_` and 43 base64url characters (daemon/state/sessions.py).
TOKEN = "bzb_Qm9ndXMtdG9rZW4tZm9yLXRlc3RzLW9ubHktMDEyMzQ"


@pytest.mark.parametrize("where", ["environment", "argument"])
@pytest.mark.parametrize("mistake", [TOKEN, f" {TOKEN}\n", f"Bearer {TOKEN}", TOKEN[:30]],
                         ids=["token", "padded", "header", "truncated"])
def test_a_credential_where_its_file_goes_is_never_echoed(
    clean_env: pytest.MonkeyPatch, where: str, mistake: str
) -> None:
    # A harness that put the token itself in BUZZ_BROKER_CREDENTIAL_FILE (or credential_file=)
    # logs this exception; it must say what is wrong without carrying the token.
    if where == "environment":
        clean_env.setenv("BUZZ_BROKER_CREDENTIAL_FILE", mistake)
    with pytest.raises(NotConfigured) as info:
        AsyncBrokerClient("/run/b.sock",
                          credential_file=mistake if where == "argument" else None)
    message = str(info.value)
    assert "looks like a credential" in message and "BUZZ_BROKER_CREDENTIAL_FILE" in message
    assert TOKEN[4:24] not in message


@pytest.mark.parametrize("where", ["environment", "argument"])
@pytest.mark.parametrize("mistake", [TOKEN, f" {TOKEN}\n", f"Bearer {TOKEN}", TOKEN[:30]],
                         ids=["token", "padded", "header", "truncated"])
async def test_a_credential_where_the_socket_goes_is_never_echoed(
    clean_env: pytest.MonkeyPatch, where: str, mistake: str
) -> None:
    # The same swap for the address (BUZZ_BROKER_SOCKET or address=): a path is still
    # tried, but neither the client's repr nor the setup error it ends in carries the token.
    if where == "environment":
        clean_env.setenv("BUZZ_BROKER_SOCKET", mistake)
    address = mistake if where == "argument" else None
    c = AsyncBrokerClient(address, CREDENTIAL, retry=RetryPolicy(max_attempts=1))
    with pytest.raises(SocketMissing) as missing:
        await c.message_post(CHANNEL, "hi")
    shown = [repr(c), repr(c.__dict__), repr(BrokerClient(address, CREDENTIAL)),
             str(missing.value), missing.value.where]
    assert not any(TOKEN[4:24] in s for s in shown), shown
    assert "looks like a credential" in str(missing.value)
    assert "BUZZ_BROKER_SOCKET" in str(missing.value)


def test_the_credential_shape_the_client_hides_is_the_one_the_host_issues() -> None:
    # The client cannot import the daemon: its pattern is its own, held to the host's here.
    import secrets

    from buzz_broker_client import _env
    from daemon.state import sessions

    issued = sessions.TOKEN_PREFIX + secrets.token_urlsafe(sessions._TOKEN_BYTES)
    assert sessions._TOKEN_RE.fullmatch(issued) and _env._CREDENTIAL_LIKE.fullmatch(issued)
    assert _env._CREDENTIAL_LIKE.fullmatch(TOKEN)


def test_a_file_whose_name_looks_like_a_token_is_still_read(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    # Only messages hide such a name; the file is used like any other.
    path = tmp_path / TOKEN
    path.write_text(CREDENTIAL)
    path.chmod(0o400)
    clean_env.setenv("BUZZ_BROKER_CREDENTIAL_FILE", str(path))
    AsyncBrokerClient("/run/b.sock")
    path.write_text("")
    with pytest.raises(NotConfigured) as info:
        AsyncBrokerClient("/run/b.sock")
    assert "is empty" in str(info.value) and TOKEN not in str(info.value)


# ------------------------------------------------------------------ the blocking facade


@contextlib.contextmanager
def served_elsewhere(host: ScriptedHost) -> Iterator[None]:
    """Serve `host` on a loop in another thread, for callers that block their own loop."""
    with anyio.from_thread.start_blocking_portal() as portal:
        future, _ = portal.start_task(host.serve)
        try:
            yield
        finally:
            future.cancel()


def test_blocking_client_from_many_threads_at_once(host: ScriptedHost) -> None:
    host.default = succeeded(None, publish_outcome())
    results: list[object] = []
    with served_elsewhere(host), BrokerClient(host.path, CREDENTIAL, retry=FAST) as sync:
        threads = [threading.Thread(target=lambda i=i: results.append(
            sync.message_post(CHANNEL, f"from thread {i}"))) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        loop_thread = sync._loop._thread
        assert loop_thread is not None and loop_thread.is_alive() and loop_thread.daemon
    assert not loop_thread.is_alive()  # close() stopped the private loop
    assert len(results) == 8 and all(isinstance(r, Succeeded) for r in results)
    assert sorted(r.json()["args"]["content"] for r in host.received) == sorted(
        f"from thread {i}" for i in range(8))


@pytest.mark.parametrize("runner", ["asyncio", "trio"])
def test_blocking_client_inside_a_running_event_loop(host: ScriptedHost, runner: str) -> None:
    """Called straight from a coroutine of a running asyncio (or trio) program: no nested
    `asyncio.run`/`trio.run`, no "cannot be called from a running event loop"."""
    host.script = [errored("indeterminate", "outcome_unknown"),
                   succeeded(None, publish_outcome(), replayed=True)]
    sync = BrokerClient(host.path, CREDENTIAL, retry=FAST)

    async def agent() -> object:
        return sync.message_post(CHANNEL, "hi")  # blocking, on purpose, inside the loop

    with served_elsewhere(host), sync:
        if runner == "asyncio":
            answer = asyncio.run(agent())
        else:
            import trio

            answer = trio.run(agent)
    assert isinstance(answer, Succeeded) and answer.replayed and answer.attempts == 2
    assert_identical_retries(host, 2)


def test_close_cancels_a_call_waiting_in_another_thread(host: ScriptedHost) -> None:
    """`BrokerClient.close`'s promise: a call still waiting (here on a host that never
    answers) gets `CancelledError` in its own thread, at once, not at its deadline."""
    host.default = stall()
    sync = BrokerClient(host.path, CREDENTIAL, retry=RetryPolicy(
        max_attempts=1, attempt_seconds=60.0, total_seconds=60.0))
    raised: list[BaseException] = []

    def call() -> None:
        try:
            sync.message_post(CHANNEL, "never answered")
        except BaseException as exc:  # noqa: BLE001 - what the waiting thread saw is the test
            raised.append(exc)

    with served_elsewhere(host):
        waiting = threading.Thread(target=call)
        waiting.start()
        deadline = time.monotonic() + 10
        while not host.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host.received  # the call is in its wait for the answer
        sync.close()
        waiting.join(timeout=10)
    assert not waiting.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], concurrent.futures.CancelledError)


def test_an_unclosed_blocking_clients_loop_stops_when_it_is_collected(host: ScriptedHost) -> None:
    """The module's promise: a client dropped without `close()` does not leave its loop's
    thread running for the life of the process."""
    host.default = succeeded(None, publish_outcome())
    with served_elsewhere(host):
        sync = BrokerClient(host.path, CREDENTIAL, retry=FAST)
        assert isinstance(sync.message_post(CHANNEL, "hi"), Succeeded)
        loop_thread = sync._loop._thread
        assert loop_thread is not None and loop_thread.is_alive()
        del sync
        gc.collect()
        loop_thread.join(timeout=10)
    assert not loop_thread.is_alive()


def test_blocking_client_raises_what_the_async_one_raises() -> None:
    with BrokerClient("/tmp/bbc-nonexistent/broker.sock", CREDENTIAL, retry=FAST) as sync:
        with pytest.raises(SocketMissing):
            sync.message_post(CHANNEL, "hi")
        with pytest.raises(ContractError):
            sync.message_post("not-a-uuid", "hi")


@pytest.mark.parametrize("cls", [AsyncBrokerClient, BrokerClient])
@pytest.mark.parametrize("refused", [{"address": "http://example.org:8080"},
                                     {"agent_pubkey": "npub1notahexkey"}],
                         ids=["remote-address", "agent-pubkey"])
def test_a_client_that_failed_to_construct_still_renders_with_its_locals(
    cls: type[AsyncBrokerClient | BrokerClient], refused: dict[str, str]
) -> None:
    # A crash reporter that renders traceback locals (Sentry, pytest --showlocals,
    # traceback's capture_locals) calls repr on the half-built `self` in the failed
    # `__init__`'s frame; a repr that raised there would lose the agent's report.
    with pytest.raises(ValueError) as info:
        cls(refused.get("address", "/run/b.sock"), CREDENTIAL,
            agent_pubkey=refused.get("agent_pubkey"))
    rendered = "".join(
        traceback.TracebackException.from_exception(info.value, capture_locals=True).format())
    assert f"self = {cls.__name__}(" in rendered and "credential=<redacted>)" in rendered


# ------------------------------------------------------------------ installable alone


#: Each agent-side distribution's folder -> what its modules may import besides the stdlib
#: (its own packages and the dependencies its pyproject.toml declares): client/ is
#: buzz-broker-client (anyio, h11, and buzz-broker-wire for buzzwire), buzzwire/ is
#: buzz-broker-wire (coincurve).
AGENT_SIDE = {"client": frozenset({"buzz_broker_client", "buzzwire", "anyio", "h11"}),
              "buzzwire": frozenset({"buzzwire", "coincurve"})}


@pytest.mark.parametrize("folder", sorted(AGENT_SIDE))
def test_the_client_distribution_imports_only_its_declared_dependencies(folder: str) -> None:
    """What client/pyproject.toml and buzzwire/pyproject.toml ship imports the stdlib, their
    own packages and the dependencies they declare: never custody, the daemon, trio or
    python-pkcs11. (The fresh venv of tests/docs/test_agents_doc.py proves the same by
    running without them.)"""
    import ast

    allowed = set(sys.stdlib_module_names) | AGENT_SIDE[folder]
    root = Path(__file__).resolve().parent.parent.parent / folder
    seen: set[str] = set()
    for path in sorted(root.glob("**/*.py")):
        if {"build", "__pycache__"} & set(path.relative_to(root).parts):
            continue  # pip's in-tree build copies
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                seen.add(top)
                assert top in allowed, f"{path.relative_to(root)} imports {name}"
    assert AGENT_SIDE[folder] - {"buzz_broker_client"} <= seen


#: (method call, the kind NIP-BA says the action publishes)
LIVE_CALLS = [
    ("presence.set", lambda c: c.presence_set(" away "), 20001),
    ("typing.set", lambda c: c.typing_set(CHANNEL.upper()), 20002),
    # This host answers it unsupported, but NIP-BA lets another offer it: NIP-AO telemetry.
    ("liveness.ping", lambda c: c.liveness_ping(CHANNEL, " turn-1 "), 24200),
]


@pytest.mark.parametrize("action,call,kind", LIVE_CALLS, ids=[a for a, _, _ in LIVE_CALLS])
async def test_live_signals_check_the_kind_and_carry_on_after_unsupported(
        host: ScriptedHost, action: str, call: Any, kind: int) -> None:
    c = client(host)
    host.script = [succeeded(None, publish_outcome(kind))]
    ok = await call(c)
    assert isinstance(ok, Succeeded) and ok.outcome.kind == kind
    sent = host.received[-1].json()
    assert sent["action"] == action
    assert sent["args"] in ({"status": "away"}, {"channelId": CHANNEL.lower()},
                            {"channelId": CHANNEL, "turnId": "turn-1"})
    # A Published outcome of another kind is not an answer to this request (NIP-BA: a
    # client checks the kind per action); the client retries, then reports no answer.
    host.script = [succeeded(None, publish_outcome(9))] * 4
    wrong = await call(c)
    assert isinstance(wrong, NoAnswer) and wrong.reason is NoAnswerReason.MISMATCH
    # Best effort: unsupported is a normal answer.
    host.script = [errored("failed", "unsupported")]
    assert isinstance(await call(c), Unsupported)


async def test_a_post_reporting_another_kind_is_no_answer(host: ScriptedHost) -> None:
    host.script = [succeeded(None, publish_outcome(20002))] * 4
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.MISMATCH


# ------------------------------------------------------------------ earlier uncertainty is kept

#: Refusals a retry cannot change: the call stops at the first, answering the earlier fate.
STOPPING_CODES = ["unauthenticated", "unauthorized", "request_id_conflict"]
#: Other refusals: they say nothing about the earlier attempt either; the retries go on.
RETRIED_CODES = ["action_failed", "invalid_request", "unsupported", "internal", "unknown_action"]


@pytest.mark.parametrize("first", ["drop", "indeterminate"])
@pytest.mark.parametrize("code", STOPPING_CODES + RETRIED_CODES)
async def test_a_refused_retry_keeps_the_earlier_uncertainty(
        host: ScriptedHost, first: str, code: str) -> None:
    # NIP-BA: "A refusal of a retry does not undo or disprove earlier execution [...]
    # Clients with earlier uncertainty MUST retain it." The first attempt may have posted.
    opening = drop() if first == "drop" else errored("indeterminate", "outcome_unknown")
    host.script = [opening]
    host.default = errored("failed", code)
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, FateUnknown)
    if first == "drop":
        assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    else:
        assert isinstance(answer, Indeterminate) and answer.envelope == host.answered[0]
    attempts = 2 if code in STOPPING_CODES else FAST.max_attempts
    assert answer.attempts == attempts
    assert_identical_retries(host, attempts)


async def test_a_refused_retry_of_a_best_effort_signal_keeps_the_uncertainty(
        host: ScriptedHost) -> None:
    host.script = [errored("indeterminate", "outcome_unknown")]
    host.default = errored("failed", "unsupported")
    answer = await client(host).reaction_add(CHANNEL, OTHER, "👀")
    assert isinstance(answer, Indeterminate) and answer.attempts == FAST.max_attempts


@pytest.mark.parametrize("code", ["unauthorized", "request_id_conflict", "action_failed"])
async def test_a_replayed_refusal_after_a_drop_is_the_recorded_verdict(
        host: ScriptedHost, code: str) -> None:
    # `replayed`: the host's record of this request holds that refusal; it is final.
    host.script = [drop(), errored("failed", code, replayed=True)]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Failed) and answer.code.value == code and answer.attempts == 2


@pytest.mark.parametrize("with_prior", [False, True], ids=["after_a_drop", "with_prior"])
async def test_a_replayed_unauthenticated_is_no_recorded_verdict(
        host: ScriptedHost, with_prior: bool) -> None:
    # A host's records are per authenticated principal: an unauthenticated request has
    # none to replay, so `replayed` on that refusal is read as absent. After an attempt
    # that may have reached the host it says nothing of that attempt: fate unknown, never
    # CredentialRefused ("nothing happened").
    refused = errored("failed", "unauthenticated", replayed=True)
    host.script = [drop(), drop(), drop(), refused] if with_prior else [drop(), refused]
    c = client(host)
    if with_prior:
        first = await c.message_post(CHANNEL, "hi")
        assert isinstance(first, NoAnswer)
        answer = await c.send(first.request, prior=first)
        assert answer.attempts == 1
    else:
        answer = await c.message_post(CHANNEL, "hi")
        assert answer.attempts == 2
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert_identical_retries(host, 4 if with_prior else 2)


async def test_a_replayed_unauthenticated_first_answer_is_still_credential_refused(
        host: ScriptedHost) -> None:
    host.script = [errored("failed", "unauthenticated", replayed=True)]
    with pytest.raises(CredentialRefused):
        await client(host).message_post(CHANNEL, "hi")


@pytest.mark.parametrize("code", STOPPING_CODES + ["action_failed"])
async def test_a_resend_with_its_prior_fate_unknown_keeps_it(host: ScriptedHost, code: str) -> None:
    host.script = [drop(), drop(), drop()]
    host.default = errored("failed", code)
    c = client(host)
    first = await c.message_post(CHANNEL, "hi")
    assert isinstance(first, NoAnswer)
    again = await c.send(first.request, prior=first)
    # Never Failed ("nothing happened"), never CredentialRefused: the first call's fate
    # is still unknown.
    assert isinstance(again, NoAnswer) and again.request == first.request
    assert again.attempts == (1 if code in STOPPING_CODES else FAST.max_attempts)
    assert_identical_retries(host, 3 + again.attempts)


async def test_a_resend_with_its_prior_fate_unknown_still_takes_a_verdict(
        host: ScriptedHost) -> None:
    host.script = [drop(), drop(), drop(), errored("failed", "action_failed", replayed=True),
                   drop(), drop(), drop(), succeeded(None, publish_outcome(), replayed=True)]
    c = client(host)
    first = await c.message_post(CHANNEL, "hi")
    assert isinstance(first, NoAnswer)
    recorded = await c.send(first.request, prior=first)
    assert isinstance(recorded, Failed) and recorded.code is ErrorCode.ACTION_FAILED
    second = await c.message_post(CHANNEL, "again")
    assert isinstance(second, NoAnswer)
    done = await c.send(second.request, prior=second)
    assert isinstance(done, Succeeded) and done.replayed


async def test_a_resend_with_its_prior_raises_no_setup_error() -> None:
    # Its socket gone, the resend is no answer: the request's fate stays unknown.
    directory = socket_dir()
    try:
        c = AsyncBrokerClient(f"{directory}/broker.sock", CREDENTIAL, retry=FAST)
        request = c.freeze("message.post", {"channelId": CHANNEL, "content": "hi"})
        prior = NoAnswer(request_id=request.request_id, action=request.action, attempts=1,
                         request=request, reason=NoAnswerReason.TRANSPORT, detail="timed out")
        answer = await c.send(request, prior=prior)
        assert isinstance(answer, NoAnswer) and answer.attempts == FAST.max_attempts
        with pytest.raises(SocketMissing):
            await c.send(request)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def _cancelled_by_the_caller(loop_backend: str, call: Any) -> None:
    """Run `call` under the caller's own timeout, the loop's native one: it must time out."""
    with pytest.raises(TimeoutError):  # the cancellation, passed through unchanged
        if loop_backend == "asyncio":
            await asyncio.wait_for(call, 0.3)
        else:
            with anyio.fail_after(0.3):
                await call


async def test_a_call_its_caller_cancels_after_sending_logs_its_fate_unknown_and_resends_once(
        host: ScriptedHost, loop_backend: str, caplog: pytest.LogCaptureFixture) -> None:
    # The host did it, but its answer is later than the caller's timeout. The client cannot
    # answer (the cancellation is the caller's), so it says in the log which request's fate
    # is unknown; the documented resume (docs/agents.md §2) sends that same request again,
    # and the host replays its record instead of posting twice.
    caplog.set_level(logging.INFO, logger="buzz_broker.client")
    host.script = [stall(), succeeded(None, publish_outcome(), replayed=True)]
    c = client(host)
    request = c.freeze("message.post", {"channelId": CHANNEL, "content": "deploy done"})
    await _cancelled_by_the_caller(loop_backend, c.send(request))
    [line] = [r.getMessage() for r in caplog.records if "cancelled" in r.getMessage()]
    assert "fate unknown" in line and request.request_id in line and "message.post" in line
    assert CREDENTIAL not in caplog.text
    lost = NoAnswer.cancelled(request)
    assert (lost.request, lost.request_id, lost.action, lost.reason) == (
        request, request.request_id, request.action, NoAnswerReason.TRANSPORT)
    again = await c.send(request, prior=lost)
    assert isinstance(again, Succeeded) and again.replayed
    assert_identical_retries(host, 2)  # one request id, one set of bytes: no second post


async def test_a_call_cancelled_before_a_byte_left_logs_nothing(
        loop_backend: str, caplog: pytest.LogCaptureFixture) -> None:
    # No socket: every attempt failed to connect, so the cancelled call sent nothing.
    caplog.set_level(logging.INFO, logger="buzz_broker.client")
    directory = socket_dir()
    try:
        c = AsyncBrokerClient(f"{directory}/broker.sock", CREDENTIAL, retry=RetryPolicy(
            max_attempts=100, first_delay=0.05, max_delay=0.05, total_seconds=30.0))
        await _cancelled_by_the_caller(loop_backend, c.message_post(CHANNEL, "hi"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert "retrying" in caplog.text and "fate unknown" not in caplog.text


def test_a_prior_of_another_request_is_refused() -> None:
    c = AsyncBrokerClient("/tmp/bbc-nonexistent/broker.sock", CREDENTIAL, retry=FAST)
    request = c.freeze("message.post", {"channelId": CHANNEL, "content": "hi"})
    other = c.freeze("message.post", {"channelId": CHANNEL, "content": "bye"},
                     request_id=request.request_id)
    prior = NoAnswer(request_id=other.request_id, action=other.action, attempts=1,
                     request=other, reason=NoAnswerReason.TRANSPORT, detail="timed out")
    with pytest.raises(ValueError, match="another request"):
        anyio.run(lambda: c.send(request, prior=prior))


# ------------------------------------------------------------------ what an answer may cost


async def test_an_answer_larger_than_its_action_can_be_is_no_answer(host: ScriptedHost) -> None:
    # A valid envelope, but no answer to message.post holds 100 KiB (a Published outcome,
    # or one operator line): not read past the action's bound.
    host.default = errored("failed", "action_failed", "x" * 100_000)
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert answer.detail == "response body over the bound"
    assert_identical_retries(host, FAST.max_attempts)


async def test_a_page_of_more_json_values_than_events_hold_is_no_answer(host: ScriptedHost) -> None:
    # One-value tags in one event, inside the bytes of a page of 10 (10 MiB), but one value
    # more than any page the host serves holds (PAGE_VALUES, and the envelope's): refused
    # from a count of the raw bytes, before an object is built. At the bound exactly, it
    # is parsed (and then fails its signature: its tags were changed after signing).
    request = build_request("channel.read", {"channelId": CHANNEL, "limit": 10}, request_id="r")
    bound = response_values(request)
    assert bound == PAGE_VALUES + 64 == 419_495

    def answer_of(values: int) -> Step:
        # The envelope the host sends, counted with another requestId: a string is one.
        event = Signer().event(content="x", tags=[["h", CHANNEL]])
        outcome = page([event])
        envelope = {"type": "broker_result", "protocolVersion": 1, "requestId": "r",
                    "status": "succeeded", "action": "channel.read", "outcome": outcome}
        extra = values - values_at_most(dumps(envelope), 0, 1 << 30)
        # A `[""]` tag adds two values, a `["",""]` tag three.
        event["tags"] = ([["h", CHANNEL]] + [[""]] * (extra // 2 - extra % 2)
                         + [["", ""]] * (extra % 2))
        body = dumps(envelope)
        assert values_at_most(body, 0, 1 << 30) == values and len(body) < 2 * 1024 * 1024
        return succeeded(None, outcome)

    for values, reason in ((bound, NoAnswerReason.UNVERIFIED_EVENT),
                           (bound + 1, NoAnswerReason.NO_ENVELOPE)):
        host.received.clear()
        host.default = answer_of(values)
        # Judging 400,000 values takes seconds on a loaded machine: the attempt's deadline
        # is not what this test is about (running out answers `transport`).
        answer = await client(host, retry=SLOW_JUDGING).channel_read(CHANNEL, limit=10)
        assert isinstance(answer, NoAnswer) and answer.reason is reason, (values, answer)
        assert ("JSON values" in answer.detail) is (values > bound)
    assert len(host.received) == SLOW_JUDGING.max_attempts


def test_the_value_bound_holds_the_densest_page_the_host_serves_at_every_limit() -> None:
    # The host cuts a page at MAX_PAGE_BYTES of `page_bytes`; the densest page it serves
    # within that (tests/contract/test_page_size.py) passes the client's count at every
    # limit whose byte bound it fits, and a page of events of 2,000 one-letter tags (which
    # Buzz's own client shows) at every limit it has events for. An allowance per event
    # refused both.
    def counted(events: list[Event]) -> tuple[int, int]:
        body = encode_response("r", Verdict.succeeded("channel.read", ReadOutcome(
            messages=tuple(events), next_cursor="c" * 256)))
        return len(body), values_at_most(body, 0, len(body))

    def event(tags: list[list[str]]) -> Event:
        return Event(id="0" * 64, pubkey="1" * 64, created_at=0, kind=9,
                     tags=tuple(map(tuple, tags)), content="", sig="2" * 128)

    # Each as many events as the host's page holds before MAX_PAGE_BYTES cuts it, and the
    # densest lone event one relay frame (1 MiB) holds, which the host serves alone.
    dense = event([["h", CHANNEL]] + [[""]] * 5_000)
    tagged = event([["h", CHANNEL]] + [["t", "x"]] * 1999)
    lone = event([["h", CHANNEL]] + [[""]] * ((1024 * 1024 - 400) // 5))
    pages = {e: [e] * max(1, MAX_PAGE_BYTES // page_bytes(e)) for e in (dense, tagged, lone)}
    assert [len(pages[e]) for e in (dense, tagged, lone)] == [41, 49, 1]
    assert counted(pages[dense])[1] > 0.97 * PAGE_VALUES
    counts = {}
    for limit in (1, 2, 18, 100, 500):
        request = build_request("channel.read", {"channelId": CHANNEL, "limit": limit},
                                request_id="r")
        for e, full in pages.items():
            events = full[:limit]
            if (e, len(events)) not in counts:
                counts[e, len(events)] = counted(events)
            size, values = counts[e, len(events)]
            if size <= response_bytes(request):
                assert values <= response_values(request), (limit, len(events))


async def test_judging_a_page_holds_neither_the_loop_nor_past_the_deadline(
        host: ScriptedHost, monkeypatch: pytest.MonkeyPatch) -> None:
    # Verifying a page's events is CPU work: it runs on a worker thread, inside the
    # attempt's deadline. A verification that takes longer than the attempt may (here a
    # blocking sleep stands for it) leaves the loop free and the attempt no answer.
    import time

    import buzz_broker_client.client as client_module

    def slow_verify(outcome: object) -> bool:
        time.sleep(1.0)
        return True

    monkeypatch.setattr(client_module, "_verify_events", slow_verify)
    event = Signer().event(content="y" * 100_000, tags=[["h", CHANNEL]])
    host.default = succeeded(None, page([event]))
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    policy = RetryPolicy(max_attempts=1, attempt_seconds=0.3, total_seconds=5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        answer = await client(host, retry=policy).channel_read(CHANNEL, limit=1)
        tg.cancel_scope.cancel()
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert answer.detail == "timed out checking the response"
    assert ticks >= 5, "the event loop stalled while the page was judged"


# ------------------------------------------------------------------ outcome identities


async def test_a_storage_address_of_another_kind_is_no_answer(host: ScriptedHost) -> None:
    # NIP-BA: storage.address "returns the agent's author pubkey, kind 30174".
    me = Signer().pubkey
    host.script = [succeeded(None, {"authorPubkey": me, "kind": 30174, "dTag": OTHER})]
    c = client(host, agent_pubkey=me)
    assert isinstance(await c.storage_address("core"), Succeeded)
    host.default = succeeded(None, {"authorPubkey": me, "kind": 1, "dTag": OTHER})
    answer = await c.storage_address("core")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.MISMATCH


async def test_non_canonical_host_output_is_no_answer(host: ScriptedHost) -> None:
    # NIP-BA: lowercase hex and lowercase hyphenated UUIDs out, names trimmed; the reader
    # accepts input spellings, so the client checks the host wrote the canonical one.
    pub = Signer().pubkey
    c = client(host)
    host.default = succeeded(None, {"eventId": OTHER.upper(), "kind": 9, "createdAt": 1})
    post = await c.message_post(CHANNEL, "hi")
    assert isinstance(post, NoAnswer) and post.reason is NoAnswerReason.MISMATCH
    for outcome in ({"agentPubkey": pub, "displayName": "Scout", "channelId": "{" + CHANNEL.upper() + "}"},
                    {"agentPubkey": pub, "displayName": " Scout ", "channelId": CHANNEL},
                    {"agentPubkey": pub.upper(), "displayName": "Scout", "channelId": CHANNEL}):
        host.default = succeeded(None, outcome)
        created = await c.agents_create(CHANNEL, "Scout", "Be brief.")
        assert isinstance(created, NoAnswer) and created.reason is NoAnswerReason.MISMATCH, outcome


def test_a_socket_path_not_shown_has_none_of_its_directories_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket path that looks like a credential (the token put where the socket goes) is
    left out of every message; the directory above it that refused this user is part of
    that path, so it is not named either: the socket-group advice stands instead."""
    looks_like_a_credential = "bzb_" + "Q7xk2" * 6
    base = Path(tempfile.mkdtemp(prefix="bb-"))  # short: a socket path's bound
    closed = base / looks_like_a_credential
    closed.mkdir()
    endpoint = _transport.Endpoint.parse(str(closed / "broker.sock"))
    assert looks_like_a_credential not in endpoint.describe()
    real = os.access
    # As the agent's user sees it (the tests run as root, which passes any directory).
    monkeypatch.setattr(_transport.os, "access",
                        lambda path, mode: False if path == str(closed) else real(path, mode))
    assert _transport.closed_directory(endpoint) is None
    said = str(SocketPermissionDenied(endpoint.describe(), _transport.closed_directory(endpoint)))
    monkeypatch.undo()
    shutil.rmtree(base)
    assert looks_like_a_credential not in said and "server.socket_group" in said


def _closed_for_this_user(monkeypatch: pytest.MonkeyPatch, closed: set[str],
                          readable: bool = True) -> None:
    """os.access as an agent's user sees it (the tests run as root, which passes any
    directory): no search (X_OK) in `closed`; read (R_OK) only where `readable`."""
    real = os.access

    def access(path: str, mode: int) -> bool:
        if path in closed:
            return False
        if mode == os.R_OK and not readable:
            return False
        return real(path, mode)

    monkeypatch.setattr(_transport.os, "access", access)


def test_of_two_closed_directories_the_one_nearest_the_root_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first directory from / down that this user cannot pass is the cause: opening
    one below it would change nothing, so that is the one named (and a closed grandparent
    is found, not only the socket's own directory)."""
    base = Path(tempfile.mkdtemp(prefix="bb-"))
    outer, inner = base / "run", base / "run" / "broker"
    inner.mkdir(parents=True)
    endpoint = _transport.Endpoint.parse(str(inner / "broker.sock"))
    try:
        _closed_for_this_user(monkeypatch, {str(outer), str(inner)})
        both = _transport.closed_directory(endpoint)
        _closed_for_this_user(monkeypatch, {str(outer)})
        grandparent = _transport.closed_directory(endpoint)
    finally:
        monkeypatch.undo()
        shutil.rmtree(base)
    assert both is not None and both.path == str(outer), both
    assert grandparent is not None and grandparent.path == str(outer), grandparent


def test_a_directory_this_user_may_search_but_not_list_is_not_the_cause(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Passing through a directory needs search (x), not read (r): a 0711 directory lets
    the agent reach the socket, so the socket's own mode is the cause."""
    base = Path(tempfile.mkdtemp(prefix="bb-"))
    endpoint = _transport.Endpoint.parse(str(base / "broker.sock"))
    try:
        _closed_for_this_user(monkeypatch, set(), readable=False)
        found = _transport.closed_directory(endpoint)
    finally:
        monkeypatch.undo()
        shutil.rmtree(base)
    assert found is None, found


def test_a_directory_whose_group_may_list_but_not_search_lets_no_group_through() -> None:
    """0740: its group reads the names but cannot pass through: joining that group would
    not help, so the advice is its mode, not a group to join."""
    closed = _transport.ClosedDirectory(path="/run/b", mode=0o740, owner="root", group="agents")
    said = str(SocketPermissionDenied("unix:/run/b/broker.sock", closed))
    assert "its mode, not the socket's group, is the problem" in said, said
    assert "add the agent's user to group agents" not in said
    passable = _transport.ClosedDirectory(path="/run/b", mode=0o710, owner="root", group="agents")
    said = str(SocketPermissionDenied("unix:/run/b/broker.sock", passable))
    assert "add the agent's user to group agents" in said, said
