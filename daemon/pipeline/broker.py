"""The pipeline: one HTTP request in, one verdict out, in the order the contract fixes.

Order: README, "How a request is judged", is the one statement of it; `PIPELINE` below is
that list as data (tests/policy/test_judgement.py holds them equal), and `Broker.handle`
walks it.

Who does what (each in its own module; this one only walks the order):
- correlate, authenticate, ledger: here. A body whose `requestId` cannot be read gets
  HTTP 400 and no envelope (any envelope would be uncorrelated). No valid credential, or
  one whose agent is no longer live (`_agent_live`, issue 13) → `failed` +
  `unauthenticated`, not recorded: there is no principal to record it under. The ledger
  key is (agent, requestId) with the body's sha256; a request outside its credential's
  own scope is keyed `<agent>/<credential id>` instead (`_ledger_principal`, issue 13; an
  unreadable one by what its envelope names). A
  finished record replays with `replayed: true`; another digest is a
  `request_id_conflict`; an identical request running here is waited for, and the
  credential is checked again once the wait ends (revoked meanwhile, or its agent gone:
  `unauthenticated`, and the record is left as it is: no outcome released, nothing
  resumed; NIP-BA "authenticate every attempt"); a pending
  record is resumed by re-sending exactly its signed events (daemon/pipeline/publisher.py);
  a rolled-back one (the relay refused its first event) never is: its rollback runs again
  and its stored `failed` is answered, `replayed` (`Publisher.finish_rollback`).
- validate, authorize (and rate limits): daemon/pipeline/judgement.py, an ordered table of steps;
  `authorize` resolves the agent records the operation acts on (nothing else resolves
  them; a read-merge-write is authorized again under its locks, see `_execute`).
- execute: the operation (daemon/operations/). A read answers directly; a publishing
  operation's plan goes to daemon/pipeline/publisher.py (intent → pending → publish →
  cleanup). A read-merge-write operation runs under its requester's and target's locks, taken in one
  global order, and is authorized again under them (`_execute`).
- record, respond: daemon/pipeline/recorder.py (ledger, audit log, log line, metrics).

Unexpected faults (issue 15 item 4, issue 13 item 1): any exception at any step, once the
requestId is known, is still an envelope, recorded like every verdict where the ledger
can. `Progress.effects_possible` decides which: `failed` + `internal` while nothing can
have taken hold; `indeterminate` + `internal` once an event was handed to the relay, a
pending record is being resumed, or a recorded non-failed verdict is being replayed (a
recorded success is never turned into `failed`). A fault before any side effect (token,
ledger, audit) is `failed` + `internal`, the spec's known no-op; no exception reaches the
HTTP layer as a 500. An agents.create that ends `failed` destroys the key bound to its
ledger record (`Publisher.mint`, `Publisher.destroy_minted`): this attempt's, or, on the
retry of a record an earlier attempt reserved (`Fresh.recorded`), the key that attempt
minted under the record's mint reference, even when judgement refuses the retry before
it runs; never a key found by its mint reference alone (issue 22 H1). One that ends
`indeterminate` keeps it for the retry. A key only a tombstone remembers answers `indeterminate` + `outcome_unknown`
(`FORGOTTEN`), unrecorded. A verdict the ledger could not record is not answered as if it
were (daemon/pipeline/recorder.py, "No record, no verdict").

observer.emit's frames are held under this request's own ledger ticket (not its
requestId: another credential's request with the same requestId is another record), and
only this request's hold is settled: released when its `succeeded` is recorded, dropped
otherwise.

WARNING: the status/code pairs used here must be allowed by `buzzwire.contract.PAIRING`;
`Verdict`'s constructors assert it. `PIPELINE` must match README's numbered list and
`daemon.pipeline.judgement.JUDGEMENT`'s phases (tests/policy/test_judgement.py);
`daemon.pipeline.publisher.CHECKPOINTS` names the steps the crash tests kill at.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Final

import trio

from buzzwire.contract import (
    ACTIONS,
    ErrorCode,
    JsonSyntaxError,
    Reading,
    Request,
    Status,
    Verdict,
    parse_json,
    read_request,
)
from custody import CustodyError
from custody.custodian.client import CustodianClient

if TYPE_CHECKING:  # the facade loads the PKCS#11 binding: not where a custodian holds the keys
    from custody import Custody
from daemon.state.directory import AgentDirectory
from daemon.state.audit import AuditLog
from daemon.state.audit_mac import BodyMac
from daemon.config import Config, ConfigError, PolicyConfig, Reread, restart_only_changes
from daemon.relay.cursor import CursorCodec
from daemon.http import HttpAnswer, HttpRequest
from daemon.pipeline.judgement import Admission, judge
from daemon.state.ledger import (Conflict, Forgotten, Fresh, Full, Ledger, LedgerKey, Replay,
                                 Resume, RolledBack, Ticket)
from daemon.fault_log import FaultLogs
from daemon.log import log_event
from daemon.metrics import Metrics
from daemon.operations import OPERATIONS, Context, Operation
from daemon.operations._base import OperationRefused
from daemon.operations.channel_read import JUDGED_CACHE_BYTES, JudgedCache, ReadLog
from daemon.pipeline.observer import ObserverIntake
from daemon.pipeline.policy import (Authorized, Refusal, authorize, envelope_within_credential,
                                    within_credential)
from daemon.pipeline.publisher import Publisher
from daemon.state.ratelimit import RateLimiter
from daemon.pipeline.recorder import Facts, Judged, Progress, Recorder
from daemon.state.read_audit import ReadAudit
from daemon.state.refusal_audit import RefusalAudit
from daemon.relay.pool import RelayPool
from daemon.state.runtimes import RuntimeStore
from daemon.state.sign_watermarks import SignWatermarks
from daemon.state.sessions import AuthCause, Principal, Refused, SessionStore
from daemon.pipeline.signing import SigningBatcher
from daemon.state.verdict_store import expanded_form
from daemon.pipeline import sealed_verdict

__all__ = ["Broker", "PIPELINE", "LEDGER_FULL", "REFUSALS_FULL", "FORGOTTEN", "REQUEST_LINES"]

_log = logging.getLogger("buzz_broker.broker")

#: What the pipeline logs about one request beside its verdict line, at what level. A
#: client (or a fault) can make any of them as frequent as its requests: each is one
#: line a minute per cause (the agent, the credential or the error), then a count.
REQUEST_LINES: Final[Mapping[str, int]] = {
    "request.invalid": logging.INFO,
    "operation.refused": logging.INFO,
    "ledger.credential_full": logging.WARNING,
    "ledger.agent_full": logging.WARNING,
    "custody.fault": logging.ERROR,
    "ledger.sealed_unreadable": logging.ERROR,
    "ledger.record_unreadable": logging.ERROR,
}

#: The order every request is judged in (README, "How a request is judged").
PIPELINE: Final = ("correlate", "authenticate", "ledger", "validate", "authorize", "execute",
                   "record", "respond")
#: The refusal when an agent's ledger records reach `state.ledger_max_bytes_per_agent`.
#: Tombstones do not expire (issue 23 item 7): the operator raises the cap.
LEDGER_FULL: Final = ("this agent's request records are at the host's limit; the operator "
                      "must raise it")
#: The refusal when a credential's refusals reach
#: `state.ledger_max_refusal_bytes_per_credential`: only that credential is turned away.
REFUSALS_FULL: Final = ("this credential's refused requests are at the host's limit; retry "
                        "after they expire")
#: The answer to the identical retry of a requestId only a tombstone remembers.
FORGOTTEN: Final = ("this requestId ran here and its result is no longer kept; its outcome "
                    "is unknown: do not run it again under a new requestId without checking")
#: The memory actions whose audit lines name their record's d tag (issue 23: the d tag,
#: never the slug). storage.address returns the d tag itself.
_D_TAGGED: Final = frozenset({"storage.get", "storage.put"})
#: How often a request takes its locks again because its target changed while it waited;
#: past that, `failed` + `internal` (nothing has happened).
_LOCK_ATTEMPTS: Final = 3


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
    """The application `daemon.http.serve` hands each request to (built by daemon/wiring.py)."""

    def __init__(
        self,
        *,
        config: Config,
        custody: Custody | CustodianClient,
        directory: AgentDirectory,
        sessions: SessionStore,
        ledger: Ledger,
        relay: RelayPool,
        cursors: CursorCodec,
        limiter: RateLimiter,
        audit: AuditLog,
        body_mac: BodyMac,
        runtimes: RuntimeStore,
        watermarks: SignWatermarks,
        clock: Callable[[], float] = time.time,
        config_loader: Callable[[], Config] | None = None,
        metrics: Metrics | None = None,
        checkpoint: Callable[[str], None] | None = None,
        observer: ObserverIntake | None = None,
    ) -> None:
        self._config = config
        self._observer = observer
        self._policy: PolicyConfig = config.policy
        self._custody = custody
        self._directory = directory
        self._sessions = sessions
        self._ledger = ledger
        self._relay = relay
        self._cursors = cursors
        self._read_log = ReadLog()
        self._lines = FaultLogs(_log, REQUEST_LINES)
        self._judged = JudgedCache(JUDGED_CACHE_BYTES)
        self._limiter = limiter
        self._audit = audit
        self._body_mac = body_mac
        self._runtimes = runtimes
        self.signer = SigningBatcher(custody)
        self._clock = clock
        self._config_loader = config_loader
        self._locks = _AgentLocks()
        #: agent -> live, valid while custody.records_version() is `_live_version`
        self._live: dict[str, bool] = {}
        self._live_version: int | None = None
        self.metrics = metrics if metrics is not None else Metrics(actions=ACTIONS)
        self._checkpoint = checkpoint
        self.refusals = RefusalAudit(audit, clock)
        self.reads = ReadAudit(audit, clock)
        self._recorder = Recorder(ledger=ledger, audit=audit, refusals=self.refusals,
                                  reads=self.reads,
                                  metrics=self.metrics, clock=clock,
                                  read_retention_seconds=config.state.read_retention_seconds)
        self._publisher = Publisher(custody=custody, directory=directory, sessions=sessions, runtimes=runtimes,
                                    watermarks=watermarks,
                                    relay=relay, ledger=ledger, recorder=self._recorder,
                                    clock=clock, checkpoint=self._passed)

    @property
    def directory(self) -> AgentDirectory:
        """The public agent directory (names, depth, listing; daemon/state/directory.py)."""
        return self._directory

    @property
    def custody(self) -> Custody | CustodianClient:
        """The custody facade this broker signs with (for the admin paths and tests)."""
        return self._custody

    @property
    def sessions(self) -> SessionStore:
        return self._sessions

    @property
    def runtimes(self) -> RuntimeStore:
        """The host's own record of each managed agent's runtime (for the CLI and tests)."""
        return self._runtimes

    def reload(self) -> Reread:
        """SIGHUP: credentials and policy again from disk, without dropping connections.

        What the file changed beyond the sections SIGHUP applies ([policy], [limits]: the
        rows `reloaded` in daemon/config.py) is named at WARNING, one line per setting
        ("restart to apply"), and so is a file that no longer loads: the operator's check
        after `systemctl reload` is `journalctl -p warning` (docs/install.md step 9).

        Returns:
            What became of the file, for `serve`'s STATUS= line.
        """
        self._sessions.reload()
        self._limiter.reload()
        if self._config_loader is None:
            log_event(_log, "reload.done")
            return Reread()
        try:
            config = self._config_loader()
        except ConfigError as exc:  # a bad file keeps the running policy
            # Its one line names the file and key, and quotes no secret (daemon/config.py).
            log_event(_log, "reload.config_rejected", level=logging.WARNING,
                      error=type(exc).__name__, detail=str(exc))
            return Reread(rejected=str(exc))
        except Exception as exc:  # noqa: BLE001 - nor does a loader's bug end the daemon
            # Not str(exc): only a ConfigError's text is known to be fit for the log.
            log_event(_log, "reload.config_rejected", level=logging.WARNING,
                      error=type(exc).__name__)
            return Reread(rejected=type(exc).__name__)
        self._policy = config.policy
        self._limiter.reconfigure(config.limits)
        # Against the configuration the daemon started with: that is what it still runs on
        # for these, so an edit not yet applied is named at every reload until the restart.
        waiting = restart_only_changes(self._config, config)
        for setting in waiting:
            log_event(_log, "reload.restart_needed", level=logging.WARNING, setting=setting,
                      detail=f"{setting} changed: restart to apply")
        log_event(_log, "reload.done", restart_needed=list(waiting))
        return Reread(waiting=waiting)

    def _passed(self, step: str) -> None:
        if self._checkpoint is not None:
            self._checkpoint(step)

    # ---------------------------------------------------------------- the pipeline

    async def handle(self, request: HttpRequest) -> HttpAnswer:
        """One request in, one answer out; an unexpected fault is still an envelope.

        A fault the pipeline did not contain itself answers `failed` + `internal` while
        nothing can have taken hold, else `indeterminate` + `internal` (`Progress`); only
        a body without a usable requestId gets no envelope (HTTP 400).
        """
        started = time.monotonic()
        progress = Progress()
        try:
            return await self._handle(request, started, progress)
        except Exception as exc:  # noqa: BLE001 - the one place nothing may escape past
            reading = read_request(request.body)
            if reading.request_id is None:
                raise
            self._recorder.fault("pipeline", None, reading.request_id, _action_of(reading), exc)
            verdict = (Verdict.indeterminate(ErrorCode.INTERNAL) if progress.effects_possible
                       else Verdict.failed(ErrorCode.INTERNAL))
            return self._recorder.respond(reading.request_id,
                                          Judged.of(reading.request_id, verdict), started,
                                          agent=None, action=_action_of(reading))

    async def _handle(self, request: HttpRequest, started: float, progress: Progress
                      ) -> HttpAnswer:
        # correlate
        reading = read_request(request.body)
        if reading.request_id is None:
            return self._recorder.uncorrelated(
                started, request.peer_uid, len(request.body),
                reading.error.detail if reading.error else "")
        request_id = reading.request_id
        # authenticate
        principal = self._authenticate(request, request_id)
        if not isinstance(principal, Principal):
            return self._unauthenticated(request, reading, principal, started)
        # ledger
        # The ledger's digest is unkeyed (design.md: it never leaves the state directory);
        # the audit log's is the body's MAC (daemon/state/audit_mac.py: the log does leave).
        digest = hashlib.sha256(request.body).digest()
        facts = Facts(credential_id=principal.credential_id, agent=principal.agent,
                      action=_action_of(reading), request_id=request_id,
                      body_mac=self._body_mac.of(request.body))
        key = LedgerKey(principal=_ledger_principal(principal, reading, request.body),
                        request_id=request_id)
        joins = self._ledger.joins(key)
        try:
            begun = await self._ledger.begin(key, digest, credential=principal.credential_id)
        except sqlite3.Error as exc:
            # Nothing has happened and the ledger cannot record: a fault before dispatch.
            self._recorder.ledger_failed(facts, "begin", exc)
            return await self._recorder.unrecorded(facts, Judged.internal(request_id), started)
        if joins:
            # It waited for an identical request in flight: the credential may have been
            # revoked (or its agent removed) meanwhile. NIP-BA: authenticate every attempt
            # and authorize the release of a stored result, and its execution: checked
            # again before either, and a failure leaves the record as it is.
            again = self._authenticate(request, request_id)
            if not isinstance(again, Principal):
                if isinstance(begun, (Fresh, Resume, RolledBack)):
                    self._ledger.release(begun.ticket)
                return self._unauthenticated(request, reading, again, started)
        if isinstance(begun, Full):
            # Not recorded: recording it would grow what the cap bounds (docs/operations.md).
            self._lines.record("ledger.credential_full" if begun.credential else
                               "ledger.agent_full", principal.credential_id,
                               agent=principal.agent, credential_id=principal.credential_id,
                               request_id=request_id)
            full = Judged.of(request_id, Verdict.failed(
                ErrorCode.UNAUTHORIZED, REFUSALS_FULL if begun.credential else LEDGER_FULL))
            return await self._recorder.unrecorded(facts, full, started)
        if isinstance(begun, Forgotten):
            # Not recorded: the tombstone already says all this host knows (NIP-BA).
            progress.effects_possible = True
            forgotten = Judged.of(request_id, Verdict.indeterminate(ErrorCode.OUTCOME_UNKNOWN,
                                                                    FORGOTTEN))
            return await self._recorder.unrecorded(facts, forgotten, started)
        if isinstance(begun, Replay):
            stored = begun.response
            if sealed_verdict.is_sealed(stored):
                opened = await sealed_verdict.unseal(self._custody, principal.agent, stored)
                if opened is None:  # a read's verdict: answering internal promises nothing
                    self._lines.record("ledger.sealed_unreadable", principal.agent,
                                       agent=principal.agent, request_id=request_id)
                    return await self._recorder.unrecorded(facts, Judged.internal(request_id),
                                                           started)
                stored = opened
            try:
                replay = Judged(expanded_form(request_id, stored), begun.status,
                                begun.code)
            except ValueError:
                # A compact refusal this version cannot read (a newer code): it was a
                # failed verdict, so failed + internal promises nothing new.
                self._lines.record("ledger.record_unreadable", principal.agent,
                                   agent=principal.agent, request_id=request_id)
                return await self._recorder.unrecorded(facts, Judged.internal(request_id),
                                                       started)
            progress.effects_possible = replay.status is not Status.FAILED
            return await self._recorder.unrecorded(facts, replay, started, replayed=True)
        if isinstance(begun, Conflict):
            conflict = Judged.of(request_id, Verdict.failed(ErrorCode.REQUEST_ID_CONFLICT))
            return await self._recorder.unrecorded(facts, conflict, started)
        # A pending record being resumed may already be on the relay (an earlier attempt);
        # a rolled-back one's rollback may not have finished (its key, agents.create).
        progress.effects_possible = isinstance(begun, (Resume, RolledBack))
        progress.recorded = (isinstance(begun, Fresh) and begun.recorded
                             or isinstance(begun, RolledBack))
        progress.rolled_back = isinstance(begun, RolledBack)
        progress.invalid = reading.error is not None
        # observer.emit's admitted frames wait, held under this ticket, for this verdict's
        # record: released to the relay only when it records success, dropped otherwise
        # (and on any fault or cancellation), so `failed` keeps its promise of no effects.
        recorded: Judged | None = None
        # A rolled-back record's stored failed verdict, answered `replayed` when it stands.
        rolled_back = begun.response if isinstance(begun, RolledBack) else None
        try:
            try:
                if isinstance(begun, Resume):
                    judged = await self._publisher.resume(facts, begun.pending, progress)
                elif isinstance(begun, RolledBack):
                    judged = await self._publisher.finish_rollback(facts, begun, progress)
                else:
                    judged, facts = await self._judge_and_execute(principal, reading,
                                                                  begun.ticket, facts, progress)
            except Exception as exc:  # noqa: BLE001 - contained: an envelope, recorded
                judged = self._contained(facts, progress, exc)
            if facts.action == "agents.create" and judged.status is Status.FAILED:
                judged = await self._publisher.destroy_minted(facts, judged, progress)
            self._passed("before_verdict")
            # record
            replayed = rolled_back is not None and judged.response == rolled_back
            judged = recorded = await self._recorder.finish(begun.ticket, facts, judged,
                                                            progress, replayed=replayed)
        except BaseException:
            self._ledger.release(begun.ticket)  # a no-op once the verdict is recorded
            raise
        finally:
            if self._observer is not None:
                self._observer.queue.settle(
                    begun.ticket,
                    keep=recorded is not None and recorded.status is Status.SUCCEEDED)
        self._passed("after_verdict")
        return self._recorder.respond(request_id, judged, started, agent=principal.agent,
                                      action=facts.action,
                                      replayed=replayed and judged.response == rolled_back)

    def _unauthenticated(self, request: HttpRequest, reading: Reading, refused: Refused | Judged,
                         started: float) -> HttpAnswer:
        """The answer to a request `_authenticate` did not let through (not recorded: there
        is no principal to record it under)."""
        assert reading.request_id is not None
        if isinstance(refused, Judged):
            return self._recorder.respond(reading.request_id, refused, started, agent=None,
                                          action=_action_of(reading))
        # One fixed answer for every cause (NIP-BA: nothing about authenticated state
        # to an unauthenticated caller); the cause goes to the operator's log only.
        unauthenticated = Judged.of(reading.request_id,
                                    Verdict.failed(ErrorCode.UNAUTHENTICATED))
        return self._recorder.respond(
            reading.request_id, unauthenticated, started, agent=None,
            action=_action_of(reading), unvouched=refused, peer_uid=request.peer_uid)

    def _authenticate(self, request: HttpRequest, request_id: str
                      ) -> Principal | Refused | Judged:
        """The principal; why not (answered unauthenticated); or internal if custody failed."""
        # Over loopback TCP every local user can connect: only a uid-bound credential
        # proves who is asking, unless the operator allows the others there.
        principal = self._sessions.check(
            request.authorization, request.peer_uid, int(self._clock()),
            uid_bound_only=request.over_tcp
            and not self._config.server.tcp_allow_credentials_without_uid,
        )
        if isinstance(principal, Refused):
            return principal
        try:
            if self._agent_live(principal):
                return principal
        except CustodyError as exc:
            self._lines.record("custody.fault", type(exc).__name__, agent=principal.agent,
                               request_id=request_id, error=type(exc).__name__,
                               detail=str(exc))
            return Judged.internal(request_id)
        return Refused(cause=AuthCause.AGENT_GONE, credential_id=principal.credential_id)

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
        return live

    async def _judge_and_execute(self, principal: Principal, reading: Reading, ticket: Ticket,
                                 facts: Facts, progress: Progress) -> tuple[Judged, Facts]:
        """validate → authorize (daemon/pipeline/judgement.py), then execute.

        Returns the verdict and the facts its audit lines carry: for a memory action, the
        NIP-AE d tag of its record, derived once it is admitted (never the slug)."""
        request_id = facts.request_id
        admitted = judge(Admission(principal=principal, reading=reading, policy=self._policy,
                                   agents=self._directory, limiter=self._limiter,
                                   now=self._clock(), recorded=progress.recorded))
        if isinstance(admitted, Verdict):
            if reading.error is not None:  # validate refused it (the first step)
                self._lines.record("request.invalid", principal.agent, reading.error.code,
                                   agent=principal.agent, request_id=request_id,
                                   code=reading.error.code.value,
                                   pointer=reading.error.shown, detail=reading.error.detail)
            return Judged.of(request_id, admitted), facts
        try:
            facts = await self._with_d_tag(facts, principal, admitted.request)
            return await self._execute(OPERATIONS[admitted.request.action], principal,
                                       admitted.request, admitted.authorized, ticket, facts,
                                       progress), facts
        except OperationRefused as refused:
            if refused.detail:
                self._lines.record("operation.refused", principal.agent, refused.code,
                                   agent=principal.agent, request_id=request_id,
                                   code=refused.code.value, detail=refused.detail)
            return Judged.of(request_id, Verdict.failed(refused.code, refused.message)), facts
        except CustodyError as exc:
            # Raised before anything was published (signing, minting and a read's relay AUTH
            # precede the pending record; the publisher answers its own AUTH's), so the
            # fault is a known no-op: failed + internal, not recorded.
            self._lines.record("custody.fault", type(exc).__name__, agent=principal.agent,
                               request_id=request_id, error=type(exc).__name__,
                               detail=str(exc))
            return Judged.internal(request_id), facts

    async def _with_d_tag(self, facts: Facts, principal: Principal, request: Request) -> Facts:
        """`facts` with the d tag of the NIP-AE record a storage.get/put touches, or the
        channel a channel.read reads (what its read count is kept under)."""
        if request.action == "channel.read":
            return dataclasses.replace(facts, channel=getattr(request.args, "channel_id"))
        if request.action not in _D_TAGGED:
            return facts
        slug: str = getattr(request.args, "slug")
        address = await self._custody.memory_address(principal.agent, slug)
        return dataclasses.replace(facts, d_tag=address.d_tag)

    async def _execute(self, operation: Operation, principal: Principal, request: Request,
                       decision: Authorized, ticket: Ticket, facts: Facts, progress: Progress
                       ) -> Judged:
        """Run the operation; a read-merge-write one under its agents' locks.

        It holds the requester's and its target's locks until its events are published,
        taken in one global order (`_AgentLocks.hold_all`), and is authorized again under
        them, so what it acts on cannot change meanwhile. If the target resolved under the
        locks is not one they cover (renamed or replaced while waiting), nothing has
        happened yet: the locks are taken again with it.
        """
        if not operation.serialize_per_agent:
            return await self._run(operation, decision, principal, request, ticket, facts,
                                   progress)
        locked = _lock_set(principal, decision)
        for _attempt in range(_LOCK_ATTEMPTS):
            async with self._locks.hold_all(locked):
                again = authorize(principal, request, self._policy, self._directory)
                if isinstance(again, Refusal):
                    return Judged.of(facts.request_id, Verdict.failed(again.code, again.message))
                if set(_lock_set(principal, again)) <= set(locked):
                    return await self._run(operation, again, principal, request, ticket,
                                           facts, progress)
            locked = (*locked, *_lock_set(principal, again))
        return Judged.internal(facts.request_id)

    async def _run(self, operation: Operation, decision: Authorized, principal: Principal,
                   request: Request, ticket: Ticket, facts: Facts, progress: Progress
                   ) -> Judged:
        progress.executed = True
        ctx = Context(
            custody=self._custody,
            signer=self.signer,
            relay=self._relay,
            principal=principal,
            host=self._policy,
            cursors=self._cursors,
            request_id=facts.request_id,
            now=lambda: int(self._clock()),
            authorized=decision,
            read_log=self._read_log,
            judged=self._judged,
            runtimes=self._runtimes,
            enroll=self._enroll,
            mint=lambda: self._publisher.mint(ticket, facts, progress),
            # Frames are held under this request's own ticket (module docstring).
            observer=(None if self._observer is None
                      else dataclasses.replace(self._observer, hold_key=ticket)),
        )
        if operation.execute is not None:
            # A read: the ledger keeps nothing of it (recorder `keeping`), so a
            # storage.get's value is never stored, not even sealed.
            return Judged.of(facts.request_id, await operation.execute(ctx, request.args))
        assert operation.prepare is not None
        return await self._publisher.plan_and_publish(ctx, operation.prepare, request, ticket,
                                                      facts, progress)

    async def _enroll(self, pubkey: str, name: str, creator: str | None) -> None:
        # A short SQLite write with fsync: off the event loop, as the publisher's renames.
        await trio.to_thread.run_sync(self._directory.enroll, pubkey, name, creator)

    def _contained(self, facts: Facts, progress: Progress, exc: Exception) -> Judged:
        """The verdict for an unexpected fault inside the operation: an envelope, recorded.

        `failed` + `internal` while nothing can have taken hold; `indeterminate` +
        `internal` once something may have (its pending record is kept, so the identical
        retry re-sends exactly the same events and reaches the relay's verdict).
        """
        self._recorder.fault("operation", facts.agent, facts.request_id, facts.action, exc)
        if not progress.effects_possible:
            return Judged.internal(facts.request_id)
        return dataclasses.replace(
            Judged.of(facts.request_id, Verdict.indeterminate(ErrorCode.INTERNAL)),
            event_ids=progress.event_ids, published=True)


def _ledger_principal(principal: Principal, reading: Reading, body: bytes) -> str:
    """Whose record a request's verdict goes into (spec I3: per principal and requestId).

    The agent's, shared by all of its credentials, so a credential rotated between two
    attempts still replays the first one's verdict. But a request outside the credential's
    own scope (its actions or channels) is recorded under `<agent>/<credential id>`: a
    narrow credential's refusal must not pre-empt the requestId for the agent's wider
    credentials, and it must not be handed anything the agent's record holds (issue 13).
    A request that could not be read is judged by what its envelope says
    (`policy.envelope_within_credential`): the agent's only when the credential holds its
    action and channel, so the same credential's valid request with that requestId is
    still its `request_id_conflict`; otherwise the credential's own, so an invalid request
    cannot pre-empt what a valid one could not.
    """
    if reading.request is not None:
        outside = within_credential(principal, reading.request) is not None
    else:
        outside = not envelope_within_credential(principal, *_envelope_scope(body))
    return f"{principal.agent}/{principal.credential_id}" if outside else principal.agent


def _envelope_scope(body: bytes) -> tuple[object, object]:
    """(action, args.channelId) as far as an unreadable request's body holds them, each
    None where it does not (not JSON, not an object, a member repeated or absent)."""
    try:
        top, _fault = parse_json(body)
    except JsonSyntaxError:
        return None, None
    if type(top) is not dict:  # a repeated member is a marker type: nothing is read from it
        return None, None
    args = top.get("args")
    channel = args.get("channelId") if type(args) is dict else None
    return top.get("action"), channel


def _lock_set(principal: Principal, decision: Authorized) -> tuple[str, ...]:
    """The agents a serialized request locks: the requester, and the target authorization
    resolved (agents.update, agents.delete)."""
    if decision.target is None:
        return (principal.agent,)
    return (principal.agent, decision.target.pubkey)


def _action_of(reading: Reading) -> str | None:
    return reading.request.action if reading.request is not None else None
