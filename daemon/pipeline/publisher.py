"""The publisher: intent → pending → publish → cleanup, for every publishing request.

Order (design.md step 4; README "How a request is judged", step 6): the operation has
signed everything (its `Plan`); the audit *intent* record is written, then the ledger's
*pending* record (daemon/pipeline/pending.py) is committed, and only then does anything reach the
relay. A retry that finds the pending record resumes here with exactly those events.

Publishing outcomes (issue 5): every event accepted (`duplicate:` included) → `succeeded`,
then the plan's `commit` cleanup; the *first* event refused or unsendable → nothing took
hold → `failed` + `action_failed` with the relay's reason, made durable on the pending
record (`Ledger.roll_back`) *before* the `rollback` cleanup runs; no
`OK` (timeout, dropped connection) → `indeterminate` + `outcome_unknown`; a refusal
*after* an accepted event of a multi-event plan → partial effects exist, so `failed`
would lie: `indeterminate` + `outcome_unknown`, and the identical retry re-sends the same
events (accepted ones come back `duplicate:`) until the relay takes the rest. An event
whose NIP-42 AUTH custody could not sign (the custodian gone or hung) never reached the
relay's store, and the fault is this host's: the same status, code `internal`, as when
custody cannot sign the event itself.

Each event not accepted is an INFO `relay.not_accepted` line of its request. One whose
outcome is unknown is also a WARNING `relay.outcome_unknown`, one line a minute per cause
(the pool's reason) with the count of those not shown (`daemon.fault_log.FaultLog`): a
stalled relay leaves every publish so, and must show where a relay down does.

Rolled back means never resumed: from the `roll_back` commit on, the record's events are
never sent again (a retry gets `RolledBack`: `finish_rollback` runs the rollback again and
the stored `failed` is recorded final), so a crash or a ledger fault after the rollback
(agents.create: the key destroyed) can never let a retry publish for what it undid. If
that commit fails, nothing is rolled back: the record is still resumable, so the answer is
`indeterminate` + `internal` and the retry re-sends the same events.

A resumed pending record is different: an earlier attempt may have sent its events, and
the relay may hold any of them. A refusal now proves nothing about those (relays answer
`rate-limited:` or `blocked:` before looking for a duplicate), so on a resumed attempt
any refusal is `indeterminate` + `outcome_unknown` and no rollback runs: rolling back
(agents.create: destroying the key) would leave the relay naming an agent that is gone,
and `failed` would promise that nothing happened. Only an acceptance (`duplicate:`
included) tells the retry what the relay holds, or a refusal `duplicate:` of an event the
relay is then found to hold (`_relay_holds`, a read by id): Buzz answers the resend of a
reaction it stored `OK false "duplicate: reaction already exists"` (its reactions upsert
runs before its event insert), every time, so a reaction.add whose OK was lost would
otherwise never finish. The event found is this attempt's own bytes, sent before.

A fresh attempt's `duplicate:` refusal is no such case (its bytes were never sent), so it
is `failed` as any first refusal, its message saying first what already exists
(`DUPLICATE_REFUSED`: a reaction this agent already made on that target). NIP-BA names no
other answer for reaction.add.

Cleanup steps run in order, each safe to run twice; a fault in one is logged. A
`commit` step that faults makes the answer `indeterminate` + `internal` instead of
`succeeded` and leaves the record pending: the relay has the events, the host's own part
(agents.delete: the credentials revoked, the key destroyed) is not done, and a final
`succeeded` would leave it undone for good; the identical retry re-sends the events
(`duplicate:`) and runs the steps again. A `rollback` step that faults leaves the stored
`failed` standing; an agents.create that ends `failed` leaves no key behind
(`destroy_minted`).

WARNING: `CHECKPOINTS` names the steps the crash tests kill at; keep it in step with the
`checkpoint(...)` calls here and in daemon/pipeline/broker.py.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

import trio

from buzzwire import kinds
from buzzwire.contract import ErrorCode, Request, Status, Verdict, encode_response
from buzzwire.nostr import SignedEvent
from custody import CustodyError, KeyRecord
from custody.custodian.client import CustodianClient, CustodianUnavailable

if TYPE_CHECKING:  # the facade loads the PKCS#11 binding: not where a custodian holds the keys
    from custody import Custody
from daemon.state.directory import AgentDirectory
from daemon.state.ledger import Ledger, RolledBack, Ticket
from daemon.fault_log import FaultLog
from daemon.log import log_event
from daemon.operations import Context, Plan
from daemon.operations._base import OperationRefused
from daemon.pipeline.pending import (Cleanup, DestroyAgent, Pending, RenameAgent, SetRuntime,
                                      steps_named)
from daemon.pipeline.recorder import Facts, Judged, Progress, Recorder, where
from daemon.relay.pool import (Accepted, PublishResult, Rejected, RelayPool, RelayRefused,
                               RelayUnavailable, Unknown)
from daemon.relay.protocol import Prefix, machine_prefix, quote_reason
from daemon.state.runtimes import RuntimeStore
from daemon.state.sessions import SessionStore
from daemon.state import leftovers
from daemon.state.sign_watermarks import SignWatermarks

__all__ = ["Publisher", "CHECKPOINTS", "Prepare", "MINT_REF_TAKEN", "DUPLICATE_REFUSED"]

_log = logging.getLogger("buzz_broker.publisher")

#: Steps a publishing request passes, named for the crash tests (design.md step 4):
#:   before_pending -- the plan is signed, nothing durable yet
#:   after_pending  -- the pending record is committed, nothing sent
#:   before_verdict -- the verdict is reached, not yet recorded (observer.emit: its
#:                     frames are held, daemon/pipeline/observer.py)
#:   after_verdict  -- the verdict is committed, the response not yet written
#: The relay-side steps (EVENT sent, OK received) are the test relay's to kill at.
CHECKPOINTS: Final = ("before_pending", "after_pending", "before_verdict", "after_verdict")
#: The refusal of an agents.create whose mint reference exists without its ledger record.
MINT_REF_TAKEN: Final = ("this requestId already made an agent here and its record is gone; "
                         "use a new requestId")
#: A fresh attempt's first event refused `duplicate:`, by its kind: what already exists, said
#: before the relay's words (which a relay may change). Buzz refuses a kind 7 whose author,
#: target and content match a reaction still active.
DUPLICATE_REFUSED: Final[dict[int, str]] = {kinds.REACTION: "the reaction already exists"}
#: A publishing operation's `prepare`: (Context, its own argument type) -> plan or verdict.
Prepare = Callable[..., Awaitable[Plan | Verdict]]


def _mint_ref(facts: Facts) -> str:
    """The custody mint reference of an agents.create: one per (requester, requestId)."""
    return f"{facts.agent}/{facts.request_id}"


#: Causes `relay.outcome_unknown` keeps apart: the pool's own words for an Unknown (no OK
#: within the timeout, the connection dropped before it or while sending), a handful.
UNKNOWN_CAUSES = 8


def _refused(kind: int, reason: str) -> str:
    """The agent's message for a fresh attempt refused with `reason` (already quoted):
    a `duplicate:` refusal of a kind in `DUPLICATE_REFUSED` says first what exists."""
    text = f"the relay did not accept the event: {reason}"
    exists = DUPLICATE_REFUSED.get(kind) if machine_prefix(reason) is Prefix.DUPLICATE else None
    return text if exists is None else f"{exists}: {text}"


class Publisher:
    """Owns a publishing request from its signed plan to its cleanup (module docstring)."""

    def __init__(self, *, custody: Custody | CustodianClient, directory: AgentDirectory, sessions: SessionStore,
                 runtimes: RuntimeStore, watermarks: SignWatermarks,
                 relay: RelayPool, ledger: Ledger, recorder: Recorder,
                 clock: Callable[[], float], checkpoint: Callable[[str], None]) -> None:
        self._custody = custody
        self._directory = directory
        self._sessions = sessions
        self._runtimes = runtimes
        self._watermarks = watermarks
        self._relay = relay
        self._ledger = ledger
        self._recorder = recorder
        self._clock = clock
        self._checkpoint = checkpoint
        # Each publish the relay left unanswered is an INFO `relay.not_accepted` of its own
        # request; a relay that stalls leaves every one so, and the operator's filter
        # (`journalctl -p warning`) must show it as a read's `read.relay_unavailable` shows
        # a relay down: at WARNING, one line a minute per cause, the next with the count.
        self._unknown = FaultLog(_log, "relay.outcome_unknown", level=logging.WARNING,
                                 max_causes=UNKNOWN_CAUSES)
        #: cleanup step type -> how it runs (a table, not an if-chain: daemon/pipeline/pending.py
        #: names the types, this names what each does).
        self._cleanups: dict[type[Cleanup], Callable[[Cleanup], Awaitable[None]]] = {
            DestroyAgent: self._destroy_agent,
            RenameAgent: self._rename_agent,
            SetRuntime: self._set_runtime,
        }

    async def plan_and_publish(self, ctx: Context, prepare: Prepare, request: Request,
                               ticket: Ticket, facts: Facts, progress: Progress) -> Judged:
        """Prepare the plan, then intent, pending, publish, cleanup."""
        result = await prepare(ctx, request.args)
        if isinstance(result, Verdict):
            return Judged.of(ctx.request_id, result)
        pending = Pending(
            action=request.action,
            events=result.events,
            success=encode_response(ctx.request_id,
                                    Verdict.succeeded(request.action, result.outcome)),
            rollback=result.rollback,
            commit=result.commit,
        )
        # The intent record comes before the pending record: a pending record whose intent
        # was never audited would be published by the next retry without one.
        if not await self._recorder.intent(facts, tuple(e.id for e in pending.events)):
            return Judged.internal(ctx.request_id)  # nothing was sent
        self._checkpoint("before_pending")
        try:
            await self._ledger.record_pending(ticket, pending.encode())
        except sqlite3.Error as exc:
            self._recorder.ledger_failed(facts, "record_pending", exc)
            return Judged.internal(ctx.request_id)  # nothing was sent
        self._checkpoint("after_pending")
        return await self.publish(facts, pending, progress, resumed=False, ticket=ticket)

    async def resume(self, facts: Facts, recorded: bytes, progress: Progress) -> Judged:
        """Finish a pending record left by a crash or an `indeterminate`: re-send its events.

        An earlier attempt may have sent them, so a refusal here is never `failed` and
        never rolls back (module docstring)."""
        try:
            pending = Pending.decode(recorded)
        except ValueError as exc:
            # A pending record this version cannot read: its events may or may not have
            # reached the relay, so nothing can be promised and nothing is re-sent.
            log_event(_log, "ledger.pending_unreadable", level=logging.ERROR,
                      agent=facts.agent, request_id=facts.request_id,
                      error=type(exc).__name__)
            return Judged.of(facts.request_id, Verdict.indeterminate(ErrorCode.INTERNAL))
        return await self.publish(facts, pending, progress, resumed=True)

    async def finish_rollback(self, facts: Facts, begun: RolledBack, progress: Progress
                              ) -> Judged:
        """A rolled-back record's retry: its rollback again (each step is safe twice), and
        its stored `failed` verdict to record final. Nothing is sent (module docstring).

        A record this version cannot read keeps its stored verdict unfinished:
        `indeterminate` + `internal` (its rollback cannot be run), recorded as not final.
        """
        try:
            pending = Pending.decode(begun.pending)
        except ValueError as exc:
            log_event(_log, "ledger.pending_unreadable", level=logging.ERROR,
                      agent=facts.agent, request_id=facts.request_id,
                      error=type(exc).__name__)
            return Judged.of(facts.request_id, Verdict.indeterminate(ErrorCode.INTERNAL))
        ids = tuple(e.id for e in pending.events)
        progress.event_ids = ids
        await self.cleanup(pending.rollback)
        return Judged(begun.response, begun.status, begun.code, event_ids=ids, published=True)

    async def publish(self, facts: Facts, pending: Pending, progress: Progress, *,
                      resumed: bool, ticket: Ticket | None = None) -> Judged:
        """Send the pending events in order and say what the relay's answers mean.

        `ticket`: the fresh attempt's (its refusal is marked rolled back); None when resumed.
        """
        ids = tuple(e.id for e in pending.events)
        progress.event_ids = ids
        verdict = await self._publish_events(facts, pending, progress, resumed=resumed,
                                             ticket=ticket)
        if verdict is None:
            return Judged(pending.success, Status.SUCCEEDED, event_ids=ids,
                          published=True)
        return Judged(encode_response(facts.request_id, verdict), verdict.status, verdict.code,
                      event_ids=ids, published=True)

    async def _publish_events(self, facts: Facts, pending: Pending, progress: Progress, *,
                              resumed: bool, ticket: Ticket | None) -> Verdict | None:
        """None when every event was accepted; otherwise the verdict (module docstring)."""
        accepted = 0
        for event in pending.events:
            progress.effects_possible = True
            try:
                result = await self._relay.publish(event.pubkey, event)
            except CustodyError as exc:
                # Custody could not sign the relay's AUTH (daemon/wiring.py): the event never
                # reached the relay's store, and the fault is this host's, as when custody
                # cannot sign an event: `internal`, with the status a refusal gets here.
                self._recorder.fault("relay_auth", facts.agent, facts.request_id,
                                     facts.action, exc)
                if accepted == 0 and not resumed:
                    assert ticket is not None, "a fresh attempt publishes under its ticket"
                    return await self._roll_back(facts, pending, progress, ticket,
                                                 Verdict.failed(ErrorCode.INTERNAL))
                return Verdict.indeterminate(ErrorCode.INTERNAL)
            if isinstance(result, Accepted) or (
                    resumed and await self._relay_holds(facts, event, result)):
                accepted += 1
                continue
            # The relay's reason, quoted back to the agent and to the operator log with
            # the cut every relay text gets (daemon/relay/protocol.py `quote_reason`).
            reason = quote_reason(getattr(result, "reason", ""))
            log_event(_log, "relay.not_accepted", agent=facts.agent,
                      request_id=facts.request_id, event_id=event.id,
                      result=type(result).__name__, reason=reason,
                      accepted_before=accepted, resumed=resumed)
            if isinstance(result, Unknown):
                self._unknown.record((result.reason,), agent=facts.agent,
                                     request_id=facts.request_id, reason=reason)
                return Verdict.indeterminate(
                    ErrorCode.OUTCOME_UNKNOWN,
                    "the relay did not confirm the event; retry the identical request")
            if accepted == 0 and not resumed:
                assert ticket is not None, "a fresh attempt publishes under its ticket"
                return await self._roll_back(
                    facts, pending, progress, ticket,
                    Verdict.failed(ErrorCode.ACTION_FAILED, _refused(event.kind, reason)))
            if accepted == 0:
                # `accepted` counts this attempt only; an earlier one may have been stored.
                return Verdict.indeterminate(
                    ErrorCode.OUTCOME_UNKNOWN,
                    f"the relay refused the event ({reason}) and an earlier attempt may "
                    f"have published it; retry the identical request to finish")
            return Verdict.indeterminate(
                ErrorCode.OUTCOME_UNKNOWN,
                f"the relay accepted {accepted} of {len(pending.events)} events and refused "
                f"the next ({reason}); retry the identical request to finish")
        if not await self.cleanup(pending.commit):
            # The relay has the events, but the host's own part did not finish (agents.delete:
            # the key destroyed, the credentials revoked). `succeeded` would promise what the
            # host has not done, final: no retry would ever run the steps again. The record
            # stays pending; the identical retry re-sends the events (the relay answers
            # `duplicate:`) and runs the steps again, each safe twice.
            return Verdict.indeterminate(
                ErrorCode.INTERNAL,
                "the relay accepted the events but this host could not finish its own part; "
                "retry the identical request to finish")
        return None

    async def _relay_holds(self, facts: Facts, event: SignedEvent, result: PublishResult
                           ) -> bool:
        """A resumed attempt's refusal `duplicate:`: does the relay hold this very event?

        Read by id as its author (Buzz answers a REQ by `ids` whatever its `p` gate). The
        bytes were sent before (resumed), so an event of this id is what an earlier attempt
        published. Any other refusal, or a read that fails, proves nothing: False, and the
        refusal stands (module docstring)."""
        if not isinstance(result, Rejected) or machine_prefix(result.reason) is not Prefix.DUPLICATE:
            return False
        try:
            found = await self._relay.query(event.pubkey, [{"ids": [event.id], "limit": 1}])
        except (RelayUnavailable, RelayRefused, CustodyError) as exc:  # custody: the AUTH
            log_event(_log, "relay.duplicate_unchecked", agent=facts.agent,
                      request_id=facts.request_id, event_id=event.id,
                      error=type(exc).__name__, reason=getattr(exc, "reason", None))
            return False
        held = any(e.get("id") == event.id for e in found)
        log_event(_log, "relay.duplicate_checked", agent=facts.agent,
                  request_id=facts.request_id, event_id=event.id, held=held)
        return held

    async def _roll_back(self, facts: Facts, pending: Pending, progress: Progress,
                         ticket: Ticket, verdict: Verdict) -> Verdict:
        """The first event of a fresh attempt was refused (or its AUTH not signed):
        `verdict`, durable first, then the rollback (module docstring). The commit failed:
        nothing is rolled back and the record stays resumable, so `indeterminate` +
        `internal`."""
        try:
            await self._ledger.roll_back(ticket, encode_response(facts.request_id, verdict),
                                         verdict.status, verdict.code)
        except sqlite3.Error as exc:
            self._recorder.ledger_failed(facts, "roll_back", exc)
            return Verdict.indeterminate(ErrorCode.INTERNAL)
        progress.rolled_back = True
        await self.cleanup(pending.rollback)
        return verdict

    async def cleanup(self, steps: tuple[Cleanup, ...]) -> bool:
        """Run cleanup steps in order; each is safe to run twice. False when one faulted.

        A fault is logged for the operator. What it means is the caller's: a commit's
        (`_publish_events`) leaves the record pending, a rollback's leaves the stored
        `failed` standing (agents.create's minted key is `destroy_minted`'s to find).
        """
        try:
            for step in steps:
                await self._cleanups[type(step)](step)
        except Exception as exc:  # noqa: BLE001 - CustodyError, sqlite3.Error or worse
            log_event(_log, "housekeeping.failed", level=logging.ERROR,
                      work=steps_named(steps), error=type(exc).__name__, where=where(exc))
            return False
        return True

    async def _destroy_agent(self, step: Cleanup) -> None:
        assert isinstance(step, DestroyAgent)
        # Credentials first, off the event loop (a commit's fsync, issue 22 L6): if custody
        # then fails, the deleted agent can no longer act while the key waits for the retry.
        await trio.to_thread.run_sync(self._sessions.revoke_agent, step.pubkey)
        if self._custody.agent(step.pubkey) is not None:
            await self._custody.destroy_agent(step.pubkey)
        await self._prune_leftovers()

    async def _prune_leftovers(self) -> None:
        """After a destroy: what the daemon keeps of keys that are gone goes
        (daemon/state/leftovers.py). Housekeeping only: a fault is logged, and the next
        destroy, or the next start, prunes them."""
        await trio.to_thread.run_sync(functools.partial(
            leftovers.housekeep, self._directory, self._watermarks, self._runtimes,
            custodian=isinstance(self._custody, CustodianClient)))

    async def _rename_agent(self, step: Cleanup) -> None:
        assert isinstance(step, RenameAgent)
        # Public data only: the directory writes it, off the event loop, without custody.
        await trio.to_thread.run_sync(self._directory.rename, step.pubkey, step.name)

    async def _set_runtime(self, step: Cleanup) -> None:
        assert isinstance(step, SetRuntime)
        await trio.to_thread.run_sync(self._runtimes.set, step.pubkey, step.runtime,
                                      int(self._clock()))

    async def mint(self, ticket: Ticket, facts: Facts, progress: Progress) -> KeyRecord:
        """agents.create's key, bound to this request's ledger record (issue 22 H1).

        The record is reserved (durable, with its tombstone) before custody mints, so the
        mint reference `<agent>/<requestId>` never exists without one. A key custody
        already holds under that reference is this record's own only when an earlier
        attempt of this very record left it (`Progress.recorded`: it reserved, then
        crashed or ended indeterminate before sending). Otherwise its record is gone (a
        lost ledger file, or records swept before tombstones existed): the key belongs to
        a create whose verdict this host no longer knows, so the request is refused
        `request_id_conflict` and the key is left alone. Only a key bound here is
        destroyed when the request ends failed: the one custody answered
        (`Progress.minted`), or, when the mint got no answer (the custodian died before
        answering, answered after the call's deadline, or no snapshot could be taken after
        it), the one under the reference: from the reservation on, `Progress.recorded` is
        set, so `destroy_minted` looks it up as for a retry's.

        Raises:
            OperationRefused: the mint reference outlived its record.
            CustodyError, sqlite3.Error: custody or the ledger failed (nothing published).
        """
        mint_ref = _mint_ref(facts)
        # Nobody else mints this reference meanwhile: it is this ticket's requestId, and
        # the ticket owns it in the one process that owns the ledger.
        found = self._directory.by_mint_ref(mint_ref)
        if found is not None and not progress.recorded:
            raise OperationRefused(ErrorCode.REQUEST_ID_CONFLICT, MINT_REF_TAKEN,
                                   detail=f"mint reference held by {found.pubkey}")
        await self._ledger.reserve(ticket)
        # Reserved: whatever key custody holds under the reference from now on is this
        # record's, as for a retry of it. Set before asking: a mint that gets no answer may
        # have made one.
        progress.recorded = True
        try:
            record = await self._custody.mint_agent(owner=facts.agent, mint_ref=mint_ref)
        except CustodianUnavailable:
            progress.mint_unanswered = True
            raise
        progress.minted = record.pubkey
        return record

    async def destroy_minted(self, facts: Facts, judged: Judged, progress: Progress) -> Judged:
        """An agents.create that ends `failed` leaves no key of its own behind.

        The key bound to this record is destroyed: the one this attempt bound (`mint`,
        `Progress.minted`); or, once the record is reserved (`Progress.recorded`), the
        one under the record's mint reference: made by this attempt's mint that got no
        answer, or by an earlier attempt though this one was refused before it ran
        (policy changed meanwhile). That record ends here, final, and its key would
        otherwise stay live, unreachable through the API. The reference is looked up in
        records taken now (a mint that got no answer left the custodian's snapshot stale).
        A fresh verdict reached before execution has none; a resumed record never ends
        `failed` from the relay (module docstring), so its key stays for the retry. If the
        key cannot be looked up or destroyed, the answer becomes `indeterminate` +
        `internal` instead, recorded as not final without pending work: the identical
        retry starts afresh, finds the same key bound to its record, and carries on with
        it (or, refused, destroys it here).
        """
        pubkey = progress.minted
        try:
            if pubkey is None and progress.recorded:
                # Bound to this record, not found by reference alone: `recorded` says this
                # record reserved before minting (`mint`), so the reference's key is its own.
                if isinstance(self._custody, CustodianClient):
                    await self._custody.records.refreshed()
                earlier = self._directory.by_mint_ref(_mint_ref(facts))
                pubkey = earlier.pubkey if earlier is not None else None
            if pubkey is None and progress.mint_unanswered:
                # No key under the reference yet, but a custodian alive past the call's
                # deadline may still make it: "no effects" cannot be promised. The
                # identical retry asks the same (idempotent) mint and settles it.
                raise CustodianUnavailable("the unanswered mint's key may still be made")
            if pubkey is None or self._custody.agent(pubkey) is None:
                return judged
            await self._custody.destroy_agent(pubkey)
            await trio.to_thread.run_sync(self._sessions.revoke_agent, pubkey)
            await self._prune_leftovers()
        except Exception as exc:  # noqa: BLE001 - the key may survive: say so, do not lie
            self._recorder.fault("destroy_minted", facts.agent, facts.request_id,
                                 facts.action, exc)
            return Judged.of(facts.request_id, Verdict.indeterminate(ErrorCode.INTERNAL))
        log_event(_log, "agents.create.minted_destroyed", agent=facts.agent,
                  request_id=facts.request_id, minted=pubkey)
        return judged
