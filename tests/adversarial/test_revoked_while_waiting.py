"""A credential revoked while its request waits on an identical one in flight gets nothing.

Attack: present a credential, send the same bytes another credential of the agent has in
flight, and get that credential revoked (or the agent removed) while the ledger makes the
request wait (daemon/state/ledger.py, `begin` step 2). Authentication ran once, before the
wait: the waiter was handed the owner's outcome when it finished, and, when the owner
ended indeterminate, claimed the record and re-sent its events to the relay. NIP-BA:
"Hosts MUST authenticate every attempt, including retries, and authorize both execution
and release of stored results. A revoked credential MUST NOT retrieve a cached read or
outcome."

Proven here (real daemon, token, LocalRelay): the waiter is checked again once its wait
ends (daemon/pipeline/broker.py, `Ledger.joins`). It answers `failed` + `unauthenticated`,
is handed no outcome, resumes nothing (the relay is asked once), and leaves the record as
it is: a live credential of the agent then replays the success, or resumes the pending
work, as it would have without the waiter.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from daemon.relay.pool import Unknown
from daemon.state.ledger import Ledger
from tests.fixtures.broker import BrokerHarness, request_body

CHANNEL = str(uuid.uuid4())


def _code(envelope: dict[str, Any] | None) -> tuple[object, object, object]:
    assert envelope is not None
    error = envelope.get("error")
    return (envelope["status"], error.get("code") if isinstance(error, dict) else None,
            envelope.get("replayed", False))


def _credential_id(harness: BrokerHarness, token: str) -> str:
    principal = harness.app.sessions.authenticate(f"Bearer {token}", None, int(time.time()))
    return principal.credential_id  # type: ignore[union-attr]


async def _revoke(harness: BrokerHarness, agent: str, token: str) -> None:
    assert harness.app.sessions.revoke(_credential_id(harness, token))


async def _remove_agent(harness: BrokerHarness, agent: str, token: str) -> None:
    await harness.custody.destroy_agent(agent)


Loss = Callable[[BrokerHarness, str, str], Awaitable[None]]


def _joined(monkeypatch: pytest.MonkeyPatch, request_id: str) -> trio.Event:
    """Set once a second request with `request_id` enters the ledger (the first is the
    owner, in flight): its `begin` then waits for the owner before this test runs again."""
    joined = trio.Event()
    begin = Ledger.begin
    calls: list[object] = []

    async def spy(self: Ledger, key: Any, *args: Any, **kwargs: Any) -> Any:
        if key.request_id == request_id:
            calls.append(key)
            if len(calls) == 2:
                joined.set()
        return await begin(self, key, *args, **kwargs)
    monkeypatch.setattr(Ledger, "begin", spy)
    return joined


async def _while_joined(broker: BrokerHarness, body: bytes, owner: str, waiter: str,
                        held: trio.Event, go_on: trio.Event, joined: trio.Event,
                        lose: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    """The owner's request until it is `held`, then the waiter's until it has joined it;
    the waiter's credential lost (`lose`), the owner goes on. The answers, by name."""
    answers: dict[str, Any] = {}

    async def post(name: str, token: str) -> None:
        answers[name] = (await broker.post(body, token))[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "owner", owner)
        await held.wait()
        nursery.start_soon(post, "waiter", waiter)
        await joined.wait()
        await lose()
        go_on.set()
    return answers


#: How long a later request of the agent may wait for the record: the refused waiter must
#: have released its ticket, and a regression that keeps it should fail here, not stall
#: the suite.
RECORD_FREE_SECONDS = 30


@pytest.mark.parametrize("lose", [_revoke, _remove_agent], ids=["revoked", "agent_removed"])
async def test_a_waiter_that_lost_its_credential_is_not_handed_the_outcome(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch, lose: Loss
) -> None:
    agent = await broker.human_owned_agent("joined")
    owner, waiter = broker.credential(agent, [CHANNEL]), broker.credential(agent, [CHANNEL])
    request_id = str(uuid.uuid4())
    body = request_body("message.post", {"channelId": CHANNEL, "content": "once"},
                        request_id=request_id)
    # The owner's request waits at its verdict's record: published, not yet finished.
    at_finish, go_on = trio.Event(), trio.Event()
    finish = Ledger.finish

    async def slow_finish(self: Ledger, ticket: Any, *args: Any, **kwargs: Any) -> Any:
        if ticket.key.request_id == request_id:
            at_finish.set()
            await go_on.wait()
        return await finish(self, ticket, *args, **kwargs)
    monkeypatch.setattr(Ledger, "finish", slow_finish)
    answers = await _while_joined(broker, body, owner, waiter, at_finish, go_on,
                                  _joined(monkeypatch, request_id),
                                  lambda: lose(broker, agent, waiter))
    if lose is _revoke:
        assert _code(answers["owner"]) == ("succeeded", None, False)
        # The record is untouched: another live credential of the agent replays it.
        later = broker.credential(agent, [CHANNEL])
        with trio.fail_after(RECORD_FREE_SECONDS):  # a ticket the waiter kept hangs it
            _, replay = await broker.post(body, later)
        assert replay == {**answers["owner"], "replayed": True}
    assert _code(answers["waiter"]) == ("failed", "unauthenticated", False)
    assert "outcome" not in answers["waiter"]
    assert _code((await broker.post(body, waiter))[1]) == ("failed", "unauthenticated", False)


async def test_a_revoked_waiter_does_not_resume_what_the_owner_left_pending(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = await broker.human_owned_agent("resumed")
    owner, waiter = broker.credential(agent, [CHANNEL]), broker.credential(agent, [CHANNEL])
    request_id = str(uuid.uuid4())
    body = request_body("message.post", {"channelId": CHANNEL, "content": "pending"},
                        request_id=request_id)
    relay = broker.app._publisher._relay
    publish = relay.publish
    asked: list[str] = []
    at_publish, go_on = trio.Event(), trio.Event()

    async def first_unanswered(author: str, event: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(event.id)
        if len(asked) == 1:  # the owner's: no OK, so it ends indeterminate, work pending
            at_publish.set()
            await go_on.wait()
            return Unknown(reason="no OK (test)")
        return await publish(author, event, *args, **kwargs)
    monkeypatch.setattr(relay, "publish", first_unanswered)
    answers = await _while_joined(broker, body, owner, waiter, at_publish, go_on,
                                  _joined(monkeypatch, request_id),
                                  lambda: _revoke(broker, agent, waiter))
    assert _code(answers["owner"]) == ("indeterminate", "outcome_unknown", False)
    assert _code(answers["waiter"]) == ("failed", "unauthenticated", False)
    assert len(asked) == 1, "the revoked waiter re-sent the pending events"
    # The pending record is left for the agent's live credentials: the retry resumes it,
    # re-sending exactly the same signed event.
    with trio.fail_after(RECORD_FREE_SECONDS):  # a ticket the waiter kept hangs it
        _, resumed = await broker.post(body, owner)
    assert _code(resumed) == ("succeeded", None, False)
    assert asked == [asked[0], asked[0]]
