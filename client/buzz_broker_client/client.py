"""The agent side of the broker protocol: a client that meets the spec's [C1] list.

Theory of operation (spec §Conformance [C1], invariants I2–I6):

1. Freeze once. Every call is validated and normalized by the *same* contract code the
   host runs (`buzzwire.contract.build_request`), then serialized exactly once
   (`encode_request`). Those bytes, under that requestId, are what every attempt sends;
   there is no code path that re-renders a request between attempts (I3).
2. Send. One HTTP/1.1 POST /v1/action per attempt, `Authorization: Bearer …`, over a
   Unix socket or plain HTTP to loopback only (`buzz_broker_client._transport`).
3. Judge. An envelope is parsed from every response whatever its HTTP status; a valid
   envelope is the answer and the status line is decoration. No parseable envelope is a
   transport failure (§HTTP binding). A parsed envelope is then read against the request
   that produced it (I5): requestId equal; on success, the same action and the outcome
   shape of that action; echoed identities equal as parsed values; a page no longer than
   the effective limit; a status/code pair the table allows. Any failing check makes the
   response *no answer* — never a verdict. Returned events are verified (id and BIP-340
   signature, `buzzwire.nostr`) by default (I4); see `EventVerification` for the policy.
   The one leniency is Buzz's reference client's: `"replayed": false` reads as absent
   (`parse_response(accept_replayed_false=True)`); the host still omits it.
4. Retry. No answer and `indeterminate` are retried with the identical bytes, with
   exponential backoff, up to `RetryPolicy.max_attempts` attempts and
   `RetryPolicy.total_seconds`. `succeeded`, `failed` and unsupported are final, with
   one exception: once an attempt may have reached the host (or an earlier call of the
   request did: `send(request, prior=fate_unknown)`), a `failed` the host does not
   replay from its record says nothing about that earlier attempt (NIP-BA: "A refusal
   of a retry does not undo or disprove earlier execution"), so the call's answer stays
   the fate-unknown one (`_fate_blind`). Retrying stops at the refusals no retry can
   change (`unauthenticated`, `unauthorized`, `request_id_conflict`) and goes on after
   the others. Otherwise a credential expiring, a permission lost, between two attempts
   would read as "nothing happened" and invite a second request. A `replayed` `failed`
   is the host's record of the request: final. A caller's own cancellation (a timeout
   around the call) is re-raised unchanged, with no answer to carry the request back:
   once an attempt may have reached the host, one warning names its request id, "fate
   unknown". A caller who cancels keeps the frozen request itself (`freeze`, then
   `send`) and re-sends it with `prior=NoAnswer.cancelled(request)` (docs/agents.md §2).
5. Bound. Each action's answer has a byte bound and a bound on its JSON values
   (`_bounds`), checked before a JSON object is built; a larger body is no answer. A
   large body is judged on a worker thread inside the attempt's deadline, never on the
   caller's event loop.

The answer types (one base, `Result`; all frozen):

=================  ==========================================================================
`Succeeded`        the host did it; `outcome` says what; `replayed` marks a recorded replay.
`Failed`           the host promises nothing happened (any code; for `unauthenticated` the
                   methods raise `CredentialRefused` carrying it, `judge` returns it).
`Unsupported`      `failed` + `unsupported` on a best-effort operation (reaction.add and the
                   live signals presence.set, typing.set: `ActionSpec.best_effort`): a normal
                   answer; carry on. On any other operation `unsupported` is a `Failed`.
`Indeterminate`    fate unknown: the host answered `indeterminate` to the last attempt
                   that could tell (a later one may have been refused, point 4).
`NoAnswer`         fate unknown: the last such attempt got no verdict (transport failure,
                   no envelope, a response that failed I5, or an event that failed I4).
=================  ==========================================================================

`Indeterminate` and `NoAnswer` share the base `FateUnknown`: after the retry bound the
caller must reconcile (read state) or retry later *with the same request id and bytes*
(`send(answer.request, prior=answer)` does so, keeping the uncertainty).

Setup problems raise instead (`buzz_broker_client._errors`, table `SETUP_PROBLEMS`): a
connect that failed as "missing", "refused" or "permission" on every attempt of a call
(nothing was sent; permission is not retried), a loopback TCP listener's `403` naming its
rule (`ListenerRefused`: refused before routing; not retried, the same bytes get the same
`403`), and the verdict `failed` + `unauthenticated` before any attempt may have reached
the host (`CredentialRefused`, carrying that `Failed`). Each is "nothing happened" with a
message saying what to fix; an agent cannot usefully go on without fixing it. One that is
not retried, after an attempt that may have reached the host, ends the call with that
attempt's fate-unknown answer instead.

Rules:
- The credential is held inside a `Credential` (redacting repr), written only into the
  Authorization header, and never logged. Log lines carry the request id, the action,
  the attempt and a fixed-vocabulary reason; never arguments or content.
- Bad arguments are the caller's: `build_request` raises `ContractError` and nothing is
  sent; its `message` is the host's own `invalid_request` text for them (pointer and
  rule, docs/protocol.md §5). A bad address or credential raises `ValueError` at construction.
- `AsyncBrokerClient` is the one implementation; it runs on asyncio or trio (anyio).
  `BrokerClient` (`_blocking`) is the same methods for threads and synchronous code.
- The address and credential default from the environment (`_env`): `BUZZ_BROKER_SOCKET`,
  `BUZZ_BROKER_CREDENTIAL` / `BUZZ_BROKER_CREDENTIAL_FILE`.

The per-action echo checks (`_ECHO_CHECKS`) are built from `ActionSpec.echoes`.
"""

from __future__ import annotations

import enum
import logging
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeAlias, TypeVar

import anyio
import anyio.to_thread

from buzzwire.contract import (
    ACTIONS,
    PAIRING,
    AgentsCreateOutcome,
    AgentsDeleteOutcome,
    AgentsUpdateOutcome,
    ContractError,
    ErrorCode,
    Event,
    ObserverEmitOutcome,
    PublishOutcome,
    ReadOutcome,
    Request,
    Response,
    Status,
    StorageAddressOutcome,
    StorageGetOutcome,
    build_request,
    echo_mismatch,
    encode_request,
    normalize_channel_id,
    normalize_hex64,
    parse_json,
    parse_response,
)
from buzzwire.jsonvalues import values_at_most
from buzzwire.kinds import MEMORY
from buzzwire.nostr import verify_event

from ._bounds import response_bytes, response_values
from ._env import resolve_address, resolve_credential
from ._errors import (
    LISTENER_REFUSALS, SETUP_PROBLEMS, CredentialRefused, SetupError, SocketPermissionDenied,
)
from ._transport import (
    ConnectFailure, ConnectKind, Credential, Endpoint, HttpReply, TransportFailure,
    closed_directory, credential_refusal, exchange,
)

__all__ = [
    "AsyncBrokerClient",
    "RetryPolicy",
    "EventVerification",
    "Result",
    "Succeeded",
    "Failed",
    "Unsupported",
    "FateUnknown",
    "Indeterminate",
    "NoAnswer",
    "NoAnswerReason",
    "Answer",
    "ReadAll",
    "ReadEnd",
    "judge",
]

