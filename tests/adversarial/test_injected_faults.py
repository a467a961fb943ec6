"""An unexpected exception at each step of each operation is an envelope, recorded
(issue 15 item 4; the envelope part of issue 13 item 1).

Table-driven twice over: `STEPS` names every seam of the pipeline a fault can come from
(the broker's collaborators, patched at their class), and each operation is first run
once with every seam traced, so the steps an operation really passes are discovered, not
listed by hand. Then, for each step it passes, the operation runs again with the first
call at that step raising, and the answer must be:

- before anything was handed to the relay: `failed` + `internal` (a known no-op), and the
  identical retry replays exactly that record (a fault of the ledger's own `begin` leaves
  nothing to replay: the retry runs afresh);
- at the relay hand-off: `indeterminate` + `internal`, and the identical retry finishes
  the same events (`succeeded`);
- after every event was accepted (housekeeping, the verdict's audit record): the verdict
  stands (`succeeded`);
- the ledger's finish: the verdict was not stored, so it is not answered (NIP-BA: "Store
  the result durably before delivering it"): `indeterminate` + `internal` once events were
  handed to the relay (the retry resumes the pending record), `failed` + `internal` while
  nothing was (observer.emit's held frames are dropped; the retry runs afresh).

Reads have no relay hand-off and, once they ran, no record (issue 24): a fault in
counting them is `failed` + `internal`, and a read that faulted once it ran (the relay
query, the count) is run afresh by its identical retry; one that faulted before (the
ledger, authorization, rate limits) is a refusal, recorded and replayed.
For agents.create the key minted for a request that ends `failed` is gone, and the one
whose request ends `indeterminate` is the same one the retry completes with.

Beside the table, faults the table's single first-call fault cannot reach: one on a
success's replay, one escaping the pipeline after the relay took the event, a rolled-back
retry whose finish fails again, and a minted key custody cannot destroy (on the refused
create's rollback, and on a create whose mint answer was lost).
"""

from __future__ import annotations

import inspect
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

import daemon.pipeline.judgement
from buzzwire.contract import ACTIONS
from daemon.state.audit import AuditLog, Phase
from daemon.state.directory import AgentDirectory
from daemon.state.ledger import Ledger
from daemon.state.ratelimit import RateLimiter
from daemon.state.read_audit import ReadAudit
from daemon.relay.pool import RelayPool
from daemon.state.runtimes import RuntimeStore
from daemon.pipeline.signing import SigningBatcher
from daemon.pipeline.observer import ObserverQueue
from daemon.state.observer_seq import ObserverSeq
from custody import Custody
from tests.fixtures.broker import BrokerHarness, request_body


class Injected(RuntimeError):
    """The fault this test raises; its text must never reach an answer."""


@dataclass(frozen=True)
class Step:
    owner: Any  # the class whose method is wrapped, or the module whose function is
    method: str
    #: which calls of the method count as this step (None: every call)
    applies: Callable[[tuple[Any, ...]], bool] | None = None

    @property
    def bound(self) -> bool:
        return isinstance(self.owner, type)


def _phase(phase: Phase) -> Callable[[tuple[Any, ...]], bool]:
    return lambda args: getattr(args[0], "phase", None) is phase


