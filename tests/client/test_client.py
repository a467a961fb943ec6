"""The agent client against a scripted host: every wrong answer the spec names (I3–I6, [C1]).

Each test scripts what the host answers and then asserts two things: what the client
reported (a verdict, or no answer, exactly as spec §Results and §HTTP binding say), and
what reached the wire (every retry's bytes identical to the first).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import trio

from daemon.client import (
    _ECHO_CHECKS,
    AsyncBrokerClient,
    BrokerClient,
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
    AgentsCreateOutcome,
    ContractError,
    ErrorCode,
    PublishOutcome,
    ReadOutcome,
    encode_request,
)
from tests.client.scripted_host import (
    HttpAnswer,
    Received,
    ScriptedHost,
    Signer,
    drop,
    errored,
    publish_outcome,
    raw,
    stall,
    succeeded,
)

CHANNEL = "5df7dfa8-e919-43df-8efd-f1dcb8af7071"
CREDENTIAL = "bb1.test-credential-9f3c2e10b5d4e8a9c713f2b6d8e4a10"
OTHER = "d31d54af61c73c47053822d496ce341eac337252ee1aa7c41c9751fa3060d121"
FAST = RetryPolicy(max_attempts=3, first_delay=0.001, max_delay=0.005,
                   attempt_seconds=5.0, total_seconds=20.0)


def client(host: ScriptedHost, **kw: object) -> AsyncBrokerClient:
    kw.setdefault("retry", FAST)
    return AsyncBrokerClient(host.path, CREDENTIAL, **kw)  # type: ignore[arg-type]


def assert_identical_retries(host: ScriptedHost, attempts: int) -> None:
    assert len(host.received) == attempts
    assert all(body == host.bodies[0] for body in host.bodies), "a retry re-rendered the request"
    assert len({r.json()["requestId"] for r in host.received}) == 1


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
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, Failed) and answer.code is ErrorCode.UNAUTHENTICATED
    assert len(host.received) == 1


async def test_unsupported_is_normal_on_reaction_add_and_failed_elsewhere(host: ScriptedHost) -> None:
    host.script = [errored("failed", "unsupported"), errored("failed", "unsupported")]
    c = client(host)
    reaction = await c.reaction_add(CHANNEL, OTHER, "👍")
    assert isinstance(reaction, Unsupported)
    post = await c.message_post(CHANNEL, "hi")
    assert isinstance(post, Failed) and post.code is ErrorCode.UNSUPPORTED
    assert [spec.name for spec in ACTIONS.values() if spec.best_effort] == ["reaction.add"]


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


async def test_loopback_http_carries_the_same_exchange(nursery: trio.Nursery) -> None:
    host = ScriptedHost(path="")
    port = await nursery.start(host.serve_tcp)
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
    # Another spelling of the same channel is the same identity: a verdict.
    host.script = [succeeded(None, {"agentPubkey": pub, "displayName": "Scout",
                                    "channelId": CHANNEL.upper()})]
    ok = await c.agents_create(CHANNEL.replace("-", ""), "Scout", "Be brief.")
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
    start = trio.current_time()
    answer = await client(host, retry=policy).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert answer.attempts == 2 and trio.current_time() - start < 2
    assert_identical_retries(host, 2)


async def test_total_time_bounds_the_attempts(host: ScriptedHost) -> None:
    host.default = stall()
    policy = RetryPolicy(max_attempts=50, first_delay=0.01, attempt_seconds=5, total_seconds=0.3)
    start = trio.current_time()
    answer = await client(host, retry=policy).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and trio.current_time() - start < 1.5
    assert answer.attempts < 50


async def test_no_host_listening_is_no_answer() -> None:
    c = AsyncBrokerClient("/tmp/bbc-nonexistent/broker.sock", CREDENTIAL, retry=FAST)
    answer = await c.message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert answer.attempts == 3


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
    answer = await trio.to_thread.run_sync(lambda: sync.message_post(CHANNEL, "hi"))
    assert isinstance(answer, Succeeded) and answer.replayed and answer.attempts == 2
    assert_identical_retries(host, 2)
    reaction = await trio.to_thread.run_sync(lambda: sync.reaction_add(CHANNEL, OTHER, "+"))
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
