"""The pipeline: one HTTP request in, one verdict out, in the order the contract fixes.

Order of judgement (README, "How a request is judged"):

    correlate → authenticate → ledger → validate → authorize → execute → record → respond

1. correlate: a body whose `requestId` cannot be read gets HTTP 400 and no envelope — any
   envelope would be uncorrelated, which the client must treat as no answer anyway.
2. authenticate: no valid credential → `failed` + `unauthenticated`, whatever else is wrong.
   Not recorded: there is no principal to record it under.
2b. the agent must be live (held and not removed): a credential of a removed agent is
   `unauthenticated` too, however the agent was removed (issue 13).
3. ledger: (agent, requestId) with the body's sha256. The ledger is the agent's, shared by
   its credentials. A request outside its credential's own scope
   (`policy.within_credential`) is keyed `<agent>/<credential id>` instead, so it is
   never handed the agent's record and its refusal never pre-empts the requestId for the
   agent's other credentials (`_ledger_principal`). A finished record replays with
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
   `indeterminate`; a refusal as its code, daemon/verdict_store.py) and to the audit log
   (past a credential's burst, refusals are counted: daemon/refusal_audit.py), and
   returned with HTTP 200.

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
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from buzzwire.nostr import SignedEvent

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
from daemon.ledger import Conflict, Fresh, Full, Ledger, LedgerKey, Replay, Resume
from daemon.refusal_audit import RefusalAudit
from daemon.verdict_store import expanded_form, stored_form
from daemon.log import log_event
from daemon.metrics import Metrics
from daemon.operations import OPERATIONS, Context, Operation, Plan
from daemon.operations._base import OperationRefused
from daemon.pending import Cleanup, DestroyAgent, Pending, RenameAgent, steps_named
from daemon.policy import Authorized, Refusal, authorize, within_credential
from daemon.ratelimit import RateLimiter
from daemon.relay import Accepted, AuthNotSigned, RelayPool, RelayTimeouts, Unknown
from daemon.runtimes import RuntimeStore
from daemon.sessions import LAST_USE_FLUSH_SECONDS, Principal, SessionStore
from daemon.signing import SigningBatcher

__all__ = ["Broker", "StartupError", "CHECKPOINTS", "relay_pool"]

_log = logging.getLogger("buzz_broker.broker")

#: Steps a publishing request passes, named for the crash tests (design.md step 4):
#:   before_pending -- the plan is signed, nothing durable yet
#:   after_pending  -- the pending record is committed, nothing sent
#:   after_verdict  -- the verdict is committed, the response not yet written
#: The relay-side steps (EVENT sent, OK received) are the test relay's to kill at.
CHECKPOINTS = ("before_pending", "after_pending", "after_verdict")
#: How often the ledger's retention sweep runs (design.md: the database stays bounded).
SWEEP_INTERVAL_SECONDS = 3600.0
#: The refusal when an agent's ledger records reach `state.ledger_max_bytes_per_agent`.
LEDGER_FULL = ("this agent's request records are at the host's limit; retry after older "
               "records expire")
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
                        ) -> SignedEvent:
        try:
            return await custody.sign_auth(agent, relay_url, challenge, created_at)
        except CustodyError as exc:
            raise AuthNotSigned(type(exc).__name__) from None

    timeouts = RelayTimeouts(
        connect=config.relay.connect_timeout,
        ok=config.relay.ok_timeout,
        eose=config.relay.eose_timeout,
        idle_seconds=config.relay.idle_seconds,
    )
    return RelayPool(config.relay.url, sign_auth, timeouts=timeouts, observer=observer)


#: How often a request takes its locks again because its target changed while it waited;
#: past that, `failed` + `internal` (nothing has happened).
_LOCK_ATTEMPTS = 3


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
    """One lock per agent for read-merge-write operations, dropped when nobody holds it.

    A request that needs several agents' locks takes them with `hold_all`, in one global
    order (sorted pubkeys), so two requests can never each hold a lock the other waits for
    — whatever the ownership records say (a keystore imported before cycles were refused
    may hold a cycle; issue 13).
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[trio.Lock, int]] = {}

    @asynccontextmanager
    async def hold_all(self, agents: Iterable[str]) -> AsyncIterator[None]:
        async with AsyncExitStack() as held:
            for agent in sorted(set(agents)):
                await held.enter_async_context(self.hold(agent))
            yield

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
        #: agent -> live, valid while custody.records_version() is `_live_version`
        self._live: dict[str, bool] = {}
        self._live_version: tuple[int, int] | None = None
        self.metrics = metrics if metrics is not None else Metrics(actions=ACTIONS)
        self._checkpoint = checkpoint
        self.refusals = RefusalAudit(audit, clock)

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
                custody = await Custody.open(token, state_dir)
            except CustodyError as exc:
                raise StartupError(str(exc)) from None
            stack.push_async_callback(_shielded(custody.aclose))
            try:
                sessions = SessionStore.open(state_dir)
                stack.callback(sessions.close)
                ledger = Ledger.open(
                    state_dir / "ledger.db",
                    retention_seconds=config.state.ledger_retention_seconds,
                    max_bytes_per_principal=config.state.ledger_max_bytes_per_agent,
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
                audit = AuditLog.open(state_dir / AUDIT_DIRNAME, anchor=ledger.audit_anchor)
            except AuditUnavailable as exc:
                raise StartupError(f"audit log: {exc.detail or exc}") from None
            stack.push_async_callback(_shielded(audit.aclose))
            if ledger.audit_anchor is None and audit.head[0] > 0:
                # A ledger from before anchors, or one deleted: nothing to hold the log to.
                log_event(_log, "audit.anchor_adopted", level=logging.WARNING,
                          seq=audit.head[0], head=audit.head[1])
            # From here every ledger commit records the audit head it follows.
            ledger.anchor_audit(lambda: audit.head)

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

            async def last_counts() -> None:
                # Before the audit log closes: the open refusal counts, then the anchor.
                await broker.refusals.flush(everything=True)
                try:
                    await ledger.anchor()
                except sqlite3.Error as exc:
                    log_event(_log, "ledger.fault", level=logging.ERROR, step="anchor",
                              error=type(exc).__name__, detail=str(exc))

            stack.push_async_callback(_shielded(last_counts))
            async with trio.open_nursery() as nursery:
                await nursery.start(relay.run)
                await nursery.start(broker._signer.run)
                await nursery.start(limiter.flush_periodically)
                nursery.start_soon(broker._sweep_forever)
                nursery.start_soon(broker._flush_last_use_forever)
                await nursery.start(broker.refusals.run)
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

    async def _flush_last_use_forever(self) -> None:
        # Last use is noted in memory per request and written here (daemon/sessions: no
        # write per request); `SessionStore.close` writes the rest at shutdown.
        while True:
            await trio.sleep(LAST_USE_FLUSH_SECONDS)
            try:
                self._sessions.flush_last_use()
            except sqlite3.Error as exc:
                log_event(_log, "sessions.last_use_unwritten", level=logging.WARNING,
                          error=type(exc).__name__, detail=str(exc))

    def _agent_live(self, principal: Principal) -> bool:
        """Authority ends when the agent ends (issue 13): a credential whose agent is gone —
        removed by `agent remove`, agents.delete, or any other path, its credentials
        revoked or not — authenticates nothing.

        Checked on every request. The answers are kept while custody's records version
        stays the same (any keystore commit, in any process, changes it), so a request
        costs one read of SQLite's change counter, not a keystore query
        (benchmarks/authenticate.py). The cache holds one entry per agent that presented
        a valid credential: bounded by the credentials issued, not by clients.

        Raises:
            CustodyError: the keystore cannot be read.
        """
        version = self._custody.records_version()
        if version != self._live_version:
            self._live.clear()
            self._live_version = version
        live = self._live.get(principal.agent)
        if live is None:
            live = self._live[principal.agent] = self._custody.agent(principal.agent) is not None
        if not live:
            log_event(_log, "auth.agent_not_live", credential_id=principal.credential_id,
                      agent=principal.agent)
        return live

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
        if principal is not None:
            try:
                live = self._agent_live(principal)
            except CustodyError as exc:
                log_event(_log, "custody.fault", level=logging.ERROR, agent=principal.agent,
                          request_id=request_id, error=type(exc).__name__, detail=str(exc))
                verdict = Verdict.failed(ErrorCode.INTERNAL)
                return self._respond(request_id, encode_response(request_id, verdict), started,
                                     principal=principal, action=_action_of(reading),
                                     verdict=verdict)
            if not live:
                principal = None
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
                LedgerKey(principal=_ledger_principal(principal, reading), request_id=request_id),
                digest,
            )
        except sqlite3.Error as exc:
            # Nothing has happened and the ledger cannot record: a fault before dispatch.
            self._ledger_failed(facts, "begin", exc)
            return await self._audited_answer(facts, self._internal(request_id), started,
                                              principal)
        if isinstance(begun, Full):
            # Not recorded: recording it would grow what the cap bounds (docs/operations.md).
            log_event(_log, "ledger.agent_full", level=logging.WARNING, agent=principal.agent,
                      request_id=request_id)
            full = self._verdict(request_id, Verdict.failed(ErrorCode.UNAUTHORIZED, LEDGER_FULL))
            return await self._audited_answer(facts, full, started, principal)
        if isinstance(begun, Replay):
            try:
                begun = Replay(expanded_form(request_id, begun.response), begun.status,
                               begun.code)
            except ValueError:
                # A compact refusal this version cannot read (a newer code): it was a
                # failed verdict, so failed + internal promises nothing new.
                log_event(_log, "ledger.record_unreadable", level=logging.ERROR,
                          agent=principal.agent, request_id=request_id)
                return await self._audited_answer(facts, self._internal(request_id), started,
                                                  principal)
        if isinstance(begun, Replay):
            replay = _Judged(begun.response, begun.status, begun.code)
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
            # A refusal is kept as its code (verdict_store); a read's page only briefly.
            await self._ledger.finish(
                begun.ticket,
                stored_form(request_id, judged.response, judged.status, judged.code)
                if not judged.published else judged.response,
                judged.status, judged.code,
                keep_seconds=self._config.state.read_retention_seconds
                if judged.status is Status.SUCCEEDED and not judged.published else None)
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
        decision = authorize(principal, request, self._policy, self._custody)
        if isinstance(decision, Refusal):
            return self._verdict(request_id, Verdict.failed(decision.code, decision.message))
        # Only a fresh request costs quota: replays and resumed retries returned above.
        limited = self._limiter.take(principal, request.action, self._clock())
        if limited is not None:
            # Recorded like every verdict (I3): the identical bytes replay this refusal; a
            # new attempt after the limit frees up is a new requestId.
            return self._verdict(request_id, Verdict.failed(limited.code, limited.message))

        operation = OPERATIONS[request.action]
        try:
            if not operation.serialize_per_agent:
                return await self._run(operation, decision, principal, request, begun, facts,
                                       progress)
            # A read-merge-write operation holds the requester's and its target's locks
            # until its events are published, taken in one global order
            # (`_AgentLocks.hold_all`), and is authorized again under them: what it acts
            # on cannot change meanwhile. If the target resolved under the locks is not
            # one they cover (renamed or replaced while waiting), nothing has happened
            # yet: take the locks again with it.
            locked = _lock_set(principal, decision)
            for _attempt in range(_LOCK_ATTEMPTS):
                async with self._locks.hold_all(locked):
                    decision = authorize(principal, request, self._policy, self._custody)
                    if isinstance(decision, Refusal):
                        return self._verdict(request_id,
                                             Verdict.failed(decision.code, decision.message))
                    if set(_lock_set(principal, decision)) <= set(locked):
                        return await self._run(operation, decision, principal, request, begun,
                                               facts, progress)
                locked = (*locked, *_lock_set(principal, decision))
            return self._internal(request_id)
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

    async def _run(self, operation: Operation, decision: Authorized, principal: Principal,
                   request: Any, begun: Fresh | Resume, facts: _Facts, progress: _Progress
                   ) -> _Judged:
        ctx = Context(
            custody=self._custody,
            signer=self._signer,
            relay=self._relay,
            principal=principal,
            host=self._policy,
            cursors=self._cursors,
            request_id=facts.request_id,
            now=lambda: int(self._clock()),
            authorized=decision,
            runtimes=self._runtimes,
        )
        if operation.execute is not None:
            verdict: Verdict = await operation.execute(ctx, request.args)
            return self._verdict(facts.request_id, verdict)
        assert operation.prepare is not None
        return await self._plan_and_publish(ctx, operation.prepare, request,
                                            begun.ticket, facts, progress)

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
                Phase.INTENT, self._clock(), events=tuple(e.id for e in pending.events)))
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
        ids = tuple(e.id for e in pending.events)
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
            result = await self._relay.publish(event.pubkey, event)
            if isinstance(result, Accepted):
                accepted += 1
                continue
            reason = _quote_reason(getattr(result, "reason", ""))
            log_event(_log, "relay.not_accepted", agent=principal.agent, request_id=request_id,
                      event_id=event.id, result=type(result).__name__, reason=reason,
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

    async def _housekeeping(self, steps: tuple[Cleanup, ...]) -> None:
        """Run a plan's cleanup steps in order; each is safe to run twice.

        A fault here cannot change the verdict (the relay has already answered), so it is
        logged for the operator and the verdict stands.
        """
        try:
            for step in steps:
                await self._cleanup(step)
        except Exception as exc:  # noqa: BLE001 - CustodyError, sqlite3.Error or worse
            log_event(_log, "housekeeping.failed", level=logging.ERROR,
                      work=steps_named(steps), error=type(exc).__name__, where=_where(exc))

    async def _cleanup(self, step: Cleanup) -> None:
        if isinstance(step, DestroyAgent):
            if self._custody.agent(step.pubkey) is not None:
                await self._custody.destroy_agent(step.pubkey)
            self._sessions.revoke_agent(step.pubkey)
        elif isinstance(step, RenameAgent):
            if self._custody.agent(step.pubkey) is not None:
                await self._custody.rename_agent(step.pubkey, step.name)
        else:
            self._runtimes.set(step.pubkey, step.runtime, int(self._clock()))

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
        """Append the verdict record; False (and an operator log line) when it cannot be.

        A refusal (failed, nothing published) past its credential's burst is counted
        instead (daemon/refusal_audit.py); the ledger still records it.
        """
        if (judged.status is Status.FAILED and not judged.published and judged.code is not None
                and not self.refusals.admit(facts.credential_id)):
            self.refusals.count(facts.credential_id, facts.agent, facts.action, judged.code)
            return True
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
        try:
            # No ledger commit follows this answer: anchor the audit head now.
            await self._ledger.anchor()
        except sqlite3.Error as exc:
            self._ledger_failed(facts, "anchor", exc)
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


def _ledger_principal(principal: Principal, reading: Reading) -> str:
    """Whose record a request's verdict goes into (spec I3: per principal and requestId).

    The agent's, shared by all of its credentials, so a credential rotated between two
    attempts still replays the first one's verdict. But a request outside the credential's
    own scope (its actions or channels) is recorded under `<agent>/<credential id>`: a
    narrow credential's refusal must not pre-empt the requestId for the agent's wider
    credentials, and it must not be handed anything the agent's record holds (issue 13).
    A request that could not be read is the agent's: no scope decided it.
    """
    if reading.request is not None and within_credential(principal, reading.request) is not None:
        return f"{principal.agent}/{principal.credential_id}"
    return principal.agent


def _lock_set(principal: Principal, decision: Authorized) -> tuple[str, ...]:
    """The agents a serialized request locks: the requester, and the target authorization
    resolved (agents.update, agents.delete)."""
    if decision.target is None:
        return (principal.agent,)
    return (principal.agent, decision.target.pubkey)


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