_log = logging.getLogger("buzz_broker.client")

O = TypeVar("O")


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """Base of every answer the client gives. Never instantiated itself.

    Attributes:
        request_id: the request id that was sent.
        action: the action's wire name.
        attempts: how many times its bytes were sent.
    """

    request_id: str
    action: str
    attempts: int

    def __post_init__(self) -> None:
        # The bases exist for isinstance checks; an answer is always one of the leaves.
        if type(self) in (Result, FateUnknown):
            raise TypeError(f"{type(self).__name__} is a base type; construct one of its answers")


@dataclass(frozen=True, slots=True, kw_only=True)
class Succeeded(Result, Generic[O]):
    """`succeeded`: the operation completed and `outcome` describes it.

    Attributes:
        outcome: the action's outcome (`PublishOutcome`, `ReadOutcome`, ...).
        replayed: True when the host replayed a recorded outcome (a retry of a request
            it had already finished).
        envelope: the host's response body, verbatim.
    """

    outcome: O
    replayed: bool
    envelope: bytes = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed(Result):
    """`failed`: the host promises no side effects took hold. Not retried.

    Only ever the first verdict on the request, or the host's record of it (`replayed`):
    a refusal after an attempt that may have reached the host is a `FateUnknown` instead.

    `unsupported` lands here too for an operation that is not best-effort: the agent
    cannot do that job on this host.

    Attributes:
        code: the error code (`unauthorized`, `action_failed`, `invalid_request`, ...).
        message: the host's operator-facing message.
        envelope: the host's response body, verbatim.
    """

    code: ErrorCode
    message: str
    envelope: bytes = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsupported(Result):
    """`failed` + `unsupported` on a best-effort operation (reaction.add, presence.set,
    typing.set, observer.emit, liveness.ping): carry on.

    Attributes:
        message: the host's message.
        envelope: the host's response body, verbatim.
    """

    message: str
    envelope: bytes = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class FateUnknown(Result):
    """Base of the two "fate unknown" answers, returned once the retry bound is spent.

    Nothing can be concluded about side effects. Retry later with the same request id
    and bytes (the host deduplicates): `client.send(answer.request, prior=answer)`
    re-sends the same frozen request (`encode_request` is canonical, so its bytes are the
    same) and keeps this uncertainty, so a refusal of the re-send is not read as "nothing
    happened". Or read state to find out.

    Attributes:
        request: the frozen request, to hand back to `send`.
    """

    request: Request = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Indeterminate(FateUnknown):
    """Fate unknown: the host answered `indeterminate` (`outcome_unknown` or `internal`).

    It answered so to the last attempt that could tell; a later attempt may have been
    refused without a word on the request's fate (any refusal the host did not replay
    from its record: its credential or a permission lost, a conflict, a fault before it
    read its record), which leaves this the answer.

    Attributes:
        code: `outcome_unknown` or `internal`.
        message: the host's message.
        envelope: the host's response body, verbatim.
    """

    code: ErrorCode
    message: str
    envelope: bytes = field(repr=False)


class NoAnswerReason(enum.Enum):
    """Why an attempt produced no verdict (spec §HTTP binding, I4, I5)."""

    #: connect refused, connection dropped, timed out, HTTP framing broken
    TRANSPORT = "transport"
    #: an HTTP response came back but its body is not a valid envelope (a proxy's 401,
    #: a 502, a `null` member, an extra member, a forbidden status/code pair)
    NO_ENVELOPE = "no_envelope"
    #: a valid envelope that does not answer the request that was sent (I5)
    MISMATCH = "mismatch"
    #: a returned event whose id or signature does not verify (I4, default policy)
    UNVERIFIED_EVENT = "unverified_event"


@dataclass(frozen=True, slots=True, kw_only=True)
class NoAnswer(FateUnknown):
    """Fate unknown: no verdict came back.

    The last attempt that could tell got none; as for `Indeterminate`, a later attempt
    may have been refused without a word on the request's fate.

    Attributes:
        reason: why (`NoAnswerReason`).
        detail: a short fixed phrase for operators (what failed, never a secret).
    """

    reason: NoAnswerReason
    detail: str

    @classmethod
    def cancelled(cls, request: Request) -> NoAnswer:
        """The `prior` for re-sending `request` after you cancelled a call that sent it.

        A call cancelled by its caller returns nothing, and the host may have done it: the
        re-send, `client.send(request, prior=NoAnswer.cancelled(request))`, keeps that
        uncertainty, so a refusal of it is not read as "nothing happened" (docs/agents.md §2).

        Args:
            request: the frozen request whose call was cancelled (`freeze`).

        Returns:
            A `NoAnswer` for one attempt, reason `TRANSPORT`, "cancelled by the caller".
        """
        return cls(request_id=request.request_id, action=request.action, attempts=1,
                   request=request, reason=NoAnswerReason.TRANSPORT,
                   detail="cancelled by the caller")


#: What a typed method returns: a `Succeeded` whose outcome has that operation's shape,
#: or one of the other answers.
Answer: TypeAlias = Succeeded[O] | Failed | Unsupported | Indeterminate | NoAnswer


# --------------------------------------------------------------------------- policy