#: Every seam an unexpected exception can come from, by name.
STEPS: dict[str, Step] = {
    "begin": Step(Ledger, "begin"),
    "authorize": Step(daemon.pipeline.judgement, "authorize"),
    "rate_limit": Step(RateLimiter, "take"),
    "relay_subscribe": Step(RelayPool, "subscribe"),
    "relay_read": Step(RelayPool, "query"),
    "mint": Step(Custody, "mint_agent"),
    "enroll": Step(AgentDirectory, "enroll"),
    "memory_address": Step(Custody, "memory_address"),
    "sign": Step(SigningBatcher, "sign"),
    "observer_seq": Step(ObserverSeq, "take"),
    "encrypt": Step(Custody, "encrypt_to_owner"),
    "observer_hold": Step(ObserverQueue, "hold"),
    "audit_intent": Step(AuditLog, "append", _phase(Phase.INTENT)),
    "record_pending": Step(Ledger, "record_pending"),
    "publish": Step(RelayPool, "publish"),
    "destroy": Step(Custody, "destroy_agent"),
    "rename": Step(AgentDirectory, "rename"),
    "runtime_record": Step(RuntimeStore, "set"),
    "finish": Step(Ledger, "finish"),
    "audit_verdict": Step(AuditLog, "append", _phase(Phase.VERDICT)),
    "count_read": Step(ReadAudit, "count"),
}
#: The steps at which a read has run (`Progress.executed`): no record is left of it.
#: storage.get derives its d tag before it runs (the audit's target), then queries.
#: channel.read opens its window (the live subscription) as it runs.
_READ_RAN = {"channel.read": {"relay_subscribe", "relay_read", "count_read"},
             "storage.address": {"memory_address", "count_read"},
             "storage.get": {"relay_read", "count_read"}}
#: The host's own part of an action, run after the relay accepted its events (the plan's
#: `commit` cleanup): a fault there leaves the record pending, `indeterminate`, and the
#: identical retry runs it again (a final `succeeded` left agents.delete's key live).
_COMMIT_STEPS = {"destroy", "rename", "runtime_record"}
_AFTER_RELAY = {"audit_verdict"}
#: Effects held until the verdict is recorded (observer.emit's intake,
#: daemon/pipeline/observer.py): judged like a read here, nothing reaches the relay first.
_HELD_UNTIL_RECORDED = {"observer.emit"}
#: Answered `unsupported` whatever happens (daemon/operations/liveness_ping.py).
_NEVER_SUCCEEDS = {"liveness.ping"}


