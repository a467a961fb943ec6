"""The recorder: each verdict written to the ledger, the audit log, the log and the metrics.

Rules (README "How a request is judged", steps 7 and 8):
- Every verdict reached after authentication goes to the ledger (final unless
  `indeterminate`; a refusal as its code, daemon/state/verdict_store.py, with its status and
  code as columns) and to the hash-chained audit log (past a credential's burst,
  refusals are counted: daemon/state/refusal_audit.py), except a read that ran: it has no
  effects, so it leaves no ledger record and the audit log counts it per credential and
  window (daemon/state/read_audit.py, issue 24). Every answer, recorded or not, is one
  request in the metrics and one `verdict` log line, but where the audit log counts
  rather than lists: at any level above debug, a read's line (`_is_read`) is one a
  minute per (action, status, code), and a refusal's past its credential's burst one a
  minute per (agent, action, code), each then with a `suppressed` count.
- No audit, no answer: a verdict with no side effects whose audit record cannot be
  written becomes `failed` + `internal` (a known no-op). Once the relay was asked
  (`Judged.published`), the verdict stands whatever the audit log can still record: the
  intent record written before publishing already names the events.
- No record, no verdict (NIP-BA: "Store the result durably before delivering it"): a
  verdict the ledger could not `finish` is not answered. Nothing can have taken hold
  (observer.emit's frames are still held, and are then dropped) → `failed` + `internal`,
  and the retry runs afresh; effects are possible (a pending record is kept: the retry
  resumes it) → `indeterminate` + `internal`. The one exception is a `failed` the ledger
  already holds (`Progress.rolled_back`, `Ledger.roll_back`): it was stored before it is
  answered, and the retry replays it.
- A fault in the ledger or audit log, or one the pipeline contained, is logged for the
  operator (the exception's type and where it was raised; sqlite's text is ours to show,
  other exceptions' text is not), one line a minute per cause, then a `suppressed`
  count, and never escapes: the pipeline decides what the agent is told.

This module does not decide verdicts; it only writes them. `Judged`, `Facts` and
`Progress` are the values the pipeline, the publisher and the recorder pass each other.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from buzzwire.contract import (ACTIONS, ErrorCode, Status, Verdict, encode_response,
                               mark_replayed)
from daemon.fault_log import FaultLog, FaultLogs
from daemon.state.audit import AuditLog, AuditRecord, AuditUnavailable, BodyDigest, Phase
from daemon.http import HttpAnswer
from daemon.state.ledger import Ledger, Ticket
from daemon.log import log_event
from daemon.metrics import Metrics
from daemon.state.read_audit import ReadAudit
from daemon.state.refusal_audit import RefusalAudit
from daemon.state.sessions import Refused
from daemon.state.verdict_store import stored_form

__all__ = ["Judged", "Facts", "Progress", "Recorder", "Keeping", "keeping", "where"]

_log = logging.getLogger("buzz_broker.recorder")

#: The faults the recorder reports for the pipeline, at what level.
_FAULT_LINES: Mapping[str, int] = {
    "pipeline.fault": logging.ERROR,
    "ledger.fault": logging.ERROR,
    "audit.unavailable": logging.ERROR,
}


@dataclass(frozen=True, slots=True)
class Judged:
    """A verdict reached after the ledger: its bytes, and the facts the log and metrics need.

    `published` True: the relay was asked, so what happened there stands whatever the
    audit log can still record. `counted` True: a refusal past its credential's burst,
    counted in the audit log rather than listed, and so in the operator log too.
    """

    response: bytes
    status: Status
    code: ErrorCode | None = None
    event_ids: tuple[str, ...] = ()
    published: bool = False
    counted: bool = False

    @classmethod
    def of(cls, request_id: str, verdict: Verdict) -> Judged:
        return cls(encode_response(request_id, verdict), verdict.status, verdict.code)

    @classmethod
    def internal(cls, request_id: str) -> Judged:
        """failed + internal: a fault before any side effect (the spec's known no-op)."""
        return cls.of(request_id, Verdict.failed(ErrorCode.INTERNAL))


@dataclass(slots=True)
class Progress:
    """How far one request got: what an unexpected fault may still promise.

    `effects_possible` turns True the moment something may have taken hold: the first
    event handed to the relay, a resumed pending record (an earlier attempt may have sent
    it), or a recorded non-failed verdict being replayed. From then on a fault answers
    `indeterminate`, never `failed`.
    """

    effects_possible: bool = False
    event_ids: tuple[str, ...] = ()
    #: the ledger held a record of this key without pending work (`Fresh.recorded`)
    recorded: bool = False
    #: the request could not be read: validation refused it
    invalid: bool = False
    #: the operation began: judgement (validate, authorize, rate limits) let it through
    executed: bool = False
    #: the agents.create key this attempt bound to its record (`Publisher.mint`)
    minted: str | None = None
    #: this attempt asked custody to mint and got no answer: a key may exist under the
    #: record's mint reference, or still be made there (`Publisher.destroy_minted`)
    mint_unanswered: bool = False
    #: the ledger holds this request's `failed` verdict already (`Ledger.roll_back`): the
    #: relay refused its first event, and its pending work is never sent again
    rolled_back: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """What the audit log says about one authenticated request (never its arguments)."""

    credential_id: str
    agent: str
    action: str | None
    request_id: str
    #: the body's MAC under the host's audit key (daemon/state/audit_mac.py), never an
    #: unkeyed digest: the audit log leaves the host, the key does not
    body_mac: str
    #: the NIP-AE d tag a memory action touches (never its slug), once known
    d_tag: str | None = None
    #: the channel a channel.read reads, once admitted (its read count's target)
    channel: str | None = None

    def record(self, phase: Phase, at: float, *, status: Status | None = None,
               code: ErrorCode | None = None, events: tuple[str, ...] = (),
               replayed: bool = False) -> AuditRecord:
        return AuditRecord(phase=phase, at=at, credential_id=self.credential_id,
                           agent=self.agent, action=self.action, request_id=self.request_id,
                           body=BodyDigest.mac(self.body_mac), status=status, code=code,
                           events=events, replayed=replayed, d_tag=self.d_tag)


@dataclass(frozen=True, slots=True)
class Keeping:
    """How the ledger keeps one verdict (docs/operations.md, "Disk").

    `seconds`: how long the full record is kept (None: the ledger's retention).
    `refusal_of`: the credential whose refusal share pays for it, not its agent's account.
    `tombstone`: (K, D) outlive the record, so the requestId never runs again.
    """

    seconds: int | None
    refusal_of: str | None
    tombstone: bool


def keeping(facts: Facts, judged: Judged, progress: Progress, short_seconds: int
            ) -> Keeping | None:
    """The one rule (issue 22 M1, issue 23 item 7, issue 24 item 3), first match wins:

    1. A refusal reached before execution (validate, authorize, rate limits) claimed
       nothing (NIP-BA: "After authentication and permission checks, the host MUST
       atomically claim an unused K"), so it needs no tombstone: nothing ran to be
       re-executed, and once it expires the id runs (docs/protocol.md §6). Keeping it
       is a convenience (its identical retry is replayed): charged to its credential's
       refusal share, and one validation refused is kept only `short_seconds` (the same
       bytes are refused the same way again).
    2. A read that ran (an action that is not `publishing`: channel.read,
       storage.address, storage.get), whatever its verdict: None, no ledger record at
       all. It has no effects, so an identical retry runs it again (docs/protocol.md,
       "Where this host and NIP-BA still differ"); the audit log counts it
       (daemon/state/read_audit.py). A fleet polling at 256 reads/s would otherwise write
       22 million records a day.
    3. Everything else ran an action with effects: the retention, then a tombstone.
    """
    if judged.status is Status.FAILED and not progress.executed and not judged.published:
        return Keeping(short_seconds if progress.invalid else None, facts.credential_id, False)
    if _is_read(facts.action) and not judged.published:
        return None
    return Keeping(None, None, True)


def _unstored(request_id: str, judged: Judged, progress: Progress) -> Judged:
    """What a verdict the ledger could not record may still answer (module docstring)."""
    if judged.status is Status.INDETERMINATE:
        return judged  # promises nothing: the kept record is resumed, or runs afresh
    if judged.status is Status.FAILED and progress.rolled_back:
        return judged  # already the ledger's (`Ledger.roll_back`): the retry replays it
    if judged.published or progress.effects_possible:
        return replace(Judged.of(request_id, Verdict.indeterminate(ErrorCode.INTERNAL)),
                       event_ids=judged.event_ids, published=judged.published)
    return Judged.internal(request_id)


def _is_read(action: str | None) -> bool:
    """An action with no effects (channel.read, storage.address, storage.get).

    Why its verdict lines are bounded: a fleet of Buzz's runtimes polls every channel
    every second (256 reads/s for 64 agents of 4 channels), and a line each was 22
    million journal lines a day, past journald's per-unit rate limit (10,000 lines in
    30 s by default; past it the unit's lines are dropped wholesale, audit.head anchors
    and errors too), rotating the rest of the journal away. `level = "debug"` shows
    every one.
    """
    spec = ACTIONS.get(action) if action is not None else None
    return spec is not None and not spec.publishing


class Recorder:
    """Writes verdicts (module docstring). One per daemon; the pipeline owns it."""

    def __init__(self, *, ledger: Ledger, audit: AuditLog, refusals: RefusalAudit,
                 reads: ReadAudit, metrics: Metrics, clock: Callable[[], float],
                 read_retention_seconds: int) -> None:
        self._ledger = ledger
        self._audit = audit
        self._refusals = refusals
        self._reads = reads
        self._metrics = metrics
        self._clock = clock
        self._read_retention = read_retention_seconds
        # Answers no credential vouches for (issue 22 L1): anyone who reaches the socket
        # can send them at will, and one line each would have journald's per-unit rate
        # limit drop the daemon's lines wholesale, audit.unavailable and the anchors
        # included. Per cause (the peer's uid), one line a minute, then a count.
        self.unvouched = FaultLog(_log, "verdict", level=logging.INFO)
        self.uncorrelated_log = FaultLog(_log, "request.uncorrelated", level=logging.INFO)
        #: Reads' verdict lines (`_is_read`); causes are (action, status, code), a few.
        self.read_lines = FaultLog(_log, "verdict", level=logging.INFO)
        #: Refusals' lines past their credential's burst (`Judged.counted`): one
        #: credential's flood of refused requests (its rate limit's refusals among them)
        #: was a journal line each, with the end a fleet's reads had.
        self.refusal_lines = FaultLog(_log, "verdict", level=logging.INFO)
        #: The faults the recorder reports (`_FAULT_LINES`): one line a minute per cause.
        self.faults = FaultLogs(_log, _FAULT_LINES)

    async def intent(self, facts: Facts, event_ids: tuple[str, ...]) -> bool:
        """The audit intent record, before the pending record; False when it cannot be."""
        try:
            await self._audit.append(facts.record(Phase.INTENT, self._clock(), events=event_ids))
        except Exception as exc:  # noqa: BLE001 - AuditUnavailable or worse: nothing was sent
            self.audit_failed(facts, exc)
            return False
        return True

    async def audited(self, facts: Facts, judged: Judged, *, replayed: bool = False
                      ) -> Judged | None:
        """Append the verdict record: `judged` as recorded, or None (and an operator log
        line) when it cannot be.

        A refusal (failed, nothing published) past its credential's burst is counted
        instead (daemon/state/refusal_audit.py), and comes back `counted`; the ledger still
        records it.
        """
        if (judged.status is Status.FAILED and not judged.published and judged.code is not None
                and not self._refusals.admit(facts.credential_id)):
            self._refusals.count(facts.credential_id, facts.agent, facts.action, judged.code)
            return replace(judged, counted=True)
        try:
            await self._audit.append(facts.record(
                Phase.VERDICT, self._clock(), status=judged.status, code=judged.code,
                events=judged.event_ids if judged.status is Status.SUCCEEDED else (),
                replayed=replayed))
        except Exception as exc:  # noqa: BLE001 - AuditUnavailable or worse: not recorded
            self.audit_failed(facts, exc)
            return None
        return judged

    async def finish(self, ticket: Ticket, facts: Facts, judged: Judged, progress: Progress,
                     *, replayed: bool = False) -> Judged:
        """Record a verdict the ledger let run: audit first when nothing was published.

        Returns the verdict to answer: `judged`, or failed + internal when it had no side
        effects and its audit record could not be written. A ledger fault answers what is
        still true without the record (`_unstored`; module docstring). A read that ran is
        counted instead, and the ledger keeps nothing of it (`keeping`).
        """
        if keeping(facts, judged, progress, self._read_retention) is None:
            judged = await self.counted(facts, judged)
            # An identical read that arrived meanwhile gets this verdict (NIP-BA's join).
            self._ledger.hand_over(ticket, judged.response, judged.status, judged.code)
            return judged
        if not judged.published:
            judged = await self.audited(facts, judged) or Judged.internal(facts.request_id)
        kept = keeping(facts, judged, progress, self._read_retention)
        assert kept is not None, "a verdict that is not a read's is kept"
        try:
            # A refusal is kept as its code (verdict_store); how long and on whose share
            # is `keeping`'s.
            await self._ledger.finish(
                ticket,
                stored_form(facts.request_id, judged.response, judged.status, judged.code)
                if not judged.published else judged.response,
                judged.status, judged.code, keep_seconds=kept.seconds,
                refusal_of=kept.refusal_of, tombstone=kept.tombstone)
        except Exception as exc:  # noqa: BLE001 - sqlite3.Error or worse: not recorded
            self.ledger_failed(facts, "finish", exc)
            self._ledger.release(ticket)
            unstored = _unstored(facts.request_id, judged, progress)
            if unstored is not judged and not judged.published:
                # The verdict's audit record is written: the one answered follows it.
                await self.audited(facts, unstored)
            judged = unstored
        if judged.published:
            await self.audited(facts, judged, replayed=replayed)
        return judged

    async def counted(self, facts: Facts, judged: Judged) -> Judged:
        """Count a read that ran (daemon/state/read_audit.py); the verdict to answer.

        No audit, no answer: while the audit log's last write failed, a count could not be
        relied on, so the read needs a verdict line of its own (`audited`) or is answered
        failed + internal (nothing happened); the first line written ends that. A read
        that finds the count table full waits while it is written."""
        if not self._audit.failing:
            assert facts.action is not None, "a read that ran names its action"
            self._reads.count(facts.credential_id, facts.agent, facts.action, judged.status,
                              judged.code, facts.channel or facts.d_tag)
            if self._reads.full:
                await self._reads.flush(everything=True)
            # Counted (and kept for the next flush if this one failed): never also listed.
            return judged if not self._audit.failing else Judged.internal(facts.request_id)
        return await self.audited(facts, judged) or Judged.internal(facts.request_id)

    async def unrecorded(self, facts: Facts, judged: Judged, started: float, *,
                         replayed: bool = False) -> HttpAnswer:
        """Answer a verdict the ledger does not (re)record: audited first, or internal.

        No audit, no answer: when the record cannot be written the agent is told
        failed + internal instead, which promises (truthfully) that nothing ran now; a
        replayed verdict that was not `failed` becomes indeterminate + internal (a recorded
        success is never turned into failed: it would promise no effect took hold).
        """
        recorded = await self.audited(facts, judged, replayed=replayed)
        if recorded is None:
            if replayed and judged.status is not Status.FAILED:
                judged = Judged.of(facts.request_id, Verdict.indeterminate(ErrorCode.INTERNAL))
            else:
                judged = Judged.internal(facts.request_id)
            replayed = False
        else:
            judged = recorded
        try:
            # No ledger commit follows this answer: anchor the audit head now.
            await self._ledger.anchor()
        except sqlite3.Error as exc:
            self.ledger_failed(facts, "anchor", exc)
        return self.respond(facts.request_id, judged, started, agent=facts.agent,
                            action=facts.action, replayed=replayed)

    def respond(self, request_id: str, judged: Judged, started: float, *, agent: str | None,
                action: str | None, replayed: bool = False,
                unvouched: Refused | None = None, peer_uid: int | None = None) -> HttpAnswer:
        """The answer: one `verdict` log line, one request in the metrics, HTTP 200.

        `unvouched`: the answer is `unauthenticated` (for a peer of `peer_uid`), and why;
        its line names the cause and the credential id (when the token matched one, never
        the token) and goes through the rate-bounded `unvouched` log, one cause per
        (peer uid, cause, credential): a flood of one cause is one line, then a count.
        """
        elapsed = time.monotonic() - started
        fields: dict[str, object] = {
            "request_id": request_id,
            "agent": agent,
            "action": action,
            "duration_ms": round(elapsed * 1000, 3),
            "status": judged.status.value,
            "code": judged.code.value if judged.code else None,
            "event_ids": list(judged.event_ids) if judged.event_ids else None,
            "replayed": True if replayed else None,
            "cause": unvouched.cause.value if unvouched is not None else None,
            "credential_id": unvouched.credential_id if unvouched is not None else None,
        }
        shown = {k: v for k, v in fields.items() if v is not None}
        if unvouched is not None:
            self.unvouched.record(
                ("unauthenticated", peer_uid, unvouched.cause, unvouched.credential_id),
                peer_uid=peer_uid, **shown)
        elif _is_read(action) and not _log.isEnabledFor(logging.DEBUG):
            self.read_lines.record((action, judged.status, judged.code), **shown)
        elif judged.counted and not _log.isEnabledFor(logging.DEBUG):
            self.refusal_lines.record((agent, action, judged.code), **shown)
        else:
            log_event(_log, "verdict", level=logging.INFO, **shown)
        self._metrics.request(action, judged.status.value,
                              judged.code.value if judged.code else None, elapsed)
        body = mark_replayed(judged.response) if replayed else judged.response
        return HttpAnswer(status=200, body=body)

    def uncorrelated(self, started: float, peer_uid: int | None, body_bytes: int,
                     detail: str) -> HttpAnswer:
        """HTTP 400 without an envelope: counted, not recorded (there is no requestId).

        Its log line is rate-bounded per peer uid, as `unvouched` (L1)."""
        self.uncorrelated_log.record(("uncorrelated", peer_uid), peer_uid=peer_uid,
                                     bytes=body_bytes, detail=detail)
        self._metrics.request(None, None, None, time.monotonic() - started)
        return HttpAnswer(status=400, body=None)

    # Faults (`faults`): a request that trips one trips it every time it is sent, and a
    # full disk fails every request; causes are where and what, a few words of ours.

    def ledger_failed(self, facts: Facts, step: str, exc: Exception) -> None:
        detail = str(exc) if isinstance(exc, sqlite3.Error) else where(exc)
        self.faults.record("ledger.fault", step, type(exc).__name__, detail,
                           agent=facts.agent, request_id=facts.request_id,
                           action=facts.action, step=step, error=type(exc).__name__,
                           detail=detail)

    def audit_failed(self, facts: Facts, exc: Exception) -> None:
        detail = exc.detail if isinstance(exc, AuditUnavailable) else where(exc)
        self.faults.record("audit.unavailable", detail, agent=facts.agent,
                           request_id=facts.request_id, action=facts.action, detail=detail)

    def fault(self, step: str, agent: str | None, request_id: str, action: str | None,
              exc: BaseException) -> None:
        # The exception's type and where it was raised, never its text: an unexpected
        # exception's message is not ours to vouch for (it could quote anything).
        self.faults.record("pipeline.fault", step, type(exc).__name__, where(exc),
                           step=step, agent=agent, request_id=request_id, action=action,
                           error=type(exc).__name__, where=where(exc))


def where(exc: BaseException) -> str:
    """`file:line` where an exception was raised (its innermost frame), for the operator."""
    tb = exc.__traceback__
    if tb is None:
        return "unknown"
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}"