#: The most attempts a `RetryPolicy` may ask for (NIP-BA: bounded retries).
MAX_ATTEMPTS = 100


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How hard to try before answering "fate unknown".

    Delays are deterministic (no jitter): one agent talks to one local host over its own
    credential, so there is no herd to spread out, and tests can reason about timing.

    Every value must be finite (NIP-BA: bounded backoff, never an unbounded retry loop);
    anything else raises `ValueError`.

    Attributes:
        max_attempts: attempts in all, the first included (4); at most `MAX_ATTEMPTS` (100).
        first_delay: seconds before the second attempt (0.25); positive when
            `max_attempts` > 1.
        multiplier: each later wait is the last times this (2); at least 1.
        max_delay: the longest wait, seconds (4).
        attempt_seconds: bound on one attempt: connect, send, read the whole response (30).
        total_seconds: bound on the whole call, waits included; no attempt starts after
            it (60).
    """

    #: attempts in all, the first included
    max_attempts: int = 4
    #: wait before the second attempt; multiplied by `multiplier` each time after
    first_delay: float = 0.25
    multiplier: float = 2.0
    max_delay: float = 4.0
    #: bound on one attempt (connect, send, read the whole response)
    attempt_seconds: float = 30.0
    #: bound on the whole call, waits included; no attempt starts after it
    total_seconds: float = 60.0

    def __post_init__(self) -> None:
        # NIP-BA: "clients MUST use bounded backoff, not an unbounded retry loop". Every
        # value is finite (NaN compares false to every bound, inf is no bound), and a
        # retry waits: max_attempts, total_seconds and first_delay together end the call.
        if type(self.max_attempts) is not int or not 1 <= self.max_attempts <= MAX_ATTEMPTS:
            raise ValueError(f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS}")
        for name in ("first_delay", "multiplier", "max_delay", "attempt_seconds", "total_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number")
        for name in ("first_delay", "max_delay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.max_attempts > 1 and self.first_delay <= 0:
            raise ValueError("first_delay must be positive when retrying (max_attempts > 1)")
        if self.multiplier < 1:
            raise ValueError("multiplier must be at least 1")
        for name in ("attempt_seconds", "total_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


class EventVerification(enum.Enum):
    """What to do with the signed events a read returns (I4: the caller's policy).

    VERIFY (the default): check every event's id and BIP-340 signature locally. A page
    holding any event that fails is *no answer* (`NoAnswerReason.UNVERIFIED_EVENT`), and
    is retried like any other no-answer (a read has no side effects, so that is free).
    Dropping just the bad event was rejected: it would hand the caller a page that looks
    complete but is not, and a forged mention silently vanishing is the failure I4 exists
    to expose.

    SKIP: trust the host for authorship as well as completeness. Must be asked for by
    name.
    """

    VERIFY = "verify"
    SKIP = "skip"


# --------------------------------------------------------------------------- judging


def _echo_check(action: str) -> Callable[[Request, object, str | None], str | None]:
    echoes = ACTIONS[action].echoes
    kind = ACTIONS[action].published_kind

    def check(request: Request, outcome: object, me: str | None) -> str | None:
        args: Any = request.args
        if isinstance(outcome, ReadOutcome) and len(outcome.messages) > args.effective_limit:
            return "page holds more events than the effective limit"
        if kind is not None and isinstance(outcome, PublishOutcome) and outcome.kind != kind:
            return "published outcome reports another kind than the action publishes"
        # NIP-BA: storage.address "returns the agent's author pubkey, kind 30174".
        if isinstance(outcome, StorageAddressOutcome) and outcome.kind != MEMORY:
            return "storage address reports another kind than 30174"
        # NIP-BA: observer receipts must fit the submitted frame count.
        if isinstance(outcome, ObserverEmitOutcome) and outcome.accepted > len(args.frames):
            return "accepted counts more frames than were sent"
        problem: str | None = echo_mismatch(echoes, args, outcome, me)
        return problem

    return check


#: action -> the I5 echo check of a succeeded outcome, from `ActionSpec.echoes`. `me` is the
#: agent's own pubkey when the caller told the client; echoes that need it are skipped otherwise.
_ECHO_CHECKS: Mapping[str, Callable[[Request, object, str | None], str | None]] = {
    action: _echo_check(action) for action in ACTIONS
}


#: The `failed` codes a retry of the same bytes cannot change: the credential, its
#: permissions, and the record under this request id are what they are. Once an earlier
#: attempt may have reached the host, the call stops at one of these (answering the
#: earlier fate-unknown); after any other unreplayed `failed` it retries.
_FINAL_REFUSALS = frozenset({
    ErrorCode.UNAUTHENTICATED, ErrorCode.UNAUTHORIZED, ErrorCode.REQUEST_ID_CONFLICT,
})


def _fate_blind(answer: Result, replayed: bool) -> bool:
    """True for a refusal that says nothing about what an earlier attempt did.

    NIP-BA: "A refusal of a retry does not undo or disprove earlier execution. [...]
    conflict, revocation, or permission loss only proves this attempt introduced no new
    effects. Clients with earlier uncertainty MUST retain it." So once an attempt may
    have reached the host, every `failed` (and best-effort `unsupported`) is about this
    attempt alone, unless the host says it comes from its record of the request
    (`replayed`): that is its real verdict on the request. An `unauthenticated` refusal is
    never such a record (`_judge` reads its `replayed` as absent).
    """
    return isinstance(answer, (Failed, Unsupported)) and not replayed


def _verify_events(outcome: object) -> bool:
    if not isinstance(outcome, ReadOutcome) or not outcome.messages:
        return True
    return all(verify_event(event.to_json_obj()) for event in outcome.messages)


#: outcome type -> its members that name an identity or a name (wire name, attribute). The
#: contract's reader accepts any spelling NIP-BA accepts as input and hands back the
#: canonical one; NIP-BA holds a host's output to the canonical one (lowercase hex,
#: lowercase hyphenated UUID, names trimmed), so the raw member must already be it.
_CANONICAL_OUTPUTS: Mapping[type, tuple[tuple[str, str], ...]] = {
    PublishOutcome: (("eventId", "event_id"),),
    StorageAddressOutcome: (("authorPubkey", "author_pubkey"), ("dTag", "d_tag")),
    AgentsCreateOutcome: (("agentPubkey", "agent_pubkey"), ("displayName", "display_name"),
                          ("channelId", "channel_id")),
    AgentsUpdateOutcome: (("agentPubkey", "agent_pubkey"), ("displayName", "display_name")),
    AgentsDeleteOutcome: (("agentPubkey", "agent_pubkey"), ("displayName", "display_name")),
}


def _not_canonical(body: bytes, outcome: object) -> bool:
    """True when a member of `_CANONICAL_OUTPUTS` was not sent in its canonical form.

    The body has parsed already (one small outcome: bounded by `_bounds.response_bytes`).
    """
    members = _CANONICAL_OUTPUTS.get(type(outcome))
    if members is None:
        return False
    top: Any = parse_json(body)[0]
    raw = top["outcome"]
    return any(raw[wire] != getattr(outcome, attr) for wire, attr in members)


def _as_answer(unknown: FateUnknown) -> Indeterminate | NoAnswer:
    """A `FateUnknown` as the answer it always is (the base is never constructed)."""
    assert isinstance(unknown, (Indeterminate, NoAnswer))
    return unknown


#: Bodies up to this size are judged on the loop (every non-read answer: at most
#: `_bounds.SMALL_ANSWER_BYTES`), a millisecond at most; larger ones (pages of events,
#: a memory record) on a worker thread.
_JUDGE_INLINE_BYTES = 64 * 1024


def _listener_refusal(reply: HttpReply) -> str | None:
    """A loopback TCP listener's refusal line (`LISTENER_REFUSALS`, without its newline)
    when `reply` is one, else None. Judged as any reply without an envelope, it is no
    answer; `_attempts` reads this to stop, since the same bytes get the same 403."""
    if reply.status == 403 and reply.body in LISTENER_REFUSALS:
        return reply.body.decode("ascii").rstrip("\n")
    return None


def _no_answer(request: Request, attempt: int, reason: NoAnswerReason, detail: str) -> NoAnswer:
    """The one spelling of "this attempt got no verdict" (judging and transport alike)."""
    return NoAnswer(request_id=request.request_id, action=request.action, attempts=attempt,
                    request=request, reason=reason, detail=detail)


def judge(
    request: Request,
    reply: HttpReply,
    outcome_type: type[O],
    *,
    attempt: int,
    verification: EventVerification = EventVerification.VERIFY,
    me: str | None = None,
) -> Answer[O]:
    """Read one HTTP reply against the request that produced it (pure; no I/O).

    Args:
        request: the request as frozen (its parsed form; the bytes came from it).
        reply: status and body as received.
        outcome_type: the outcome class of `request.action`.
        attempt: the attempt number, recorded in the answer.
        verification: the I4 policy.
        me: the agent's own pubkey, if known (enables the checks that need it).

    Returns:
        A verdict (`Succeeded`, `Failed`, `Unsupported`, `Indeterminate`) only when the
        envelope parses and passes every I5 check; otherwise `NoAnswer`. A body larger,
        or holding more JSON values, than an answer to this request can
        (`_bounds.response_bytes`, `response_values`; a page: the values any page the host
        serves can hold, `buzzwire.contract.MAX_PAGE_VALUES`) is `NoAnswer` unparsed.
    """
    return _judge(request, reply, outcome_type, attempt=attempt, verification=verification,
                  me=me)[0]


def _judge(
    request: Request,
    reply: HttpReply,
    outcome_type: type[O],
    *,
    attempt: int,
    verification: EventVerification,
    me: str | None,
) -> tuple[Answer[O], bool]:
    """`judge`, and whether the envelope said `replayed` (what `_fate_blind` needs)."""
    rid, action = request.request_id, request.action

    def no_answer(reason: NoAnswerReason, detail: str) -> tuple[NoAnswer, bool]:
        return _no_answer(request, attempt, reason, detail), False

    if len(reply.body) > response_bytes(request):
        return no_answer(NoAnswerReason.NO_ENVELOPE, "response larger than an answer to this action can be")
    values = response_values(request)
    if values_at_most(reply.body, values - 1, values) > values:
        # Counted in the raw bytes, before json builds an object (see _bounds).
        return no_answer(NoAnswerReason.NO_ENVELOPE, "response holds more JSON values than an answer to this action can")
    try:
        # Buzz's reference client reads `replayed` with a default, so `false` is an answer.
        response: Response = parse_response(reply.body, accept_replayed_false=True)
    except (ContractError, ValueError):  # ValueError: Response's own construction checks
        # §HTTP binding: only now does the status line matter, as operator detail.
        return no_answer(NoAnswerReason.NO_ENVELOPE, f"HTTP {reply.status} without a valid envelope")
    if response.request_id != request.request_id:
        return no_answer(NoAnswerReason.MISMATCH, "response is for another requestId")
    if response.code is not None and response.status not in PAIRING[response.code]:
        return no_answer(NoAnswerReason.MISMATCH, "status and error code contradict each other")

    if response.status is Status.SUCCEEDED:
        if response.action != request.action:
            return no_answer(NoAnswerReason.MISMATCH, "succeeded outcome is for another action")
        outcome = response.outcome
        if not isinstance(outcome, outcome_type):
            return no_answer(NoAnswerReason.MISMATCH, "outcome has another action's shape")
        problem = _ECHO_CHECKS[request.action](request, outcome, me)
        if problem is not None:
            return no_answer(NoAnswerReason.MISMATCH, problem)
        if _not_canonical(reply.body, outcome):
            return no_answer(NoAnswerReason.MISMATCH, "outcome names an identity in a non-canonical form")
        if verification is EventVerification.VERIFY and not _verify_events(outcome):
            return no_answer(NoAnswerReason.UNVERIFIED_EVENT, "an event's id or signature does not verify")
        return Succeeded(request_id=rid, action=action, attempts=attempt, outcome=outcome,
                         replayed=response.replayed, envelope=reply.body), response.replayed

    assert response.code is not None and response.message is not None  # parse_response's shape rule
    # A host's records are per authenticated principal: a request it could not
    # authenticate has no record to replay, so `replayed` on that refusal is read as absent
    # (else, after a lost attempt, a wrong host's word would turn "fate unknown" into
    # CredentialRefused, "nothing happened").
    replayed = response.replayed and response.code is not ErrorCode.UNAUTHENTICATED
    if response.status is Status.FAILED:
        if response.code is ErrorCode.UNSUPPORTED and ACTIONS[request.action].best_effort:
            return Unsupported(request_id=rid, action=action, attempts=attempt,
                               message=response.message, envelope=reply.body), replayed
        return Failed(request_id=rid, action=action, attempts=attempt, code=response.code,
                      message=response.message, envelope=reply.body), replayed
    return Indeterminate(request_id=rid, action=action, attempts=attempt, request=request,
                         code=response.code, message=response.message,
                         envelope=reply.body), replayed


# --------------------------------------------------------------------------- paging


class ReadEnd(enum.Enum):
    """Why `read_all` stopped."""

    #: a page came back without nextCursor: everything was read
    EXHAUSTED = "exhausted"
    #: the caller's `stop_when` matched an event (it and the rest of its page are left out)
    STOPPED = "stopped"
    #: `max_pages` pages were read and a nextCursor remained
    MAX_PAGES = "max_pages"
    #: a page's answer was not `Succeeded`; see `ReadAll.last`
    NOT_SUCCEEDED = "not_succeeded"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadAll:
    """The result of following nextCursor.

    `messages` are the events of every page read, in the host's order. `resume_cursor`
    is the cursor to continue from (verbatim from the host) when `end` is MAX_PAGES or
    NOT_SUCCEEDED (None when the failing page was the first and no cursor was given).
    `last` is the last page's answer.
    """

    messages: tuple[Event, ...]
    end: ReadEnd
    pages: int
    resume_cursor: str | None
    last: Answer[ReadOutcome]


# --------------------------------------------------------------------------- clients


def _new_request_id() -> str:
    return str(uuid.uuid4())


def _wire(**members: object) -> dict[str, object]:
    """The argument mapping with every absent member omitted (I6): None, False-as-default
    and empty sequences are absence, never emitted."""
    out: dict[str, object] = {}
    for name, value in members.items():
        if value is None or value is False:
            continue
        if isinstance(value, (list, tuple)):
            if not value:
                continue
            value = list(value)
        out[name] = value
    return out


def _target(pubkey: str | None, name: str | None) -> dict[str, object]:
    return _wire(pubkey=pubkey, name=name)


class AsyncBrokerClient:
    """The [C1] client for async code on asyncio or trio. Cheap to construct; holds no
    connection, so one instance may serve many tasks at once.

    Args:
        address: the host's Unix socket path (`/run/…/broker.sock`, or `unix:/…`), or
            `http://127.0.0.1:PORT` / `http://[::1]:PORT` / `http://localhost:PORT`.
            Default: `$BUZZ_BROKER_SOCKET`, else `/run/buzz-broker/broker.sock`.
        credential: the bearer credential this agent was handed. Held privately.
            Default: `$BUZZ_BROKER_CREDENTIAL`, or the file `$BUZZ_BROKER_CREDENTIAL_FILE`.
        credential_file: read the credential from this file instead (mode 0400; a file
            others can read is used, with a logged warning).
        retry: the retry bound.
        events: the I4 policy for returned events (default: verify).
        agent_pubkey: this agent's own public key, if known: then a storage address for
            another author, and a mentions-only page with an event not mentioning it,
            are no answer too.
        new_request_id: request-id factory (default uuid4).

    Raises:
        NotConfigured: no credential given or in the environment, or an unusable
            credential file (a `ValueError` too).
        ValueError: an address that is not a socket path or loopback HTTP; a malformed
            credential (the message never quotes it); a malformed agent_pubkey.

    Every operation method raises `ContractError` (nothing sent) when its arguments break
    the contract, a `SetupError` when the broker cannot be used at all (nothing happened;
    see the module docstring), and otherwise returns an `Answer`.
    """

    def __init__(
        self,
        address: str | None = None,
        credential: str | None = None,
        *,
        credential_file: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
        events: EventVerification = EventVerification.VERIFY,
        agent_pubkey: str | None = None,
        new_request_id: Callable[[], str] = _new_request_id,
    ) -> None:
        # No frame of the package on the traceback of what this raises holds the credential
        # (the rule in `_env`'s docstring): the other arguments are checked before it is
        # read, `credential` (perhaps the only name the caller's value has) is dropped on
        # every way out, and a bad one is judged by a helper before the raise.
        try:
            self._endpoint = Endpoint.parse(resolve_address(address))
            me = normalize_hex64(agent_pubkey) if agent_pubkey is not None else None
            if agent_pubkey is not None and me is None:
                raise ValueError("agent_pubkey must be 64 hex characters")
            secret, read = resolve_credential(credential, credential_file)
        finally:
            del credential
        refusal = credential_refusal(secret)
        if refusal is not None:
            del secret, read  # the file's record holds it too (its repr does not show it)
            raise refusal
        if read is not None and read.loose_mode is not None:
            _log.warning("credential file is readable by others (mode %04o); make it 0400",
                         read.loose_mode)
        self._credential = Credential(secret)
        self._retry = retry
        self._events = events
        self._me = me
        self._new_request_id = new_request_id

    def __repr__(self) -> str:
        # Never raises, on a half-built `self` either: see `BrokerClient.__repr__`.
        endpoint: Endpoint | None = getattr(self, "_endpoint", None)
        where = repr(endpoint.describe()) if endpoint is not None else "<not constructed>"
        return f"AsyncBrokerClient({where}, credential=<redacted>)"

    # ----- the generic door

    def freeze(self, action: str, args: Mapping[str, object], request_id: str | None = None) -> Request:
        """Validate and normalize a request without sending it (no I/O).

        The same contract code the host runs builds the request: identities canonical,
        scalars trimmed, absent members omitted. `send` serializes it once.

        Args:
            action: the wire name, e.g. `"message.post"`.
            args: the argument object with its wire names (`{"channelId": …}`).
            request_id: the idempotency key; default a fresh one from `new_request_id`.

        Returns:
            The frozen `Request` (`request_id`, `action`, `args`).

        Raises:
            ContractError: unknown action (reserved names included) or bad arguments.
        """
        return build_request(
            action, args, request_id=request_id if request_id is not None else self._new_request_id()
        )

    async def call(
        self, action: str, args: Mapping[str, object], request_id: str | None = None
    ) -> Answer[Any]:
        """Any of the fifteen actions by wire name, with wire-named arguments.

        `freeze`, then `send`: what `buzz-broker call` does. The typed methods below are
        the same with Python names.

        Args:
            action: the wire name, e.g. `"channel.read"`.
            args: the argument object with its wire names.
            request_id: the idempotency key; default a fresh one.

        Returns:
            An `Answer` whose `Succeeded.outcome` has that action's outcome type.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        request = self.freeze(action, args, request_id)
        return await self.send(request)

    async def send(self, request: Request, *, prior: FateUnknown | None = None) -> Answer[Any]:
        """Send a frozen request (for example one kept from an earlier `FateUnknown`).

        The request is serialized once here; every attempt sends those bytes under its
        request id, so re-sending `answer.request` after a `FateUnknown` can never do the
        thing twice: the host replays its record (`Succeeded.replayed`).

        Re-sending after a `FateUnknown`, pass it as `prior`:
        `await client.send(answer.request, prior=answer)`. The call then starts from that
        uncertainty, as its own retries do after a lost attempt (NIP-BA: "A refusal of a
        retry does not undo or disprove earlier execution"): a refusal the host does not
        replay from its record (`unauthorized`, `request_id_conflict`, `action_failed`,
        a refused credential, ...) answers a `FateUnknown` again, never `Failed`, and no
        `SetupError` is raised. Without `prior`, such a refusal is `Failed`, true only of
        this send.

        Args:
            request: a `Request` from `freeze`, or `FateUnknown.request`.
            prior: the `FateUnknown` an earlier call of this same request answered, whose
                uncertainty this call must keep; None for a request not sent before.

        Returns:
            An `Answer` for `request.action`. With `prior`: `Succeeded`, a `Failed` or
            `Unsupported` the host replayed from its record, or a `FateUnknown` (`attempts`
            counting this call's).

        Raises:
            ValueError: `prior` is the answer of another request (another id, action or
                bytes).
            SetupError: the broker cannot be used at all and nothing happened (as for
                every operation method; `CredentialRefused` included); never with `prior`.
        """
        if prior is not None and (prior.request_id != request.request_id
                                  or encode_request(prior.request) != encode_request(request)):
            raise ValueError("prior is the answer of another request: pass the FateUnknown "
                             "whose .request is being sent")
        return await self._send(request, ACTIONS[request.action].outcome_type, prior)

    async def _send(
        self, request: Request, outcome_type: type[O], prior: FateUnknown | None = None
    ) -> Answer[O]:
        """Every operation's one path: serialize once, retry, answer (points 1-4).

        A cancellation from the caller (an outer timeout, a cancel scope, a cancelled
        task) goes through unchanged; once an attempt may have reached the host, one
        warning first names the request whose fate it leaves unknown.
        """
        body = encode_request(request)  # the one serialization (I3)
        # True once an attempt's connect succeeded (or an earlier call sent the request):
        # from then on a cancellation by the caller leaves the request's fate unknown.
        reached = prior is not None

        def connected() -> None:
            nonlocal reached
            reached = True

        try:
            return await self._attempts(request, body, outcome_type, prior, connected)
        except anyio.get_cancelled_exc_class():
            if reached:
                # The caller's cancellation is theirs to see, unchanged; what it cost them
                # (this request id, with no answer to hand back) is only said here.
                _log.warning(
                    "call cancelled by the caller after an attempt may have reached the "
                    "host, fate unknown: request_id=%s action=%s",
                    request.request_id, request.action,
                )
            raise

    async def _attempts(
        self, request: Request, body: bytes, outcome_type: type[O], prior: FateUnknown | None,
        connected: Callable[[], None],
    ) -> Answer[O]:
        """`_send`'s retry loop (point 4 of the module docstring)."""
        policy = self._retry
        deadline = anyio.current_time() + policy.total_seconds
        delay = policy.first_delay
        attempt = 0
        # Stays True while every attempt failed before a byte left (connect refused,
        # missing, forbidden) and no earlier call sent the request: only then is a setup
        # error the truth about this call.
        nothing_sent = prior is None
        # The latest fate-unknown answer, kept once an attempt may have reached the host
        # (or an earlier call's, `prior`): what this call must answer if a later attempt
        # is refused without a word on the request's fate (`_fate_blind`).
        unknown: FateUnknown | None = prior
        while True:
            attempt += 1
            answer, replayed, turned = await self._attempt(
                request, body, outcome_type, attempt, deadline, connected)
            nothing_sent = nothing_sent and turned in SETUP_PROBLEMS
            if unknown is not None and _fate_blind(answer, replayed):
                assert isinstance(answer, (Failed, Unsupported))
                code = answer.code if isinstance(answer, Failed) else ErrorCode.UNSUPPORTED
                if code in _FINAL_REFUSALS:
                    # An earlier attempt may have done it; this refusal only says this
                    # attempt did nothing (the credential or its permission lost since, or
                    # these bytes conflict with the record). Retrying cannot change it.
                    _log.warning(
                        "retry refused after an attempt that may have reached the host, "
                        "fate unknown: request_id=%s action=%s attempts=%d code=%s",
                        request.request_id, request.action, attempt, code.value,
                    )
                    return _as_answer(replace(unknown, attempts=attempt))
                # Said nothing about the earlier attempts: retried like the fate-unknown
                # answer it stands behind.
                answer = _as_answer(replace(unknown, attempts=attempt))
            if isinstance(answer, Failed) and answer.code is ErrorCode.UNAUTHENTICATED:
                raise CredentialRefused(answer)
            if not isinstance(answer, FateUnknown):
                return answer
            if turned is not None and turned in SETUP_PROBLEMS and not SETUP_PROBLEMS[turned].retried:
                # Retrying cannot grant a permission or change a listener's rule: raised
                # now, or, once an earlier attempt may have reached the host, its fate.
                if nothing_sent:
                    raise self._setup_error(turned)
                assert unknown is not None  # set by the attempt that may have reached it
                _log.warning(
                    "retry turned away after an attempt that may have reached the host, "
                    "fate unknown: request_id=%s action=%s attempts=%d by=%s",
                    request.request_id, request.action, attempt, turned,
                )
                return _as_answer(replace(unknown, attempts=attempt))
            if not nothing_sent:
                unknown = answer
            reason = answer.reason.value if isinstance(answer, NoAnswer) else "indeterminate"
            if attempt >= policy.max_attempts or anyio.current_time() + delay >= deadline:
                if nothing_sent and turned is not None:
                    _log.warning(
                        "broker unreachable, nothing sent: request_id=%s action=%s attempts=%d connect=%s",
                        request.request_id, request.action, attempt, turned,
                    )
                    raise self._setup_error(turned)
                _log.warning(
                    "fate unknown after retries: request_id=%s action=%s attempts=%d reason=%s",
                    request.request_id, request.action, attempt, reason,
                )
                return answer
            _log.info(
                "retrying identical bytes: request_id=%s action=%s attempt=%d reason=%s",
                request.request_id, request.action, attempt, reason,
            )
            await anyio.sleep(delay)
            delay = min(delay * policy.multiplier, policy.max_delay)

    def _setup_error(self, turned: str) -> SetupError:
        where = self._endpoint.describe()
        if turned == "permission":
            # Which fix helps depends on what refused: the socket, or a directory above it
            # that no group of the socket's opens. Only this error looks at the path.
            return SocketPermissionDenied(where, closed_directory(self._endpoint))
        return SETUP_PROBLEMS[turned].error(where)

    async def _attempt(
        self, request: Request, body: bytes, outcome_type: type[O], attempt: int, deadline: float,
        connected: Callable[[], None],
    ) -> tuple[Answer[O], bool, str | None]:
        """One attempt: its answer, whether the host said `replayed`, and how it was turned
        away before the host acted on it, when it was (a key of `SETUP_PROBLEMS`: how its
        connect failed, or a loopback TCP listener's refusal line; None otherwise).

        The attempt's deadline covers judging too. A large body is judged on a worker
        thread, so parsing it and verifying its events never holds the caller's event
        loop; past the deadline the attempt is no answer and the thread is abandoned
        (its work is bounded by `_bounds`).
        """
        budget = min(self._retry.attempt_seconds, max(deadline - anyio.current_time(), 0.0))
        reply: HttpReply | None = None
        detail = "timed out"
        connect: ConnectKind | None = None
        judged: tuple[Answer[O], bool] | None = None
        with anyio.move_on_after(budget):
            try:
                reply = await exchange(self._endpoint, self._credential, body,
                                       max_body=response_bytes(request), connected=connected)
            except ConnectFailure as exc:
                detail, connect = exc.detail, exc.kind
            except TransportFailure as exc:
                detail = exc.detail
            if reply is not None:
                got = reply

                def work() -> tuple[Answer[O], bool]:
                    return _judge(request, got, outcome_type, attempt=attempt,
                                  verification=self._events, me=self._me)

                detail = "timed out checking the response"
                if len(reply.body) <= _JUDGE_INLINE_BYTES:
                    judged = work()
                else:
                    judged = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        if judged is None:
            return _no_answer(request, attempt, NoAnswerReason.TRANSPORT, detail), False, connect
        assert reply is not None  # judged
        return judged[0], judged[1], _listener_refusal(reply)

    # ----- one method per operation (spec §Operations; wire names in the mapping)

    async def channel_read(
        self,
        channel_id: str,
        *,
        root_event_id: str | None = None,
        mentions_only: bool = False,
        cursor: str | None = None,
        limit: int | None = None,
        request_id: str | None = None,
    ) -> Answer[ReadOutcome]:
        """One page of a channel, a thread or this agent's mentions (`channel.read`).

        Sends `channelId`, and `rootEventId`, `mentionsOnly`, `cursor`, `limit` when
        given. The host answers newest first; every event is verified (id, signature, in
        the channel, in the thread, mentioning this agent) unless `events=SKIP`.

        Args:
            channel_id: the channel (a UUID; any spelling NIP-BA accepts).
            root_event_id: narrow to the thread under this event id (64 hex).
            mentions_only: only events that mention this agent (its wake path).
            cursor: `next_cursor` of an earlier page, verbatim; never built or parsed.
            limit: events per page, 1-500; the host's default (100) when omitted.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[ReadOutcome]`: `outcome.messages` (a tuple of `Event`, at most
            `limit`) and `outcome.next_cursor` (None on the last page); or `Failed`,
            `Indeterminate` or `NoAnswer` (`UNVERIFIED_EVENT` for a page with a forged
            event).

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(
            channelId=channel_id, rootEventId=root_event_id, mentionsOnly=mentions_only,
            cursor=cursor, limit=limit,
        )
        return await self._send(self.freeze("channel.read", args, request_id), ReadOutcome)

    async def read_all(
        self,
        channel_id: str,
        *,
        root_event_id: str | None = None,
        mentions_only: bool = False,
        cursor: str | None = None,
        limit: int | None = None,
        max_pages: int = 100,
        stop_when: Callable[[Event], bool] | None = None,
    ) -> ReadAll:
        """Follow nextCursor until it is absent (or `stop_when`, or `max_pages`).

        Each page is its own `channel.read` request with its own request id; cursors go
        back verbatim and are never compared or built here.

        Args:
            channel_id: as for `channel_read`.
            root_event_id: as for `channel_read`.
            mentions_only: as for `channel_read`.
            cursor: where to start: a cursor an earlier walk left (`resume_cursor`).
            limit: events per page, as for `channel_read`.
            max_pages: stop after this many pages (at least 1).
            stop_when: called on each event in order; True stops the walk before that
                event (a wake loop's "already seen").

        Returns:
            `ReadAll`: `messages` (every page's events, host order), `end` (`ReadEnd`:
            why it stopped), `pages`, `resume_cursor` (where to continue after
            `MAX_PAGES` or `NOT_SUCCEEDED`) and `last` (the last page's answer).

        Raises:
            ContractError: bad arguments; nothing was sent.
            ValueError: max_pages < 1.
            SetupError: as for `channel_read`.
        """
        if max_pages < 1:
            raise ValueError("max_pages must be at least 1")
        collected: list[Event] = []
        pages = 0

        def ended(end: ReadEnd, resume_cursor: str | None, last: Answer[ReadOutcome]) -> ReadAll:
            return ReadAll(messages=tuple(collected), end=end, pages=pages,
                           resume_cursor=resume_cursor, last=last)

        while True:
            answer = await self.channel_read(
                channel_id, root_event_id=root_event_id, mentions_only=mentions_only,
                cursor=cursor, limit=limit,
            )
            if not isinstance(answer, Succeeded):
                return ended(ReadEnd.NOT_SUCCEEDED, cursor, answer)
            pages += 1
            for event in answer.outcome.messages:
                if stop_when is not None and stop_when(event):
                    return ended(ReadEnd.STOPPED, None, answer)
                collected.append(event)
            cursor = answer.outcome.next_cursor
            if cursor is None:
                return ended(ReadEnd.EXHAUSTED, None, answer)
            if pages >= max_pages:
                return ended(ReadEnd.MAX_PAGES, cursor, answer)

    async def message_post(
        self, channel_id: str, content: str, *, mentions: Sequence[str] = (),
        request_id: str | None = None,
    ) -> Answer[PublishOutcome]:
        """Post a top-level message (`message.post`: a kind 9 event in the channel).

        Args:
            channel_id: the channel (a UUID).
            content: the text, published exactly as written (not trimmed); at most
                65,536 UTF-8 bytes, at least one non-whitespace character.
            mentions: pubkeys (64 hex) to notify with `p` tags, at most 50; none by
                default (the member is then omitted).
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[PublishOutcome]` (`outcome.event_id`, `outcome.kind`,
            `outcome.created_at`: the event the host signed and the relay accepted), or
            `Failed`, `Indeterminate` or `NoAnswer` (see `Answer`).

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(channelId=channel_id, content=content, mentions=tuple(mentions))
        return await self._send(self.freeze("message.post", args, request_id), PublishOutcome)

    async def message_reply(
        self, channel_id: str, reply_to_event_id: str, content: str, *,
        mentions: Sequence[str] = (), request_id: str | None = None,
    ) -> Answer[PublishOutcome]:
        """Reply to an event (`message.reply`: kind 9 with NIP-10 root and reply tags).

        The host fetches the parent in the channel and derives the thread root from its
        signed tags; a parent it cannot find there is `Failed`, nothing posted.

        Args:
            channel_id: the channel (a UUID).
            reply_to_event_id: the event replied to (64 hex).
            content: as for `message_post`.
            mentions: as for `message_post`.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[PublishOutcome]` (`outcome.event_id`, `outcome.kind`,
            `outcome.created_at`: the event the host signed and the relay accepted), or
            `Failed`, `Indeterminate` or `NoAnswer` (see `Answer`).

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(channelId=channel_id, replyToEventId=reply_to_event_id, content=content,
                     mentions=tuple(mentions))
        return await self._send(self.freeze("message.reply", args, request_id), PublishOutcome)

    async def reaction_add(
        self, channel_id: str, target_event_id: str, reaction: str, *,
        request_id: str | None = None,
    ) -> Answer[PublishOutcome]:
        """React to an event (`reaction.add`: kind 7). Best-effort.

        Args:
            channel_id: the channel the target is in (a UUID).
            target_event_id: the event reacted to (64 hex).
            reaction: the reaction text (e.g. an emoji), trimmed, at most 66 characters.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[PublishOutcome]` (`event_id`, `kind`, `created_at`), `Unsupported`
            (the host does not offer it: carry on), or `Failed`, `Indeterminate` or
            `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(channelId=channel_id, targetEventId=target_event_id, reaction=reaction)
        return await self._send(self.freeze("reaction.add", args, request_id), PublishOutcome)

    async def profile_set(
        self, *, display_name: str | None = None, about: str | None = None,
        picture: str | None = None, request_id: str | None = None,
    ) -> Answer[PublishOutcome]:
        """Set this agent's own profile (`profile.set`: kind 0). At least one member.

        Only the members given are sent; the host merges them into the current profile,
        so members left out are left as they are (an empty value is refused, never a
        "clear").

        Args:
            display_name: at most 120 characters.
            about: at most 2,000 characters.
            picture: a URL, at most 300 characters.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[PublishOutcome]` (`outcome.event_id`, `outcome.kind`,
            `outcome.created_at`: the event the host signed and the relay accepted), or
            `Failed`, `Indeterminate` or `NoAnswer` (see `Answer`).

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(displayName=display_name, about=about, picture=picture)
        return await self._send(self.freeze("profile.set", args, request_id), PublishOutcome)

    async def storage_address(
        self, slug: str, *, request_id: str | None = None
    ) -> Answer[StorageAddressOutcome]:
        """Where one encrypted-memory record lives on the relay (`storage.address`).

        Buzz's runtime calls it with `core` at start to learn its own pubkey.

        Args:
            slug: `core`, or `mem/` and lowercase path segments (`mem/notes/today`).
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[StorageAddressOutcome]` (`outcome.author_pubkey`, this agent's
            pubkey; `outcome.kind`, 30174; `outcome.d_tag`, NIP-AE's blinded d-tag), or
            `Failed`, `Indeterminate` or `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(slug=slug)
        return await self._send(self.freeze("storage.address", args, request_id), StorageAddressOutcome)

    async def presence_set(
        self, status: str, *, request_id: str | None = None
    ) -> Answer[PublishOutcome]:
        """Signal this agent's presence (`presence.set`: kind 20001). Best-effort.

        Each call is a new signal with a fresh request id; a replay never renews it.

        Args:
            status: `online`, `away` or `offline`.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[PublishOutcome]` (`event_id`, `kind`, `created_at`), `Unsupported`
            (the host does not offer it: carry on), or `Failed`, `Indeterminate` or
            `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(status=status)
        return await self._send(self.freeze("presence.set", args, request_id), PublishOutcome)

    async def typing_set(
        self, channel_id: str, *, request_id: str | None = None
    ) -> Answer[PublishOutcome]:
        """Signal "typing in this channel" (`typing.set`: kind 20002). Best-effort.

        Renewed by calling again; there is no stop.

        Args:
            channel_id: the channel (a UUID).
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[PublishOutcome]` (`event_id`, `kind`, `created_at`), `Unsupported`
            (the host does not offer it: carry on), or `Failed`, `Indeterminate` or
            `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(channelId=channel_id)
        return await self._send(self.freeze("typing.set", args, request_id), PublishOutcome)

    async def storage_get(
        self, slug: str, *, request_id: str | None = None
    ) -> Answer[StorageGetOutcome]:
        """Read one encrypted-memory record (`storage.get`), decrypted by the host.

        Not best-effort: a failure is a failure.

        Args:
            slug: as for `storage_address`.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[StorageGetOutcome]`: `outcome.value`, the record's text, or None
            when there is no record (or a tombstone); or `Failed`, `Indeterminate` or
            `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(slug=slug)
        return await self._send(self.freeze("storage.get", args, request_id), StorageGetOutcome)

    async def storage_put(
        self, slug: str, value: str, *, request_id: str | None = None
    ) -> Answer[PublishOutcome]:
        """Replace one encrypted-memory record (`storage.put`: kind 30174, NIP-44 to the owner).

        Args:
            slug: as for `storage_address` (`core` holds the profile text).
            value: stored exactly as written (not trimmed), at least one non-whitespace
                character; the record body at most 65,535 bytes.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[PublishOutcome]` (`outcome.event_id`, `outcome.kind`,
            `outcome.created_at`: the event the host signed and the relay accepted), or
            `Failed`, `Indeterminate` or `NoAnswer` (see `Answer`).

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(slug=slug, value=value)
        return await self._send(self.freeze("storage.put", args, request_id), PublishOutcome)

    async def observer_emit(
        self, frames: Sequence[tuple[str, str]], *, request_id: str | None = None,
    ) -> Answer[ObserverEmitOutcome]:
        """Hand telemetry frames to the host for the owner (`observer.emit`). Best-effort.

        The host publishes them as NIP-AO kind 24200 events encrypted to the owner.

        Args:
            frames: 1-256 `(kind, payload)` pairs: `kind` the runtime's discriminator
                (a trimmed scalar), `payload` opaque text kept byte for byte; at most
                65,535 bytes in all.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[ObserverEmitOutcome]`: `outcome.accepted`, how many frames the
            host took in for publication (not what reached the relay, nor which: do not
            resubmit a guessed remainder); `Unsupported` (carry on); or `Failed`,
            `Indeterminate` or `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(frames=tuple({"kind": kind, "payload": payload} for kind, payload in frames))
        return await self._send(self.freeze("observer.emit", args, request_id), ObserverEmitOutcome)

    async def liveness_ping(
        self, channel_id: str, turn_id: str, *, request_id: str | None = None,
    ) -> Answer[PublishOutcome]:
        """A keepalive for the runtime's turn in a channel (`liveness.ping`). Best-effort.

        This host answers `Unsupported` (docs/protocol.md, "liveness.ping"); carry on.

        Args:
            channel_id: the channel of the turn (a UUID).
            turn_id: the runtime's own turn id (a trimmed scalar, at most 300 characters).
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[PublishOutcome]` (`event_id`, `kind`, `created_at`), `Unsupported`
            (the host does not offer it: carry on), or `Failed`, `Indeterminate` or
            `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(channelId=channel_id, turnId=turn_id)
        return await self._send(self.freeze("liveness.ping", args, request_id), PublishOutcome)

    async def agents_create(
        self, channel_id: str, display_name: str, system_prompt: str, *,
        runtime: str | None = None, provider: str | None = None, model: str | None = None,
        respond_to: str | None = None, request_id: str | None = None,
    ) -> Answer[AgentsCreateOutcome]:
        """Mint a managed agent owned by this agent (`agents.create`).

        The host mints the key in custody; the outcome is public identity only.

        Args:
            channel_id: the channel the new agent joins (a UUID).
            display_name: its name, at most 120 characters.
            system_prompt: its instructions, at most 20,000 characters.
            runtime: the runtime to run it on (a scalar, at most 300 characters).
            provider: the model provider (likewise).
            model: the model (likewise).
            respond_to: `owner-only` or `anyone`.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[AgentsCreateOutcome]` (`outcome.agent_pubkey`,
            `outcome.display_name`, `outcome.channel_id`, checked against the channel
            asked for), or `Failed`, `Indeterminate` or `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(channelId=channel_id, displayName=display_name, systemPrompt=system_prompt,
                     runtime=runtime, provider=provider, model=model, respondTo=respond_to)
        return await self._send(self.freeze("agents.create", args, request_id), AgentsCreateOutcome)

    async def agents_update(
        self, *, target_pubkey: str | None = None, target_name: str | None = None,
        display_name: str | None = None, system_prompt: str | None = None,
        runtime: str | None = None, provider: str | None = None, model: str | None = None,
        respond_to: str | None = None, request_id: str | None = None,
    ) -> Answer[AgentsUpdateOutcome]:
        """Patch an agent this agent owns (`agents.update`); members left out are kept.

        Args:
            target_pubkey: the agent by pubkey (64 hex); exactly one of the two targets.
            target_name: the agent by display name; exactly one of the two targets.
            display_name: as for `agents_create`.
            system_prompt: as for `agents_create`.
            runtime: as for `agents_create`.
            provider: as for `agents_create`.
            model: as for `agents_create`.
            respond_to: as for `agents_create`.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[AgentsUpdateOutcome]` (`outcome.agent_pubkey`, checked against
            `target_pubkey` when given; `outcome.display_name`; `outcome.updated_fields`,
            the wire names changed, possibly none), or `Failed`, `Indeterminate` or
            `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(target=_target(target_pubkey, target_name), displayName=display_name,
                     systemPrompt=system_prompt, runtime=runtime, provider=provider,
                     model=model, respondTo=respond_to)
        return await self._send(self.freeze("agents.update", args, request_id), AgentsUpdateOutcome)

    async def agents_delete(
        self, *, target_pubkey: str | None = None, target_name: str | None = None,
        request_id: str | None = None,
    ) -> Answer[AgentsDeleteOutcome]:
        """Remove an agent this agent owns (`agents.delete`); its key is destroyed.

        Args:
            target_pubkey: the agent by pubkey (64 hex); exactly one of the two targets.
            target_name: the agent by display name; exactly one of the two targets.
            request_id: the idempotency key to send; default a fresh UUIDv4. Pass the
                one of an earlier attempt only to retry that same request.

        Returns:
            `Succeeded[AgentsDeleteOutcome]` (`outcome.agent_pubkey`, checked against
            `target_pubkey` when given; `outcome.display_name`), or `Failed`,
            `Indeterminate` or `NoAnswer`.

        Raises:
            ContractError: the arguments break the contract (the host would answer
                `invalid_request`); nothing was sent.
            SetupError: the broker cannot be used at all and nothing happened:
                `SocketMissing` or `NothingListening` (on every attempt),
                `SocketPermissionDenied`, or `CredentialRefused` (`unauthenticated`).
        """
        args = _wire(target=_target(target_pubkey, target_name))
        return await self._send(self.freeze("agents.delete", args, request_id), AgentsDeleteOutcome)