class Seams:
    """Wraps every step's method: records the order steps are passed, raises at one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trace: list[str] = []
        self.fail_at: str | None = None
        self.failed = False
        for name, step in STEPS.items():
            monkeypatch.setattr(step.owner, step.method, self._wrap(name, step))

    def _hit(self, name: str, step: Step, args: tuple[Any, ...]) -> None:
        if step.applies is not None and not step.applies(args):
            return
        self.trace.append(name)
        if self.fail_at == name and not self.failed:
            self.failed = True
            raise Injected(f"injected at {name}: a secret-looking text nsec1qqqq")

    def _wrap(self, name: str, step: Step) -> Any:
        original = getattr(step.owner, step.method)
        skip = 1 if step.bound else 0  # the instance is not one of the step's arguments
        if inspect.iscoroutinefunction(original):
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                self._hit(name, step, args[skip:])
                return await original(*args, **kwargs)
            return async_wrapper

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._hit(name, step, args[skip:])
            return original(*args, **kwargs)
        return wrapper

    def arm(self, name: str | None) -> None:
        self.trace, self.fail_at, self.failed = [], name, False


_counter = itertools.count()


async def _args_for(broker: BrokerHarness, action: str, owner_cred: str, channel: str,
                    seams: Seams) -> dict[str, Any]:
    """Fresh arguments (and state) for one run of `action`, made with no fault armed."""
    seams.arm(None)
    n = next(_counter)
    if action == "channel.read" and broker.app._relay.windows is not None:
        # Every run opens its read window (daemon/relay/windows.py) again, so that the live
        # subscription and the relay read are steps of each run, not of the first only.
        broker.app._relay.windows.close()
    if action in ("message.reply", "reaction.add"):
        post = await broker.call(owner_cred, "message.post", {"channelId": channel, "content": f"p{n}"})
        target = post["outcome"]["eventId"]
        if action == "reaction.add":
            return {"channelId": channel, "targetEventId": target, "reaction": "+"}
        return {"channelId": channel, "replyToEventId": target, "content": f"r{n}"}
    if action in ("agents.update", "agents.delete"):
        made = await broker.call(owner_cred, "agents.create", {
            "channelId": channel, "displayName": f"kid{n}", "systemPrompt": "p"})
        kid = made["outcome"]["agentPubkey"]
        if action == "agents.delete":
            return {"target": {"pubkey": kid}}
        return {"target": {"pubkey": kid}, "displayName": f"kid{n}b", "runtime": "codex"}
    return {
        "channel.read": {"channelId": channel, "limit": 5},
        "message.post": {"channelId": channel, "content": f"m{n}"},
        "profile.set": {"about": f"a{n}"},
        "storage.address": {"slug": "core"},
        "storage.get": {"slug": "core"},
        "storage.put": {"slug": f"mem/fault-{n}", "value": f"v{n}"},
        "observer.emit": {"frames": [{"kind": "k", "payload": f"o{n}"}]},
        "agents.create": {"channelId": channel, "displayName": f"new{n}", "systemPrompt": "p",
                          "runtime": "goose"},
        "presence.set": {"status": ("online", "away", "offline")[n % 3]},
        "typing.set": {"channelId": channel},
    }[action]


def _expected(action: str, step: str, trace: list[str]) -> tuple[str, str | None]:
    if not ACTIONS[action].publishing or action in _HELD_UNTIL_RECORDED:
        return ("failed", "internal")
    if step in ("publish", "finish") or step in _COMMIT_STEPS:
        return ("indeterminate", "internal")
    if step in _AFTER_RELAY:
        return ("succeeded", None)
    return ("failed", "internal")


def _minted(broker: BrokerHarness, owner: str, request_id: str) -> list[Any]:
    ref = f"{owner}/{request_id}"
    return [a for a in broker.app.directory.agents() if a.mint_ref == ref]


@pytest.mark.parametrize("action", sorted(set(ACTIONS) - _NEVER_SUCCEEDS))
async def test_a_fault_at_each_step_is_an_envelope(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    seams = Seams(monkeypatch)

    args = await _args_for(broker, action, cred, channel, seams)
    seams.arm(None)
    clean = await broker.call(cred, action, args)
    assert clean["status"] == "succeeded", clean
    passed = list(dict.fromkeys(seams.trace))
    read = not ACTIONS[action].publishing
    assert ({"count_read"} if read else {"finish", "audit_verdict"}) <= set(passed), passed
    if ACTIONS[action].publishing and action not in _HELD_UNTIL_RECORDED:
        assert {"sign", "audit_intent", "record_pending", "publish"} <= set(passed), passed
    queue = broker.app._observer.queue  # type: ignore[union-attr]

    for step in passed:
        args = await _args_for(broker, action, cred, channel, seams)
        request_id = f"fault-{action}-{step}-{next(_counter)}"
        body = request_body(action, args, request_id=request_id)
        seams.arm(step)
        dropped = queue.counts.dropped_unsettled
        status, answer = await broker.post(body, cred)
        assert seams.failed, (action, step, seams.trace)
        assert status == 200 and answer is not None, (action, step, status)
        want_status, want_code = _expected(action, step, passed)
        got = (answer["status"], answer.get("error", {}).get("code"))
        assert got == (want_status, want_code), (action, step, answer)
        assert "nsec1qqqq" not in str(answer) and "injected" not in str(answer)
        if action in _HELD_UNTIL_RECORDED:
            # Nothing the failed request took in is left held or queued for the relay.
            assert not queue._held, (step, queue._held)
            # A failed answer promises no effects: the frame it took in is dropped, never
            # handed to the relay (it was held until the verdict was recorded).
            took_in = passed.index(step) > passed.index("observer_hold")
            if want_status == "failed" and took_in:
                assert queue.counts.dropped_unsettled == dropped + 1, step

        if action == "agents.create":
            minted = _minted(broker, owner, request_id)
            if want_status == "failed":
                assert all(not a.live for a in minted), (step, minted)  # no orphan key
            else:
                assert len(minted) == 1 and minted[0].live, (step, minted)  # no lost key

        # Recorded either way: the identical retry replays a failure as it was, and
        # finishes what may have started.
        seams.arm(None)
        status, again = await broker.post(body, cred)
        assert status == 200 and again is not None
        if (step == "begin" or (read and step in _READ_RAN[action])
                or (step == "finish" and action in _HELD_UNTIL_RECORDED)):
            # The ledger itself faulted, or a read that ran (it leaves no record), or
            # held frames dropped with a verdict the ledger could not finish: nothing
            # was recorded, so the identical retry runs afresh.
            assert again["status"] == "succeeded" and "replayed" not in again, (action, again)
        elif want_status == "failed":
            assert again.get("replayed") is True and again["error"] == answer["error"], (step, again)
        else:
            assert again["status"] == "succeeded", (action, step, again)
            # A recorded success replays; an indeterminate one was resumed, not replayed.
            assert again.get("replayed", False) is (answer["status"] == "succeeded"), again
            if answer["status"] == "succeeded":
                assert again["outcome"] == answer["outcome"]
        if action == "agents.create" and want_status != "failed":
            [kept] = _minted(broker, owner, request_id)
            assert again["outcome"]["agentPubkey"] == kept.pubkey and kept.live


async def test_a_fault_before_authentication_is_still_an_envelope(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon.state.sessions import SessionStore

    def broken(*_: Any, **__: Any) -> Any:
        raise Injected("authenticate")

    monkeypatch.setattr(SessionStore, "check", broken)  # what the pipeline authenticates with
    status, answer = await broker.post(request_body("storage.address", {"slug": "core"},
                                                    request_id="before-auth"), "bad")
    assert status == 200 and answer is not None
    assert (answer["status"], answer["error"]["code"]) == ("failed", "internal")
    assert answer["requestId"] == "before-auth"


async def test_a_fault_sent_again_and_again_costs_the_log_a_line(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A request that trips a fault trips it every time it is sent (and a full disk
    fails every request): each was an ERROR line, so a client could push the daemon's
    lines past journald's rate limit. Now one line a minute per cause; every request is
    still answered failed + internal, and every fault is counted."""
    import logging
    import sqlite3

    from daemon.state.audit import AuditUnavailable

    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    recorder = broker.app._recorder  # white box: the counts behind the lines

    def raising(exc: Exception) -> Callable[..., Any]:
        def broken(*_: Any, **__: Any) -> Any:
            raise exc
        return broken

    async def broken_ledger(*_: Any, **__: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")

    async def broken_audit(*_: Any, **__: Any) -> Any:
        raise AuditUnavailable("the audit file cannot be written")

    caplog.set_level(logging.INFO, logger="buzz_broker")
    for event, owner, method, broken in (
            ("pipeline.fault", RateLimiter, "take", raising(Injected("rate"))),
            ("ledger.fault", Ledger, "begin", broken_ledger),
            ("audit.unavailable", AuditLog, "append", broken_audit)):
        caplog.clear()
        with monkeypatch.context() as patch:
            patch.setattr(owner, method, broken)
            for i in range(30):
                answer = await broker.call(cred, "message.post",
                                           {"channelId": channel, "content": f"c{i}"})
                assert (answer["status"], answer["error"]["code"]) == ("failed", "internal")
        lines = [r for r in caplog.records if r.getMessage() == event]
        assert len(lines) == 1, (event, len(lines))
        assert recorder.faults.total(event) >= 30
    # Mended, the daemon serves again.
    answer = await broker.call(cred, "message.post", {"channelId": channel, "content": "ok"})
    assert answer["status"] == "succeeded"


class RelaySpy:
    """What each attempt handed the relay: (event id, kind, result) in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, refuse: int = 0) -> None:
        from daemon.relay.pool import Rejected
        self.sent: list[tuple[str, int, Any]] = []
        self.refuse = refuse
        original = RelayPool.publish

        async def publish(pool: RelayPool, author: str, event: Any) -> Any:
            if self.refuse:
                self.refuse -= 1
                result: Any = Rejected(reason="rate-limited: slow down")
            else:
                result = await original(pool, author, event)
            self.sent.append((event.id, event.kind, result))
            return result
        monkeypatch.setattr(RelayPool, "publish", publish)

    def take(self) -> list[tuple[str, int, Any]]:
        sent, self.sent = self.sent, []
        return sent


def _new_effects(sent: list[tuple[str, int, Any]]) -> list[str]:
    """The events the relay took as new (not `duplicate:`), stored kinds only: an
    ephemeral kind (20000-29999) is never kept, so every acceptance looks new."""
    from daemon.relay.pool import Accepted
    return [i for i, kind, r in sent
            if isinstance(r, Accepted) and not r.duplicate and not 20000 <= kind < 30000]


_PUBLISHING = sorted(a for a in ACTIONS if ACTIONS[a].publishing and a not in _NEVER_SUCCEEDS)


@pytest.mark.parametrize("action", _PUBLISHING)
async def test_a_verdict_the_ledger_cannot_finish_is_not_answered(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """NIP-BA: "Store the result durably before delivering it". The ledger's finish fails
    once, after every event was accepted: the answer is not the verdict it could not
    store. Events were handed to the relay: `indeterminate` + `internal`, and the identical
    retry resumes the pending record (the same signed events, `duplicate:` at the relay,
    nothing new), then replays. observer.emit's frames were still held: dropped, `failed`
    + `internal`, and the retry runs afresh: one frame reaches the relay, not two."""
    import trio

    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    relay = RelaySpy(monkeypatch)
    seams = Seams(monkeypatch)
    queue = broker.app._observer.queue  # type: ignore[union-attr]
    args = await _args_for(broker, action, cred, channel, seams)
    request_id = f"unfinished-{action}-{next(_counter)}"
    body = request_body(action, args, request_id=request_id)
    relay.take()
    await trio.sleep(0.2)  # the pacer has sent what earlier requests queued
    queued_before, dropped_before = queue.counts.published, queue.counts.dropped_unsettled

    seams.arm("finish")
    _, first = await broker.post(body, cred)
    assert seams.failed and first is not None
    first_sent = relay.take()
    seams.arm(None)
    _, again = await broker.post(body, cred)
    assert again is not None
    again_sent = relay.take()
    _, third = await broker.post(body, cred)
    assert relay.take() == [], "a replay publishes nothing"

    assert again["status"] == "succeeded" and "replayed" not in again, again
    assert third == {**again, "replayed": True}
    if action in _HELD_UNTIL_RECORDED:
        assert (first["status"], first["error"]["code"]) == ("failed", "internal"), first
        assert queue.counts.dropped_unsettled == dropped_before + 1
        await trio.sleep(0.5)  # the pacer's turn
        assert queue.counts.published - queued_before == again["outcome"]["accepted"] == 1
        return
    assert (first["status"], first["error"]["code"]) == ("indeterminate", "internal"), first
    ids = [i for i, _kind, _r in first_sent]
    assert ids and [i for i, _k, _r in again_sent] == ids, (first_sent, again_sent)
    new = _new_effects(first_sent + again_sent)
    assert len(new) == len(set(new)), new  # each stored event taken as new once
    if action == "agents.create":
        [kept] = _minted(broker, owner, request_id)
        assert kept.live and again["outcome"]["agentPubkey"] == kept.pubkey


#: The actions whose first event a relay can refuse (the rest are covered the same way by
#: message.post): agents.create has a rollback (its key destroyed), message.post none.
_REFUSABLE = ("agents.create", "message.post", "storage.put")


@pytest.mark.parametrize("fault", ["finish", "before_verdict"])
@pytest.mark.parametrize("action", _REFUSABLE)
async def test_a_refused_publish_stays_failed_whatever_follows_its_rollback(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch, action: str, fault: str
) -> None:
    """The relay refuses the first event: `failed` + `action_failed`, stored on the pending
    record (`Ledger.roll_back`) before the rollback runs. Then the ledger's finish fails,
    or the pipeline dies before the verdict is recorded (an exception at the
    `before_verdict` checkpoint): the identical retry, with the relay taking everything
    now, replays the stored `failed` and publishes nothing; agents.create's key stays
    destroyed. (Before: the record was still pending, so the retry re-sent the events,
    for agents.create a put-user and a 30177 naming the destroyed key.)"""
    from daemon.pipeline.broker import Broker
    from daemon.state.ledger import LEDGER_FILENAME, State, read_record

    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    seams = Seams(monkeypatch)
    args = await _args_for(broker, action, cred, channel, seams)
    relay = RelaySpy(monkeypatch, refuse=1)
    if fault == "before_verdict":
        passed = Broker._passed

        def dies(self: Broker, step: str) -> None:
            if step == "before_verdict":
                raise Injected("the daemon died here")
            passed(self, step)
        monkeypatch.setattr(Broker, "_passed", dies)
    else:
        seams.arm("finish")
    request_id = f"refused-{action}-{fault}-{next(_counter)}"
    body = request_body(action, args, request_id=request_id)
    _, first = await broker.post(body, cred)
    assert first is not None
    assert [type(r).__name__ for _i, _k, r in relay.take()] == ["Rejected"]
    if fault == "finish":
        assert seams.failed
        assert (first["status"], first["error"]["code"]) == ("failed", "action_failed"), first
    else:
        monkeypatch.setattr(Broker, "_passed", passed)
    record = read_record(broker.state_dir / LEDGER_FILENAME, owner, request_id)
    assert record is not None and record[0] is State.ROLLED_BACK, record
    if action == "agents.create":
        assert _destroyed(broker, owner, request_id)

    seams.arm(None)
    _, again = await broker.post(body, cred)
    assert again is not None
    assert (again["status"], again["error"]["code"]) == ("failed", "action_failed"), again
    assert again.get("replayed") is True, again
    if fault == "finish":
        assert again["error"] == first["error"]
    _, third = await broker.post(body, cred)
    assert third == again
    assert relay.take() == [], "a rolled-back request's events are never sent again"
    record = read_record(broker.state_dir / LEDGER_FILENAME, owner, request_id)
    assert record is not None and record[0] is State.FINAL
    if action == "agents.create":
        assert _destroyed(broker, owner, request_id)


def _destroyed(broker: BrokerHarness, owner: str, request_id: str) -> bool:
    """The one key minted for this request is destroyed (its record kept, deleted)."""
    ref = f"{owner}/{request_id}"
    made = [a for a in broker.app.directory.agents(include_deleted=True) if a.mint_ref == ref]
    return len(made) == 1 and not made[0].live and broker.custody.agent(made[0].pubkey) is None


async def test_a_refusal_whose_rollback_cannot_be_stored_is_not_rolled_back(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger cannot mark the refused agents.create rolled back: nothing is rolled
    back (the record stays resumable), so `failed` cannot be promised: `indeterminate` +
    `internal`, the key kept; the identical retry resumes the same events, the relay takes
    them, and the one key is the created agent."""
    import sqlite3

    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    relay = RelaySpy(monkeypatch, refuse=1)
    original = Ledger.roll_back

    async def broken(*_: Any, **__: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")
    monkeypatch.setattr(Ledger, "roll_back", broken)
    body = request_body("agents.create", {"channelId": channel, "displayName": "kid",
                                          "systemPrompt": "p"}, request_id="unmarked")
    _, first = await broker.post(body, cred)
    assert first is not None
    assert (first["status"], first["error"]["code"]) == ("indeterminate", "internal"), first
    [refused] = relay.take()
    [kept] = _minted(broker, owner, "unmarked")
    assert kept.live
    monkeypatch.setattr(Ledger, "roll_back", original)
    _, again = await broker.post(body, cred)
    assert again is not None and again["status"] == "succeeded", again
    assert again["outcome"]["agentPubkey"] == kept.pubkey
    assert [i for i, _k, _r in relay.take()][0] == refused[0]  # the same signed events


async def test_a_delete_whose_key_custody_cannot_destroy_is_not_succeeded(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: the relay accepted the kind 5, custody then failed to destroy the
    # key, and `succeeded` was recorded final: the deleted agent kept its key and its
    # credentials, and the identical retry only replayed. Now the credentials go first,
    # the answer is `indeterminate`, and the retry finishes the deletion.
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    owner_cred = broker.credential(owner, [channel])
    made = await broker.call(owner_cred, "agents.create", {
        "channelId": channel, "displayName": "doomed", "systemPrompt": "p"})
    kid = made["outcome"]["agentPubkey"]
    kid_cred = broker.credential(kid, [channel])
    assert (await broker.call(kid_cred, "storage.address", {"slug": "core"}))["status"] \
        == "succeeded"
    seams = Seams(monkeypatch)
    seams.arm("destroy")
    body = request_body("agents.delete", {"target": {"pubkey": kid}}, request_id="delete-1")
    status, answer = await broker.post(body, owner_cred)
    assert seams.failed and status == 200 and answer is not None
    assert (answer["status"], answer["error"]["code"]) == ("indeterminate", "internal"), answer
    assert broker.app.custody.agent(kid) is not None  # the key waits for the retry...
    refused = await broker.call(kid_cred, "storage.address", {"slug": "core"})
    assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthenticated")
    seams.arm(None)
    status, again = await broker.post(body, owner_cred)
    assert status == 200 and again is not None
    assert again["status"] == "succeeded" and "replayed" not in again, again
    assert broker.app.custody.agent(kid) is None  # ...and the retry destroyed it


async def test_a_fault_replaying_a_success_is_not_failed(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recorded success is never turned into `failed`: a fault on the replay's way out
    (the ledger's anchor raising what the recorder does not contain) is `indeterminate` +
    `internal`, and the replay answers the success again once the fault is gone."""
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent("poster")
    cred = broker.credential(agent, [channel])
    body = request_body("message.post", {"channelId": channel, "content": "once"})
    _, first = await broker.post(body, cred)
    assert first is not None and first["status"] == "succeeded", first

    async def broken_anchor(*_: Any, **__: Any) -> None:
        raise Injected("anchor")
    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "anchor", broken_anchor)
        _, replay = await broker.post(body, cred)
    assert replay is not None
    assert (replay["status"], replay["error"]["code"]) == ("indeterminate", "internal"), replay
    _, again = await broker.post(body, cred)
    assert again == {**first, "replayed": True}


async def test_a_fault_that_escapes_after_an_accepted_publish_is_indeterminate(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Broker.handle`'s last resort answers `indeterminate` once events were handed to the
    relay: here the relay took the post and the pipeline dies at `before_verdict`;
    `failed` would promise the post away. The identical retry resumes the same event."""
    from daemon.pipeline.broker import Broker

    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent("poster")
    cred = broker.credential(agent, [channel])
    relay = RelaySpy(monkeypatch)
    passed = Broker._passed

    def dies(self: Broker, step: str) -> None:
        if step == "before_verdict":
            raise Injected("the pipeline died here")
        passed(self, step)
    monkeypatch.setattr(Broker, "_passed", dies)
    body = request_body("message.post", {"channelId": channel, "content": "taken"})
    _, first = await broker.post(body, cred)
    assert first is not None
    assert (first["status"], first["error"]["code"]) == ("indeterminate", "internal"), first
    [(event_id, _kind, _result)] = relay.take()
    monkeypatch.setattr(Broker, "_passed", passed)
    _, again = await broker.post(body, cred)
    assert again is not None and again["status"] == "succeeded", again
    assert again["outcome"]["eventId"] == event_id


async def test_a_rolled_back_retry_the_ledger_cannot_finish_still_answers_its_failed(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `failed` a rolled-back record stores is answered even when the retry's finish
    fails again (recorder: the one verdict answered unrecorded is the stored one): the
    retry of a refused post replays it, never turns it `indeterminate`, sends nothing."""
    import sqlite3

    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent("poster")
    cred = broker.credential(agent, [channel])
    relay = RelaySpy(monkeypatch, refuse=1)

    async def cannot_finish(*_: Any, **__: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")
    finish = Ledger.finish
    monkeypatch.setattr(Ledger, "finish", cannot_finish)
    body = request_body("message.post", {"channelId": channel, "content": "refused"})
    _, first = await broker.post(body, cred)
    assert first is not None
    assert (first["status"], first["error"]["code"]) == ("failed", "action_failed"), first
    _, second = await broker.post(body, cred)  # rolled back; the finish fails again
    assert second is not None
    assert second.get("replayed") is True and second["error"] == first["error"], second
    monkeypatch.setattr(Ledger, "finish", finish)
    _, third = await broker.post(body, cred)
    assert third == second
    assert [type(r).__name__ for _i, _k, r in relay.take()] == ["Rejected"]


async def test_a_rollback_whose_key_custody_cannot_destroy_is_retried_until_it_is(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused agents.create whose minted key custody cannot destroy is not made final:
    the retry (a rolled-back record: no key of its own in hand) looks the record's key up
    by its mint reference and stays `indeterminate` + `internal` while it cannot destroy
    it, then destroys it and replays the stored `failed`. Final too early, the key would
    outlive its record, unreachable through the API."""
    from daemon.state.ledger import LEDGER_FILENAME, State, read_record

    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    relay = RelaySpy(monkeypatch, refuse=1)
    destroy = Custody.destroy_agent
    broken = True

    async def maybe_destroy(self: Custody, *args: Any, **kwargs: Any) -> Any:
        if broken:  # the rollback's step and destroy_minted's, every time
            raise Injected("token busy")
        return await destroy(self, *args, **kwargs)
    monkeypatch.setattr(Custody, "destroy_agent", maybe_destroy)
    request_id = f"undestroyable-{next(_counter)}"
    body = request_body("agents.create", {"channelId": channel, "displayName": "kid",
                                          "systemPrompt": "p"}, request_id=request_id)
    for attempt in range(2):
        _, answer = await broker.post(body, cred)
        assert answer is not None
        assert (answer["status"], answer["error"]["code"]) == ("indeterminate", "internal"), \
            (attempt, answer)
        [kept] = _minted(broker, owner, request_id)
        assert broker.custody.agent(kept.pubkey) is not None  # custody could not destroy it
        record = read_record(broker.state_dir / LEDGER_FILENAME, owner, request_id)
        assert record is not None and record[0] is not State.FINAL, (attempt, record)
    broken = False
    _, third = await broker.post(body, cred)
    assert third is not None
    assert (third["status"], third["error"]["code"]) == ("failed", "action_failed"), third
    assert _destroyed(broker, owner, request_id)
    assert [type(r).__name__ for _i, _k, r in relay.take()] == ["Rejected"]  # sent once


async def test_a_minted_key_custody_cannot_destroy_is_destroyed_and_revoked_on_retry(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed agents.create whose key custody cannot destroy is `indeterminate` +
    `internal` (never `failed` beside a live key); the retry, refused by policy meanwhile,
    destroys the record's key and revokes every credential issued for it."""
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])
    seams = Seams(monkeypatch)
    mint = Custody.mint_agent

    async def answer_lost(self: Custody, *args: Any, **kwargs: Any) -> Any:
        from custody.custodian.client import CustodianUnavailable
        await mint(self, *args, **kwargs)  # custody made the key; its answer never came
        raise CustodianUnavailable("answered after the deadline")
    request_id = f"kept-{next(_counter)}"
    body = request_body("agents.create", {"channelId": channel, "displayName": "kid",
                                          "systemPrompt": "p"}, request_id=request_id)
    with monkeypatch.context() as patch:
        patch.setattr(Custody, "mint_agent", answer_lost)
        seams.arm("destroy")
        _, first = await broker.post(body, cred)
    assert seams.failed and first is not None
    assert (first["status"], first["error"]["code"]) == ("indeterminate", "internal"), first
    [kid] = _minted(broker, owner, request_id)
    kid_cred = broker.credential(kid.pubkey, [channel])

    seams.arm(None)
    broker.reconfigure('[policy]\ndisabled_actions = ["agents.create"]\n')
    _, again = await broker.post(body, cred)
    assert again is not None
    assert (again["status"], again["error"]["code"]) == ("failed", "unsupported"), again
    assert _destroyed(broker, owner, request_id)
    # Revoked, not only refused by liveness (its agent is gone): the store holds it no more.
    assert broker.app.sessions.authenticate(f"Bearer {kid_cred}", None,
                                            int(time.time())) is None
