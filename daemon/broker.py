"""The pipeline: one HTTP request in, one verdict out, in the order the contract fixes.

Order of judgement (README, "How a request is judged"):

    correlate → authenticate → ledger → validate → authorize → execute → record → respond

1. correlate: a body whose `requestId` cannot be read gets HTTP 400 and no envelope — any
   envelope would be uncorrelated, which the client must treat as no answer anyway.
2. authenticate: no valid credential → `failed` + `unauthenticated`, whatever else is wrong.
   Not recorded: there is no principal to record it under.
3. ledger: (agent, requestId) with the body's sha256. The ledger is the agent's, shared by
   its credentials, so an outcome is only handed to a credential whose own scope covers
   the request (`policy.within_credential`). A finished record replays with
   `replayed: true`; another digest is a `request_id_conflict` (the original untouched); an
   identical request still running here is waited for; a pending record left by a crash or
   an `indeterminate` is resumed by re-sending exactly its signed events.
4. validate, 5. authorize (credential scope, host switches, ownership, depth, runtime,
   then rate limits and quotas): every refusal is a `failed` verdict and is recorded, so
   one requestId always has one verdict.
6. execute: reads answer directly. A publishing operation signs everything first (a
   `Plan`, through the `SigningBatcher`), then the audit *intent* record and the ledger's
   *pending* record are written durably, in that order, and only then does anything reach
   the relay.
7. record, 8. respond: the verdict is committed to the ledger (final unless
   `indeterminate`) and to the audit log, and returned with HTTP 200.

No audit, no answer: a verdict that has no side effects and cannot be audited becomes
`failed` + `internal`; once the relay has answered, the verdict stands whatever the audit
log can still record (the intent record already names the events). A fault before any
side effect (token, ledger, audit) is `failed` + `internal`, the spec's known no-op; no
exception reaches the HTTP layer as a 500.

Unexpected faults (issue 15 item 4, issue 13 item 1): any exception at any step, once the
requestId is known, is still an envelope, recorded like every verdict where the ledger
can. `_Progress.effects_possible` decides which: `failed` + `internal` while nothing can
have taken hold; `indeterminate` + `internal` once an event was handed to the relay, a
pending record is being resumed, or a recorded non-failed verdict is being replayed (a
recorded success is never turned into `failed`). After every event was accepted, a fault
in housekeeping, the ledger's finish or the verdict's audit record leaves the verdict
standing. An agents.create that ends `failed` destroys the key it minted
(`_destroy_minted`); one that ends `indeterminate` keeps it for the identical retry.

Publishing outcomes (issue 5): every event accepted (`duplicate:` included) → `succeeded`;
the *first* event refused or unsendable → nothing took hold → roll back host-local work and
answer `failed` + `action_failed` with the relay's reason; no `OK` (timeout, dropped
connection) → `indeterminate` + `outcome_unknown`; a refusal *after* an accepted event of a
multi-event plan → partial effects exist, so `failed` would lie: `indeterminate` +
`outcome_unknown`, and the identical retry re-sends the same events (accepted ones come back
`duplicate:`) until the relay takes the rest.

WARNING: the status/code pairs used here must be allowed by `buzzwire.contract.PAIRING`;
`Verdict`'s constructors assert it. `CHECKPOINTS` names the steps the crash tests kill at;
keep it in step with the `_passed(...)` calls.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from custody import Custody, CustodyError
from daemon.audit import AUDIT_DIRNAME, AuditLog, AuditRecord, AuditUnavailable, Phase
from daemon.config import Config, PolicyConfig
from buzzwire.contract import (
    ACTIONS,
    MESSAGES,
    REQUEST_MEMBERS,
    ErrorCode,
    Reading,
    Status,
    Verdict,
    encode_response,
    mark_replayed,
    read_request,
)
from daemon.cursor import CursorCodec, CursorKeyError
from daemon.http import HttpAnswer, HttpRequest
from daemon.ledger import Conflict, Fresh, Ledger, LedgerKey, Replay, Resume
from daemon.log import log_event
from daemon.metrics import Metrics
from daemon.operations import OPERATIONS, Context, Plan
from daemon.operations._base import OperationRefused
from daemon.policy import authorize, within_credential
from daemon.ratelimit import RateLimiter
from daemon.relay import Accepted, RelayPool, RelayTimeouts, Unknown
from daemon.runtimes import RuntimeStore
from daemon.sessions import Principal, SessionStore
from daemon.signing import SigningBatcher

__all__ = ["Broker", "StartupError", "PENDING_FORMAT", "CHECKPOINTS", "relay_pool"]

_log = logging.getLogger("buzz_broker.broker")

#: Steps a publishing request passes, named for the crash tests (design.md step 4):
#:   before_pending -- the plan is signed, nothing durable yet
#:   after_pending  -- the pending record is committed, nothing sent
#:   after_verdict  -- the verdict is committed, the response not yet written
#: The relay-side steps (EVENT sent, OK received) are the test relay's to kill at.
CHECKPOINTS = ("before_pending", "after_pending", "after_verdict")
#: Version of the pending record's JSON layout; a record of another version is never guessed at.
PENDING_FORMAT = 1
#: How often the ledger's retention sweep runs (design.md: the database stays bounded).
SWEEP_INTERVAL_SECONDS = 3600.0
#: Longest relay reason quoted back to an agent; the rest goes to the operator log only.
MAX_REASON_CHARS = 200


class StartupError(Exception):
    """The daemon cannot start; the message is one line for the operator."""


def relay_pool(config: Config, custody: Custody,
               observer: Callable[[str, str, float], None] | None = None) -> RelayPool:
    """The relay pool for `config`, authenticating each agent's connection through custody.

    Raises:
        ValueError: the relay URL is refused (see daemon.relay.check_relay_url).
    """

    async def sign_auth(agent: str, relay_url: str, challenge: str, created_at: int
                        ) -> dict[str, Any]:
        try:
            signed = await custody.sign_auth(agent, relay_url, challenge, created_at)
        except CustodyError as exc:
            # The pool maps ValueError to "could not authenticate"; anything else would
            # escape a publish as a crash.
            raise ValueError(f"custody did not sign AUTH: {type(exc).__name__}") from None
        return dict(signed.to_json_obj())

    timeouts = RelayTimeouts(
        connect=config.relay.connect_timeout,
        ok=config.relay.ok_timeout,
        eose=config.relay.eose_timeout,
        idle_seconds=config.relay.idle_seconds,
    )
    return RelayPool(config.relay.url, sign_auth, timeouts=timeouts, observer=observer)


@dataclass(frozen=True, slots=True)
class Pending:
    """What the ledger holds between the pending commit and the verdict (design.md step 4)."""

    action: str
    events: tuple[Mapping[str, Any], ...]
    success: bytes  # the encoded `succeeded` response, known before publishing
    rollback: Mapping[str, Any] = field(default_factory=dict)
    commit: Mapping[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "v": PENDING_FORMAT,
                "action": self.action,
                "events": list(self.events),
                "success": self.success.decode("utf-8"),
                "rollback": dict(self.rollback),
                "commit": dict(self.commit),
            },
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> Pending:
        obj = json.loads(data)
        if obj.get("v") != PENDING_FORMAT:
            raise ValueError(f"pending record format {obj.get('v')!r} is not {PENDING_FORMAT}")
        return cls(
            action=obj["action"],
            events=tuple(obj["events"]),
            success=obj["success"].encode("utf-8"),
            rollback=obj.get("rollback", {}),
            commit=obj.get("commit", {}),
        )


@dataclass(frozen=True, slots=True)
class _Judged:
    """A verdict reached after the ledger: its bytes, and the facts the log and metrics need.

    `published` True: the relay was asked, so what happened there stands whatever the
    audit log can still record.
    """

    response: bytes
    status: Status
    code: ErrorCode | None = None
    event_ids: tuple[str, ...] = ()
    published: bool = False


@dataclass(slots=True)
class _Progress:
    """How far one request got: what an unexpected fault may still promise (module docstring).

    `effects_possible` turns True the moment something may have taken hold: the first
    event handed to the relay, a resumed pending record (an earlier attempt may have sent
    it), or a recorded non-failed verdict being replayed. From then on a fault answers
    `indeterminate`, never `failed`.
    """

    effects_possible: bool = False
    event_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Facts:
    """What the audit log says about one authenticated request (never its arguments)."""

    credential_id: str
    agent: str
    action: str | None
    request_id: str
    body_sha256: str

    def record(self, phase: Phase, at: float, *, status: Status | None = None,
               code: ErrorCode | None = None, events: tuple[str, ...] = (),
               replayed: bool = False) -> AuditRecord:
        return AuditRecord(phase=phase, at=at, credential_id=self.credential_id,
                           agent=self.agent, action=self.action, request_id=self.request_id,
                           body_sha256=self.body_sha256, status=status, code=code,
                           events=events, replayed=replayed)


def _shielded(close: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """A close that still runs to the end when the daemon is being cancelled."""

    async def run() -> None:
        with trio.CancelScope(shield=True):
            await close()

    return run


def _quote_reason(reason: str) -> str:
    printable = "".join(ch if ch.isprintable() else " " for ch in reason).strip()
    return printable[:MAX_REASON_CHARS] or "no reason given"


class _AgentLocks:
    """One lock per agent for read-merge-write operations, dropped when nobody holds it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[trio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, agent: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(agent, (trio.Lock(), 0))
        self._locks[agent] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[agent]
            if users == 1:
                del self._locks[agent]
            else:
                self._locks[agent] = (lock, users - 1)


class Broker:
    """The application `daemon.http.serve` hands each request to."""

    def __init__(
        self,
        *,
        config: Config,
        custody: Custody,
        sessions: SessionStore,
        ledger: Ledger,
        relay: RelayPool,
        cursors: CursorCodec,
        limiter: RateLimiter,
        audit: AuditLog,
        runtimes: RuntimeStore,
        clock: Callable[[], float] = time.time,
        config_loader: Callable[[], Config] | None = None,
        metrics: Metrics | None = None,
        checkpoint: Callable[[str], None] | None = None,
    ) -> None:
        self._config = config
        self._policy: PolicyConfig = config.policy
        self._custody = custody
        self._sessions = sessions
        self._ledger = ledger
        self._relay = relay
        self._cursors = cursors
        self._limiter = limiter
        self._audit = audit
        self._runtimes = runtimes
        self._signer = SigningBatcher(custody)
        self._clock = clock
        self._config_loader = config_loader
        self._locks = _AgentLocks()
        self.metrics = metrics if metrics is not None else Metrics(actions=ACTIONS)
        self._checkpoint = checkpoint

    @property
    def custody(self) -> Custody:
        """The custody facade this broker signs with (for the admin paths and tests)."""
        return self._custody

    @property
    def sessions(self) -> SessionStore:
        return self._sessions

    @property
    def runtimes(self) -> RuntimeStore:
        """The host's own record of each managed agent's runtime (for the CLI and tests)."""
        return self._runtimes

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        config: Config,
        *,
        config_loader: Callable[[], Config] | None = None,
        checkpoint: Callable[[str], None] | None = None,
    ) -> AsyncIterator[Broker]:
        """Open custody, the stores and the relay pool; close them all on exit.

        Args:
          config: the loaded configuration.
          config_loader: re-reads the configuration on SIGHUP (policy only).
          checkpoint: called with the name of each step in `CHECKPOINTS` as a request
            passes it. The crash tests kill the process there; production passes None.

        Raises:
          StartupError: one line naming what is wrong (token, PIN, KEK, state directory).
        """
        state_dir = Path(config.state.dir)
        try:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"state directory {state_dir}: {exc.strerror}") from None
        token = config.pkcs11.token()
        async with AsyncExitStack() as stack:
            try:
                custody = await Custody.open(token, state_dir, config.pkcs11.cache())
            except CustodyError as exc:
                raise StartupError(str(exc)) from None
            stack.push_async_callback(_shielded(custody.aclose))
            try:
                sessions = SessionStore.open(state_dir)
                stack.callback(sessions.close)
                ledger = Ledger.open(
                    state_dir / "ledger.db",
                    retention_seconds=config.state.ledger_retention_seconds,
                )
                stack.callback(ledger.close)
                limiter = RateLimiter.open(state_dir, config.limits)
                stack.callback(limiter.close)
                cursors = CursorCodec.open(state_dir)
                runtimes = RuntimeStore.open(state_dir)
                stack.callback(runtimes.close)
            except (OSError, sqlite3.Error, CursorKeyError) as exc:
                raise StartupError(f"state directory {state_dir}: {exc}") from None
            try:
                audit = AuditLog.open(state_dir / AUDIT_DIRNAME)
            except AuditUnavailable as exc:
                raise StartupError(f"audit log: {exc.detail or exc}") from None
            stack.push_async_callback(_shielded(audit.aclose))

            metrics = Metrics(actions=ACTIONS)
            custody.observe_token_calls(metrics.token_call)

            try:
                relay = relay_pool(config, custody, observer=metrics.relay_round_trip)
            except ValueError as exc:
                raise StartupError(f"relay url: {exc}") from None
            broker = cls(
                config=config,
                custody=custody,
                sessions=sessions,
                ledger=ledger,
                relay=relay,
                cursors=cursors,
                limiter=limiter,
                audit=audit,
                runtimes=runtimes,
                config_loader=config_loader,
                metrics=metrics,
                checkpoint=checkpoint,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(relay.run)
                await nursery.start(broker._signer.run)
                await nursery.start(limiter.flush_periodically)
                nursery.start_soon(broker._sweep_forever)
                log_event(_log, "broker.ready", agents=len(custody.agents()),
                          relay=config.relay.url)
                for record in custody.agents():
                    if record.auth_tag is None:
                        # Its owner is a person whose key is not here: its events carry no
                        # NIP-OA tag until the owner signs one (`agent attach-auth`).
                        log_event(_log, "agent.auth_tag_missing", level=logging.WARNING,
                                  agent=record.pubkey, owner=record.owner,
                                  fix="buzz-broker agent attach-auth")
                try:
                    yield broker
                finally:
                    nursery.cancel_scope.cancel()

    def reload(self) -> None:
        """SIGHUP: credentials and policy again from disk, without dropping connections."""
        self._sessions.reload()
        self._limiter.reload()
        if self._config_loader is not None:
            try:
                config = self._config_loader()
            except Exception as exc:  # noqa: BLE001 - a bad file keeps the running policy
                log_event(_log, "reload.config_rejected", error=type(exc).__name__,
                          detail=str(exc))
                return
            self._policy = config.policy
            self._limiter.reconfigure(config.limits)
        log_event(_log, "reload.done")

    async def _sweep_forever(self) -> None:
        while True:
            removed = await self._ledger.sweep(int(self._clock()))
            if removed:
                log_event(_log, "ledger.swept", removed=removed)
            self.metrics.set_ledger_size(await self._ledger.count())
            await trio.sleep(SWEEP_INTERVAL_SECONDS)

    def _passed(self, step: str) -> None:
        if self._checkpoint is not None:
            self._checkpoint(step)

    # ---------------------------------------------------------------- the pipeline

    async def handle(self, request: HttpRequest) -> HttpAnswer:
        """One request in, one answer out; an unexpected fault is still an envelope.

        A fault the pipeline did not contain itself answers `failed` + `internal` while
        nothing can have taken hold, else `indeterminate` + `internal` (`_Progress`); only
        a body without a usable requestId gets no envelope (HTTP 400).
        """
        started = time.monotonic()
        progress = _Progress()
        try:
            return await self._handle(request, started, progress)
        except Exception as exc:  # noqa: BLE001 - the one place nothing may escape past
            reading = read_request(request.body)
            if reading.request_id is None:
                raise
            self._fault("pipeline", None, reading.request_id, _action_of(reading), exc)
            verdict = (Verdict.indeterminate(ErrorCode.INTERNAL) if progress.effects_possible
                       else Verdict.failed(ErrorCode.INTERNAL))
            return self._respond(reading.request_id,
                                 encode_response(reading.request_id, verdict), started,
                                 principal=None, action=_action_of(reading), verdict=verdict)

    async def _handle(self, request: HttpRequest, started: float, progress: _Progress
                      ) -> HttpAnswer:
        reading = read_request(request.body)
        if reading.request_id is None:
            log_event(_log, "request.uncorrelated", bytes=len(request.body),
                      detail=reading.error.detail if reading.error else "")
            self.metrics.request(None, None, None, time.monotonic() - started)
            return HttpAnswer(status=400, body=None)
        request_id = reading.request_id
        principal = self._sessions.authenticate(
            request.authorization, request.peer_uid, int(self._clock())
        )
        if principal is None:
            verdict = Verdict.failed(ErrorCode.UNAUTHENTICATED, MESSAGES[ErrorCode.UNAUTHENTICATED])
            return self._respond(request_id, encode_response(request_id, verdict), started,
                                 principal=None, action=_action_of(reading), verdict=verdict)

        digest = hashlib.sha256(request.body).digest()
        facts = _Facts(credential_id=principal.credential_id, agent=principal.agent,
                       action=_action_of(reading), request_id=request_id,
                       body_sha256=digest.hex())
        try:
            begun = await self._ledger.begin(
                LedgerKey(principal=principal.agent, request_id=request_id), digest
            )
        except sqlite3.Error as exc:
            # Nothing has happened and the ledger cannot record: a fault before dispatch.
            self._ledger_failed(facts, "begin", exc)
            return await self._audited_answer(facts, self._internal(request_id), started,
                                              principal)
        if (isinstance(begun, Resume) or (
                isinstance(begun, Replay) and _recorded(begun.response).status is not Status.FAILED
        )) and reading.request is not None:
            # The ledger is the agent's, shared by all of its credentials: a credential may
            # only be handed an outcome (or finish a publish) its own scope allows. A recorded
            # refusal tells nothing and replays as it is. The record is untouched.
            refusal = within_credential(principal, reading.request)
            if refusal is not None:
                if isinstance(begun, Resume):
                    self._ledger.release(begun.ticket)
                refused = self._verdict(request_id, Verdict.failed(refusal.code, refusal.message))
                return await self._audited_answer(facts, refused, started, principal)
        if isinstance(begun, Replay):
            replay = _recorded(begun.response)
            progress.effects_possible = replay.status is not Status.FAILED
            return await self._audited_answer(facts, replay, started, principal, replayed=True)
        if isinstance(begun, Conflict):
            conflict = self._verdict(request_id, Verdict.failed(ErrorCode.REQUEST_ID_CONFLICT))
            return await self._audited_answer(facts, conflict, started, principal)
        assert isinstance(begun, (Fresh, Resume))
        # A pending record being resumed may already be on the relay (an earlier attempt).
        progress.effects_possible = isinstance(begun, Resume)
        try:
            try:
                judged = await self._judge(principal, reading, begun, facts, progress)
            except Exception as exc:  # noqa: BLE001 - contained: an envelope, recorded
                judged = self._contained(facts, progress, exc)
            if facts.action == "agents.create" and judged.status is Status.FAILED:
                judged = await self._destroy_minted(facts, judged)
            # No audit, no answer: a verdict with no side effects that cannot be audited
            # becomes failed + internal (a known no-op, recorded like any verdict).
            if not judged.published and not await self._audited(facts, judged):
                judged = self._internal(request_id)
        except BaseException:
            self._ledger.release(begun.ticket)
            raise
        try:
            await self._ledger.finish(begun.ticket, judged.response,
                                      final=judged.status is not Status.INDETERMINATE)
        except Exception as exc:  # noqa: BLE001 - sqlite3.Error or worse: the verdict stands
            # The verdict stands; only its record is missing. A pending record, if one was
            # committed, is still there, so the identical retry re-sends the same events
            # and reaches the same verdict.
            self._ledger_failed(facts, "finish", exc)
            self._ledger.release(begun.ticket)
        if judged.published:
            # The relay has answered; an audit failure now cannot change what happened. The
            # intent record written before publishing already names these events.
            await self._audited(facts, judged)
        self._passed("after_verdict")
        return self._respond(request_id, judged.response, started, principal=principal,
                             action=facts.action, judged=judged)

    async def _judge(
        self, principal: Principal, reading: Reading, begun: Fresh | Resume, facts: _Facts,
        progress: _Progress,
    ) -> _Judged:
        """Everything after the ledger let this request through."""
        request_id = reading.request_id
        assert request_id is not None
        if isinstance(begun, Resume):
            try:
                pending = Pending.decode(begun.pending)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                # A pending record this version cannot read: its events may or may not have
                # reached the relay, so nothing can be promised and nothing is re-sent.
                log_event(_log, "ledger.pending_unreadable", level=logging.ERROR,
                          agent=principal.agent, request_id=request_id,
                          error=type(exc).__name__)
                return self._verdict(request_id, Verdict.indeterminate(ErrorCode.INTERNAL))
            return await self._publish(principal, request_id, pending, progress, resumed=True)
        if reading.error is not None:
            log_event(_log, "request.invalid", agent=principal.agent, request_id=request_id,
                      code=reading.error.code.value,
                      pointer=_loggable_pointer(reading.error.pointer),
                      detail=reading.error.detail)
            return self._verdict(request_id, Verdict.failed(reading.error.code,
                                                            MESSAGES[reading.error.code]))
        request = reading.request
        assert request is not None
        refusal = authorize(principal, request, self._policy, self._custody)
        if refusal is not None:
            return self._verdict(request_id, Verdict.failed(refusal.code, refusal.message))
        # Only a fresh request costs quota: replays and resumed retries returned above.
        limited = self._limiter.take(principal, request.action, self._clock())
        if limited is not None:
            # Recorded like every verdict (I3): the identical bytes replay this refusal; a
            # new attempt after the limit frees up is a new requestId.
            return self._verdict(request_id, Verdict.failed(limited.code, limited.message))

        operation = OPERATIONS[request.action]
        try:
            # Locks a read-merge-write operation holds until its events are published: the
            # requester's, and any agent it writes for (ctx.hold_agent). They are taken
            # owner first; ownership is a tree, so two requests can never wait on each other.
            async with AsyncExitStack() as held:
                if operation.serialize_per_agent:
                    await held.enter_async_context(self._locks.hold(principal.agent))

                async def hold_agent(agent: str) -> None:
                    if not operation.serialize_per_agent:
                        raise AssertionError(f"{request.action} is not serialized per agent")
                    await held.enter_async_context(self._locks.hold(agent))

                ctx = Context(
                    custody=self._custody,
                    signer=self._signer,
                    relay=self._relay,
                    principal=principal,
                    host=self._policy,
                    cursors=self._cursors,
                    request_id=request_id,
                    now=lambda: int(self._clock()),
                    hold_agent=hold_agent,
                    runtimes=self._runtimes,
                )
                if operation.execute is not None:
                    verdict: Verdict = await operation.execute(ctx, request.args)
                    return self._verdict(request_id, verdict)
                assert operation.prepare is not None
                return await self._plan_and_publish(ctx, operation.prepare, request,
                                                    begun.ticket, facts, progress)
        except OperationRefused as refused:
            if refused.detail:
                log_event(_log, "operation.refused", agent=principal.agent,
                          request_id=request_id, code=refused.code.value, detail=refused.detail)
            return self._verdict(request_id, Verdict.failed(refused.code, refused.message))
        except CustodyError as exc:
            # Raised before anything was published (signing and minting precede the pending
            # record), so the fault is a known no-op: failed + internal, not recorded.
            log_event(_log, "custody.fault", level=logging.ERROR, agent=principal.agent,
                      request_id=request_id, error=type(exc).__name__, detail=str(exc))
            return self._internal(request_id)

    async def _plan_and_publish(
        self, ctx: Context, prepare: Callable[[Context, Any], Any], request: Any, ticket: Any,
        facts: _Facts, progress: _Progress,
    ) -> _Judged:
        result = await prepare(ctx, request.args)
        if isinstance(result, Verdict):
            return self._verdict(ctx.request_id, result)
        assert isinstance(result, Plan)
        pending = Pending(
            action=request.action,
            events=result.events,
            success=encode_response(ctx.request_id, Verdict.succeeded(request.action,
                                                                      result.outcome)),
            rollback=result.rollback,
            commit=result.commit,
        )
        # The intent record comes before the pending record: a pending record whose intent
        # was never audited would be published by the next retry without one.
        try:
            await self._audit.append(facts.record(
                Phase.INTENT, self._clock(), events=tuple(str(e["id"]) for e in pending.events)))
        except Exception as exc:  # noqa: BLE001 - AuditUnavailable or worse: nothing was sent
            self._audit_failed(facts, exc)
            return self._internal(ctx.request_id)
        self._passed("before_pending")
        try:
            await self._ledger.record_pending(ticket, pending.encode())
        except sqlite3.Error as exc:
            self._ledger_failed(facts, "record_pending", exc)
            return self._internal(ctx.request_id)  # nothing was sent
        self._passed("after_pending")
        return await self._publish(ctx.principal, ctx.request_id, pending, progress,
                                   resumed=False)

    async def _publish(
        self, principal: Principal, request_id: str, pending: Pending, progress: _Progress, *,
        resumed: bool,
    ) -> _Judged:
        """Send the pending events in order and say what the relay's answers mean."""
        ids = tuple(str(e["id"]) for e in pending.events)
        progress.event_ids = ids
        verdict = await self._publish_events(principal, request_id, pending, progress,
                                             resumed=resumed)
        if verdict is None:
            return _Judged(pending.success, Status.SUCCEEDED, event_ids=ids, published=True)
        return _Judged(encode_response(request_id, verdict), verdict.status, verdict.code,
                       event_ids=ids, published=True)

    async def _publish_events(
        self, principal: Principal, request_id: str, pending: Pending, progress: _Progress, *,
        resumed: bool,
    ) -> Verdict | None:
        """None when every event was accepted; otherwise the verdict (module docstring)."""
        accepted = 0
        for event in pending.events:
            progress.effects_possible = True
            result = await self._relay.publish(str(event["pubkey"]), dict(event))
            if isinstance(result, Accepted):
                accepted += 1
                continue
            reason = _quote_reason(getattr(result, "reason", ""))
            log_event(_log, "relay.not_accepted", agent=principal.agent, request_id=request_id,
                      event_id=event["id"], result=type(result).__name__, reason=reason,
                      accepted_before=accepted, resumed=resumed)
            if isinstance(result, Unknown):
                return Verdict.indeterminate(
                    ErrorCode.OUTCOME_UNKNOWN,
                    "the relay did not confirm the event; retry the identical request")
            if accepted == 0:
                await self._housekeeping(pending.rollback)
                return Verdict.failed(
                    ErrorCode.ACTION_FAILED, f"the relay did not accept the event: {reason}")
            return Verdict.indeterminate(
                ErrorCode.OUTCOME_UNKNOWN,
                f"the relay accepted {accepted} of {len(pending.events)} events and refused "
                f"the next ({reason}); retry the identical request to finish")
        await self._housekeeping(pending.commit)
        return None

    async def _housekeeping(self, work: Mapping[str, Any]) -> None:
        """Host-local follow-ups named by a plan; each is safe to run twice.

        A fault here cannot change the verdict (the relay has already answered), so it is
        logged for the operator and the verdict stands.
        """
        try:
            if "destroy_agent" in work:
                pubkey = str(work["destroy_agent"])
                if self._custody.agent(pubkey) is not None:
                    await self._custody.destroy_agent(pubkey)
                self._sessions.revoke_agent(pubkey)
            if "rename_agent" in work:
                rename = work["rename_agent"]
                if self._custody.agent(str(rename["pubkey"])) is not None:
                    await self._custody.rename_agent(str(rename["pubkey"]), str(rename["name"]))
            if "set_runtime" in work:
                runtime = work["set_runtime"]
                self._runtimes.set(str(runtime["pubkey"]), str(runtime["runtime"]),
                                   int(self._clock()))
        except Exception as exc:  # noqa: BLE001 - CustodyError, sqlite3.Error or worse
            log_event(_log, "housekeeping.failed", level=logging.ERROR,
                      work=sorted(work), error=type(exc).__name__, where=_where(exc))

    # ---------------------------------------------------------------- answers

    def _verdict(self, request_id: str, verdict: Verdict) -> _Judged:
        return _Judged(encode_response(request_id, verdict), verdict.status, verdict.code)

    def _internal(self, request_id: str) -> _Judged:
        """failed + internal: a fault before any side effect (the spec's known no-op)."""
        return self._verdict(request_id, Verdict.failed(ErrorCode.INTERNAL))

    def _fault(self, step: str, agent: str | None, request_id: str, action: str | None,
               exc: BaseException) -> None:
        # The exception's type and where it was raised, never its text: an unexpected
        # exception's message is not ours to vouch for (it could quote anything).
        log_event(_log, "pipeline.fault", level=logging.ERROR, step=step, agent=agent,
                  request_id=request_id, action=action, error=type(exc).__name__,
                  where=_where(exc))

    def _contained(self, facts: _Facts, progress: _Progress, exc: Exception) -> _Judged:
        """The verdict for an unexpected fault inside the operation: an envelope, recorded.

        `failed` + `internal` while nothing can have taken hold; `indeterminate` +
        `internal` once something may have (its pending record is kept, so the identical
        retry re-sends exactly the same events and reaches the relay's verdict).
        """
        self._fault("operation", facts.agent, facts.request_id, facts.action, exc)
        if not progress.effects_possible:
            return self._internal(facts.request_id)
        verdict = Verdict.indeterminate(ErrorCode.INTERNAL)
        return _Judged(encode_response(facts.request_id, verdict), verdict.status, verdict.code,
                       event_ids=progress.event_ids, published=True)

    async def _destroy_minted(self, facts: _Facts, judged: _Judged) -> _Judged:
        """An agents.create that ends `failed` leaves no key behind (failed = no effect).

        The key minted for this request (found by its mint reference) is destroyed. If it
        cannot be, the answer becomes `indeterminate` + `internal` instead, recorded as not
        final without pending work: the identical retry starts afresh, finds the same key
        through its mint reference, and carries on with it.
        """
        mint_ref = f"{facts.agent}/{facts.request_id}"
        minted = next((a for a in self._custody.agents() if a.mint_ref == mint_ref), None)
        if minted is None:
            return judged
        try:
            await self._custody.destroy_agent(minted.pubkey)
            self._sessions.revoke_agent(minted.pubkey)
        except Exception as exc:  # noqa: BLE001 - the key survives: say so, do not lie
            self._fault("destroy_minted", facts.agent, facts.request_id, facts.action, exc)
            verdict = Verdict.indeterminate(ErrorCode.INTERNAL)
            return _Judged(encode_response(facts.request_id, verdict), verdict.status,
                           verdict.code)
        log_event(_log, "agents.create.minted_destroyed", agent=facts.agent,
                  request_id=facts.request_id, minted=minted.pubkey)
        return judged

    async def _audited(self, facts: _Facts, judged: _Judged, *, replayed: bool = False) -> bool:
        """Append the verdict record; False (and an operator log line) when it cannot be."""
        try:
            await self._audit.append(facts.record(
                Phase.VERDICT, self._clock(), status=judged.status, code=judged.code,
                events=judged.event_ids if judged.status is Status.SUCCEEDED else (),
                replayed=replayed))
        except Exception as exc:  # noqa: BLE001 - AuditUnavailable or worse: not recorded
            self._audit_failed(facts, exc)
            return False
        return True

    async def _audited_answer(self, facts: _Facts, judged: _Judged, started: float,
                              principal: Principal, *, replayed: bool = False) -> HttpAnswer:
        """Answer a verdict the ledger does not (re)record: audited first, or failed + internal.

        No audit, no answer: when the record cannot be written the agent is told
        failed + internal instead, which promises (truthfully) that nothing ran now.
        """
        if not await self._audited(facts, judged, replayed=replayed):
            if replayed and judged.status is not Status.FAILED:
                # A recorded success (or pending fate) is never turned into failed: that
                # would promise no effect took hold, and one did (or may have).
                verdict = Verdict.indeterminate(ErrorCode.INTERNAL)
                judged = _Judged(encode_response(facts.request_id, verdict), verdict.status,
                                 verdict.code)
            else:
                judged = self._internal(facts.request_id)
            replayed = False
        body = mark_replayed(judged.response) if replayed else judged.response
        return self._respond(facts.request_id, body, started, principal=principal,
                             action=facts.action, judged=judged, replayed=replayed)

    def _ledger_failed(self, facts: _Facts, step: str, exc: Exception) -> None:
        detail = str(exc) if isinstance(exc, sqlite3.Error) else _where(exc)
        log_event(_log, "ledger.fault", level=logging.ERROR, agent=facts.agent,
                  request_id=facts.request_id, action=facts.action, step=step,
                  error=type(exc).__name__, detail=detail)

    def _audit_failed(self, facts: _Facts, exc: Exception) -> None:
        detail = exc.detail if isinstance(exc, AuditUnavailable) else _where(exc)
        log_event(_log, "audit.unavailable", level=logging.ERROR, agent=facts.agent,
                  request_id=facts.request_id, action=facts.action, detail=detail)

    def _respond(
        self,
        request_id: str,
        body: bytes,
        started: float,
        *,
        principal: Principal | None,
        action: str | None,
        verdict: Verdict | None = None,
        judged: _Judged | None = None,
        replayed: bool = False,
    ) -> HttpAnswer:
        fields: dict[str, Any] = {
            "request_id": request_id,
            "agent": principal.agent if principal else None,
            "action": action,
            "duration_ms": round((time.monotonic() - started) * 1000, 3),
        }
        if verdict is not None:
            judged = _Judged(body, verdict.status, verdict.code)
        if judged is not None:
            fields["status"] = judged.status.value
            fields["code"] = judged.code.value if judged.code else None
            if judged.event_ids:
                fields["event_ids"] = list(judged.event_ids)
        if replayed:
            fields["replayed"] = True
        log_event(_log, "verdict", **{k: v for k, v in fields.items() if v is not None})
        self.metrics.request(action, fields.get("status"), fields.get("code"),
                             time.monotonic() - started)
        return HttpAnswer(status=200, body=body)


#: In our own canonical encoding (compact, keys unescaped) these members can only appear as
#: the envelope's: inside a string value every quote is escaped.
_STATUS_MEMBER = re.compile(rb'"status":"([a-z]+)"')
_CODE_MEMBER = re.compile(rb'"code":"([a-z_]+)"')


def _recorded(response: bytes) -> _Judged:
    """The status and code of a verdict the ledger recorded (for the log and metrics)."""
    status = _STATUS_MEMBER.search(response)
    code = _CODE_MEMBER.search(response)
    return _Judged(
        response,
        Status(status.group(1).decode()) if status else Status.FAILED,
        ErrorCode(code.group(1).decode()) if code else None,
    )


#: Every member name the contract knows; any other pointer segment came from the agent.
_KNOWN_MEMBERS = frozenset(REQUEST_MEMBERS).union(*(s.member_names for s in ACTIONS.values()))


def _loggable_pointer(pointer: str) -> str:
    """The JSON pointer with every segment the agent chose replaced.

    An unknown member's name is the agent's text and could be anything, a credential pasted
    in the wrong place included; the log keeps the shape of the path, not the name.
    """
    return "/".join(
        seg if seg in _KNOWN_MEMBERS or seg.isdigit() or seg == "" else "<unknown>"
        for seg in pointer.split("/")
    )


def _action_of(reading: Reading) -> str | None:
    return reading.request.action if reading.request is not None else None


def _where(exc: BaseException) -> str:
    """`file:line` where an exception was raised (its innermost frame), for the operator."""
    tb = exc.__traceback__
    if tb is None:
        return "unknown"
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}"
