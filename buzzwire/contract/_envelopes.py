"""Request and response envelopes (spec §Request, §Results), for both sides of the wire.

Order of judgement in `read_request` (the first rule that fires decides; every later
fault is ignored):

  1. syntax: not UTF-8, not JSON, trailing bytes, NaN, nesting > MAX_NESTING
     -> uncorrelated (request_id None), invalid_request
  2. the top level is not an object -> uncorrelated
  3. requestId missing, repeated, null, not a string, or not 1-128 bytes of 0x21-0x7E
     -> uncorrelated (spec: "the one envelope error a host cannot answer")
  -- from here on the reading is correlated --
  4. strictness anywhere (null, repeated key, non-integer number, integer beyond 64 bits,
     lone surrogate), first in document order                     -> invalid_request
  5. `type` missing or not "broker_request"                         -> invalid_request
  6. `protocolVersion` missing / not a u16 integer -> invalid_request; a u16 != 1
     -> unsupported_protocol_version (checked before the member set, so a future envelope
     with other members is told about the version, not about its members)
  7. envelope members: unknown member (document order), then missing -> invalid_request
  8. `action` not a string -> invalid_request; not in ACTIONS -> unknown_action
     (reserved names sign/publish/encrypt/decrypt/auth never resolve)
  9. `actionVersion` not a u16 integer -> invalid_request; != 1 -> unsupported_action_version
 10. `args` strict per action (see _shapes for the order inside an object) -> invalid_request

The agent's message for an `invalid_request` names the pointer and the rule
(`ContractError.message`); `read_request` writes that pointer with `shown_pointer`, so a
member name the client chose appears by position only.

Responses: `encode_response` writes canonical compact bytes (members in spec order,
`ensure_ascii=False`, optional members omitted); `mark_replayed` appends
`"replayed":true` to stored bytes; `parse_response` is the client's strict reader and
raises `ContractError` (always invalid_request: to a client every malformed response is
"no answer", spec I5).

WARNING: the member lists `REQUEST_MEMBERS`, `_SUCCEEDED_MEMBERS`, `_ERROR_MEMBERS` are
spec text; keep them in step with the encoders below.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from buzzwire import kinds

from ._args import (
    AgentsCreateArgs, AgentsDeleteArgs, AgentsUpdateArgs, AgentTarget, ChannelReadArgs,
    LivenessPingArgs, MessagePostArgs, MessageReplyArgs, ObserverEmitArgs, PresenceSetArgs,
    ProfileSetArgs, ReactionAddArgs, StorageAddressArgs, StorageGetArgs, StoragePutArgs,
    TypingSetArgs,
)
from ._codes import MESSAGES, PAIRING, ContractError, ErrorCode, Status
from ._echoes import REQUESTER, Echo, Identity, Membership
from ._ids import any_string, fault, is_request_id
from ._json import JsonSyntaxError, escape_token, is_object, parse, repeated_keys
from ._rules import Rule
from ._limits import ACTION_VERSION, MAX_U16, PROTOCOL_VERSION
from ._outcomes import (
    AgentsCreateOutcome, AgentsDeleteOutcome, AgentsUpdateOutcome, ObserverEmitOutcome, Outcome,
    PublishOutcome, ReadOutcome, StorageAddressOutcome, StorageGetOutcome,
)
from ._shapes import SHAPES, read_object, shape_for, to_wire

__all__ = [
    "MemberSet", "ActionSpec", "RateClass", "ACTIONS", "REQUEST_MEMBERS", "RESERVED_NAMES",
    "Request", "Reading", "read_request",
    "build_request", "encode_request", "Verdict", "encode_response", "mark_replayed", "Response",
    "parse_response", "Args", "shown_pointer",
]

Args = (
    ChannelReadArgs | MessagePostArgs | MessageReplyArgs | ReactionAddArgs | ProfileSetArgs
    | StorageAddressArgs | AgentsCreateArgs | AgentsUpdateArgs | AgentsDeleteArgs
    | PresenceSetArgs | TypingSetArgs | StorageGetArgs | StoragePutArgs | ObserverEmitArgs
    | LivenessPingArgs
)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberSet:
    """The exact wire member names of one strict object."""

    required: frozenset[str]
    optional: frozenset[str]

    def __post_init__(self) -> None:
        if self.required & self.optional:
            raise ValueError("a member cannot be both required and optional")

    @property
    def all(self) -> frozenset[str]:
        return self.required | self.optional


def _members(cls: type) -> MemberSet:
    fields = SHAPES[cls].fields
    return MemberSet(
        required=frozenset(f.wire for f in fields if f.required),
        optional=frozenset(f.wire for f in fields if not f.required),
    )


class RateClass(enum.Enum):
    """The class rate scope an action is counted under besides its own name (config [limits])."""

    PUBLISH = "publish"
    READ = "read"
    #: NIP-BA's live signals (presence, typing): effects on the relay, but counted apart so
    #: a runtime's renewals cannot use up the `publish` allowance its messages need.
    LIVE = "live"


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionSpec:
    """Every fixed fact of one action. Every other table (config, policy, the operations'
    dispatch, the rate limiter's classes, the client's echo checks, the log's member names,
    the tests) derives from `ACTIONS`, so a fact is written once.
    """

    #: the wire name
    name: str
    args_type: type[Args]
    outcome_type: type[Outcome]
    arg_members: MemberSet
    outcome_members: MemberSet
    #: has side effects on the relay (prepare/Plan path) rather than being a read
    publishing: bool
    #: spec: a host may answer `unsupported` and the agent carries on (reaction.add only)
    best_effort: bool
    #: counted under its own name and this class by the rate limiter
    rate_class: RateClass
    #: the identities a succeeded outcome must echo from the request (I5)
    echoes: tuple[Echo, ...]
    #: member names of nested argument objects (`target`'s)
    nested_arg_members: frozenset[str] = frozenset()
    #: the Nostr kind a Published outcome must report (NIP-BA: a client checks the kind per
    #: action); None where the outcome is not Published
    published_kind: int | None = None

    def __post_init__(self) -> None:
        if (self.rate_class is not RateClass.READ) != self.publishing:
            raise AssertionError(f"{self.name}: rate class and publishing disagree")
        if self.published_kind is not None and "kind" not in self.outcome_members.required:
            raise AssertionError(f"{self.name}: a published kind needs a Published outcome")
        for echo in self.echoes:
            root = echo.outcome.split("[", 1)[0]
            if root not in self.outcome_members.all:
                raise AssertionError(f"{self.name}: echo of unknown outcome member {root}")
            if echo.source != REQUESTER and echo.source.split(".", 1)[0] not in self.arg_members.all:
                raise AssertionError(f"{self.name}: echo of unknown argument {echo.source}")

    @property
    def channel_scoped(self) -> bool:
        """Its arguments name a channel, which a credential's channels must include."""
        return "channelId" in self.arg_members.all

    @property
    def takes_runtime(self) -> bool:
        """Its arguments may name a runtime, which the host must offer."""
        return "runtime" in self.arg_members.all

    @property
    def targets_agent(self) -> bool:
        """It acts on an existing agent named by `target`, which the requester must own."""
        return "target" in self.arg_members.all

    @property
    def member_names(self) -> frozenset[str]:
        """Every member name its arguments may carry, nested ones included."""
        return self.arg_members.all | self.nested_arg_members


_PUBLISHED: tuple[Echo, ...] = ()  # eventId, kind, createdAt are the host's: nothing echoed
_TARGET_ECHO = (Echo(outcome="agentPubkey", source="target.pubkey", identity=Identity.HEX),)


def _spec(name: str, args: type[Args], outcome: type[Outcome], *, publishing: bool,
          echoes: tuple[Echo, ...], best_effort: bool = False,
          rate_class: RateClass | None = None, kind: int | None = None) -> ActionSpec:
    arg_members = _members(args)
    if rate_class is None:
        rate_class = RateClass.PUBLISH if publishing else RateClass.READ
    return ActionSpec(
        name=name, args_type=args, outcome_type=outcome, arg_members=arg_members,
        outcome_members=_members(outcome), publishing=publishing, best_effort=best_effort,
        rate_class=rate_class, echoes=echoes, published_kind=kind,
        nested_arg_members=_members(AgentTarget).all if "target" in arg_members.all else frozenset(),
    )


# spec §Operations (the nine) and NIP-BA (the actions after them): the closed set. The
# member sets come from the shape tables.
ACTIONS: Mapping[str, ActionSpec] = MappingProxyType({
    s.name: s for s in (
        _spec("channel.read", ChannelReadArgs, ReadOutcome, publishing=False, echoes=(
            # The host reads with `#h`, `#e` and `#p` (buzz-on-the-relay.md channel.read),
            # then keeps only the events in the channel and the thread by the rules of
            # buzzwire.threads: every returned event is in them by its signed tags, not
            # merely tagged with them (a mention of the root is not in its thread).
            Echo(outcome="messages[].h", source="channelId", identity=Identity.CHANNEL,
                 membership=Membership.CHANNEL),
            Echo(outcome="messages[].e", source="rootEventId", identity=Identity.HEX,
                 membership=Membership.THREAD),
            Echo(outcome="messages[].p", source=REQUESTER, identity=Identity.HEX,
                 when="mentionsOnly"),
        )),
        _spec("message.post", MessagePostArgs, PublishOutcome, publishing=True, echoes=_PUBLISHED,
              kind=kinds.STREAM_MESSAGE),
        _spec("message.reply", MessageReplyArgs, PublishOutcome, publishing=True,
              echoes=_PUBLISHED, kind=kinds.STREAM_MESSAGE),
        _spec("reaction.add", ReactionAddArgs, PublishOutcome, publishing=True, best_effort=True,
              echoes=_PUBLISHED, kind=kinds.REACTION),
        _spec("profile.set", ProfileSetArgs, PublishOutcome, publishing=True, echoes=_PUBLISHED,
              kind=kinds.METADATA),
        _spec("storage.address", StorageAddressArgs, StorageAddressOutcome, publishing=False,
              echoes=(Echo(outcome="authorPubkey", source=REQUESTER, identity=Identity.HEX),)),
        # NIP-BA Memory: NIP-AE records (kind 30174) the host reads and writes encrypted.
        _spec("storage.get", StorageGetArgs, StorageGetOutcome, publishing=False, echoes=()),
        _spec("storage.put", StoragePutArgs, PublishOutcome, publishing=True, echoes=_PUBLISHED,
              kind=kinds.MEMORY),
        _spec("agents.create", AgentsCreateArgs, AgentsCreateOutcome, publishing=True, echoes=(
            Echo(outcome="channelId", source="channelId", identity=Identity.CHANNEL),)),
        _spec("agents.update", AgentsUpdateArgs, AgentsUpdateOutcome, publishing=True,
              echoes=_TARGET_ECHO),
        _spec("agents.delete", AgentsDeleteArgs, AgentsDeleteOutcome, publishing=True,
              echoes=_TARGET_ECHO),
        # NIP-BA "Live signals": best effort, and their own rate class.
        _spec("presence.set", PresenceSetArgs, PublishOutcome, publishing=True, best_effort=True,
              rate_class=RateClass.LIVE, echoes=_PUBLISHED, kind=kinds.PRESENCE),
        _spec("typing.set", TypingSetArgs, PublishOutcome, publishing=True, best_effort=True,
              rate_class=RateClass.LIVE, echoes=_PUBLISHED, kind=kinds.TYPING),
        # observer.emit's effect is intake into the host's publication queue
        # (daemon/pipeline/observer.py), so it is an effect, but its outcome is a count the
        # client bounds by the frames sent, not an identity.
        _spec("observer.emit", ObserverEmitArgs, ObserverEmitOutcome, publishing=True,
              best_effort=True, rate_class=RateClass.LIVE, echoes=()),
        # NIP-BA: a keepalive is published as NIP-AO telemetry, kind 24200 (this host
        # answers unsupported: daemon/operations/liveness_ping.py).
        _spec("liveness.ping", LivenessPingArgs, PublishOutcome, publishing=True,
              best_effort=True, rate_class=RateClass.LIVE, echoes=_PUBLISHED, kind=kinds.OBSERVER_FRAME),
    )
})

# spec §Operations "Reserved against": these names never resolve (a test pins it).
RESERVED_NAMES: frozenset[str] = frozenset({"sign", "publish", "encrypt", "decrypt", "auth"})
if RESERVED_NAMES & ACTIONS.keys():  # pragma: no cover - a table edit gone wrong
    raise AssertionError("a reserved name became an action")

#: spec §Request: the envelope's six members, in the order a request is written.
REQUEST_MEMBERS = ("type", "protocolVersion", "requestId", "actionVersion", "action", "args")
_SUCCEEDED_MEMBERS = frozenset({"type", "protocolVersion", "requestId", "status", "action", "outcome"})
_ERROR_MEMBERS = frozenset({"type", "protocolVersion", "requestId", "status", "error"})
_REPLAYED = "replayed"


def _dumps(obj: object) -> bytes:
    # Canonical form: compact, no ASCII escaping (as NIP-01 ids are computed), no NaN.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """A valid request, frozen: the value operations consume."""

    request_id: str
    action: str
    action_version: int
    args: Args

    def __post_init__(self) -> None:
        if not is_request_id(self.request_id):
            raise ValueError("Request.request_id is not a usable requestId")
        spec = ACTIONS.get(self.action)
        if spec is None:
            raise ValueError("Request.action is not a known action")
        if self.action_version != ACTION_VERSION or type(self.action_version) is not int:
            raise ValueError("Request.action_version is not supported")
        if type(self.args) is not spec.args_type:
            raise ValueError("Request.args does not match the action")


@dataclass(frozen=True, slots=True, kw_only=True)
class Reading:
    """What one body said. Exactly one of `request` / `error` is set.

    `request_id` None means the body cannot be correlated (HTTP 400, no envelope).
    """

    request_id: str | None
    request: Request | None
    error: ContractError | None

    def __post_init__(self) -> None:
        if (self.request is None) == (self.error is None):
            raise ValueError("Reading holds exactly one of request, error")
        if self.request is not None and self.request.request_id != self.request_id:
            raise ValueError("Reading.request_id must be the request's")


def _judge(top: dict[str, object], request_id: str,
           strict_fault: tuple[str, Rule] | None) -> Request:
    """Steps 4-10 of the order of judgement, for a body already correlated by `request_id`
    (its `requestId`, checked); raises ContractError."""
    if strict_fault is not None:
        raise fault(*strict_fault)
    if top.get("type") != "broker_request":
        raise fault("/type", Rule.TYPE, expected="broker_request")
    version = top.get("protocolVersion")
    if type(version) is not int or not 0 <= version <= MAX_U16:
        raise fault("/protocolVersion", Rule.U16)
    if version != PROTOCOL_VERSION:
        raise ContractError(ErrorCode.UNSUPPORTED_PROTOCOL_VERSION, "/protocolVersion", "not 1")
    for key in top:
        if key not in REQUEST_MEMBERS:
            raise fault(f"/{escape_token(key)}", Rule.UNKNOWN_MEMBER)
    for key in REQUEST_MEMBERS:
        if key not in top:
            raise fault(f"/{key}", Rule.MISSING_MEMBER)
    action = top["action"]
    if type(action) is not str:
        raise fault("/action", Rule.EXPECTED_STRING)
    spec = ACTIONS.get(action)
    if spec is None:
        raise ContractError(ErrorCode.UNKNOWN_ACTION, "/action", "not an action this host knows")
    action_version = top["actionVersion"]
    if type(action_version) is not int or not 0 <= action_version <= MAX_U16:
        raise fault("/actionVersion", Rule.U16)
    if action_version != ACTION_VERSION:
        raise ContractError(ErrorCode.UNSUPPORTED_ACTION_VERSION, "/actionVersion", "not 1")
    args = read_object(top["args"], "/args", shape_for(spec.args_type))
    return Request(request_id=request_id, action=action, action_version=action_version, args=args)


def read_request(body: bytes) -> Reading:
    """Judge one request body, parsing it exactly once.

    Args:
        body: the raw HTTP body, whole.

    Returns:
        A Reading: correlated (request_id set) with either the frozen Request or the first
        fault, or uncorrelated (request_id None) with the fault that made it so.

    Raises:
        TypeError: body is not bytes (our bug). Bad bytes never raise.
    """
    try:
        top, strict_fault = parse(body)
    except JsonSyntaxError as exc:
        return Reading(request_id=None, request=None,
                       error=fault("", Rule.SYNTAX, detail=str(exc)))
    if not is_object(top):
        return Reading(request_id=None, request=None, error=fault("", Rule.TOP_NOT_OBJECT))
    obj: dict[str, object] = top
    request_id = obj.get("requestId")
    if "requestId" in repeated_keys(obj) or not is_request_id(request_id):
        return Reading(request_id=None, request=None,
                       error=fault("/requestId", Rule.REQUEST_ID).showing("/requestId"))
    assert type(request_id) is str  # narrowed by is_request_id
    try:
        request = _judge(obj, request_id, strict_fault)
    except ContractError as exc:
        return Reading(request_id=request_id, request=None,
                       error=exc.showing(shown_pointer(obj, exc.pointer)))
    return Reading(request_id=request_id, request=request, error=None)


def encode_request(request: Request) -> bytes:
    """The frozen form a client sends, first attempt and every retry (spec I3).

    Canonical: compact, members in spec order, absent optional members omitted.
    """
    return _dumps({
        "type": "broker_request",
        "protocolVersion": PROTOCOL_VERSION,
        "requestId": request.request_id,
        "actionVersion": request.action_version,
        "action": request.action,
        "args": to_wire(request.args),
    })


def build_request(
    action: str, args: Mapping[str, object], *, request_id: str, action_version: int = 1
) -> Request:
    """Validate and normalize a client's request exactly as the host will read it.

    The mapping is serialized and read back through `read_request`, so the wire rules (no
    None, no NaN, strict members, limits, normalization) apply unchanged.

    Raises:
        ContractError: with the code and pointer the host would answer.
    """
    envelope = {
        "type": "broker_request", "protocolVersion": PROTOCOL_VERSION, "requestId": request_id,
        "actionVersion": action_version, "action": action, "args": dict(args),
    }
    try:
        # ensure_ascii=True here: a lone surrogate in a Python str becomes a \\udXXX escape
        # that the reader names, instead of an encode error.
        body = json.dumps(envelope, separators=(",", ":"), allow_nan=False).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise fault("/args", Rule.NOT_JSON_VALUE,
                    detail=f"not representable as JSON ({type(exc).__name__})"
                    ).showing("/args") from None
    reading = read_request(body)
    if reading.error is not None:
        raise reading.error
    assert reading.request is not None
    return reading.request


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What the host decided, before it is bound to a requestId.

    Constructing a pairing the spec's table forbids raises AssertionError: that is our bug,
    never an agent's.
    """

    status: Status
    action: str | None = None
    outcome: Outcome | None = None
    code: ErrorCode | None = None
    message: str | None = None
    #: The outcome's canonical bytes, when the host already holds them (a read answered
    #: from a window, daemon/relay/windows.py): `encode_response` uses them instead of
    #: encoding `outcome` again. They must be exactly `outcome`'s canonical form; the
    #: host's tests compare the two (tests/read/test_windows.py).
    encoded_outcome: bytes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.encoded_outcome is not None and self.status is not Status.SUCCEEDED:
            raise AssertionError("only a succeeded verdict carries an encoded outcome")
        if self.status is Status.SUCCEEDED:
            spec = ACTIONS.get(self.action) if self.action is not None else None
            if spec is None or type(self.outcome) is not spec.outcome_type:
                raise AssertionError("succeeded needs a known action and its outcome type")
            if self.code is not None or self.message is not None:
                raise AssertionError("succeeded carries no error")
        else:
            if self.action is not None or self.outcome is not None:
                raise AssertionError(f"{self.status.value} carries no action or outcome")
            if not isinstance(self.code, ErrorCode) or type(self.message) is not str:
                raise AssertionError(f"{self.status.value} needs a code and a message")
            if self.status not in PAIRING[self.code]:
                raise AssertionError(f"{self.code.value} may not travel with {self.status.value}")
            try:
                self.message.encode("utf-8")
            except UnicodeEncodeError:
                # A verdict that exists must encode: a lone surrogate has no UTF-8 form.
                raise AssertionError("a verdict message must be encodable text") from None

    @classmethod
    def succeeded(cls, action: str, outcome: Outcome) -> Verdict:
        return cls(status=Status.SUCCEEDED, action=action, outcome=outcome)

    @classmethod
    def failed(cls, code: ErrorCode, message: str | None = None) -> Verdict:
        """`message` defaults to the fixed MESSAGES[code]."""
        return cls(status=Status.FAILED, code=code, message=MESSAGES[code] if message is None else message)

    @classmethod
    def indeterminate(cls, code: ErrorCode, message: str | None = None) -> Verdict:
        return cls(status=Status.INDETERMINATE, code=code,
                   message=MESSAGES[code] if message is None else message)


def encode_response(request_id: str, verdict: Verdict) -> bytes:
    """Canonical bytes of a broker_result for `verdict`, correlated to `request_id`.

    Raises:
        ValueError: request_id is not usable (our bug: uncorrelated bodies get no envelope).
    """
    if not is_request_id(request_id):
        raise ValueError("encode_response needs a usable requestId")
    envelope: dict[str, object] = {
        "type": "broker_result", "protocolVersion": PROTOCOL_VERSION, "requestId": request_id,
        "status": verdict.status.value,
    }
    if verdict.status is Status.SUCCEEDED:
        envelope["action"] = verdict.action
        if verdict.encoded_outcome is not None:
            # The same bytes `_dumps` would give: compact, and `outcome` is the last member.
            return _dumps(envelope)[:-1] + b',"outcome":' + verdict.encoded_outcome + b"}"
        envelope["outcome"] = to_wire(verdict.outcome)
    else:
        assert verdict.code is not None
        envelope["error"] = {"code": verdict.code.value, "message": verdict.message}
    return _dumps(envelope)


_REPLAYED_SUFFIX = b',"replayed":true}'


def mark_replayed(response: bytes) -> bytes:
    """The recorded response bytes with `"replayed":true` appended (spec I3).

    Raises:
        ValueError: `response` is not an object we encoded, or is already marked (our bug).
    """
    if not response.endswith(b"}") or response.endswith(_REPLAYED_SUFFIX):
        raise ValueError("mark_replayed takes unmarked bytes from encode_response")
    return response[:-1] + _REPLAYED_SUFFIX


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    """A response as the client reads it; `replayed` is False when the member is absent."""

    request_id: str
    status: Status
    action: str | None
    outcome: Outcome | None
    code: ErrorCode | None
    message: str | None
    replayed: bool

    def __post_init__(self) -> None:
        # Re-use the verdict rules: the same pairing and member rules bind both sides.
        try:
            Verdict(status=self.status, action=self.action, outcome=self.outcome,
                    code=self.code, message=self.message)
        except AssertionError as exc:
            raise ValueError(f"Response: {exc}") from None
        if not is_request_id(self.request_id):
            raise ValueError("Response.request_id is not a usable requestId")


_STATUS_BY_WIRE = {s.value: s for s in Status}
_CODE_BY_WIRE = {c.value: c for c in ErrorCode}


def parse_response(body: bytes, *, accept_replayed_false: bool = False) -> Response:
    """The client's strict reader of a broker_result.

    Checks exact member sets per status, no null, no repeated key, the pairing table, the
    outcome typed for its action, and each event's seven members. It does not check the
    response against a request (requestId, action, echoed identities, page size): that is
    the caller's I5 check, which needs the request.

    `"replayed": false` is refused by default: a host must omit the member (the tests that
    hold the daemon to the wire read strictly). `accept_replayed_false=True` is the agent
    client's reading: Buzz's reference client reads the member with a default, so it takes
    `false` as absent (wire-schema.md, "What Buzz's client tolerates").

    Raises:
        ContractError: always invalid_request, with the pointer of the first fault.
    """
    try:
        top, strict_fault = parse(body)
    except JsonSyntaxError as exc:
        raise fault("", Rule.SYNTAX, detail=str(exc)) from None
    if not is_object(top):
        raise fault("", Rule.TOP_NOT_OBJECT)
    try:
        return _read_response(top, strict_fault, accept_replayed_false)
    except ContractError as exc:
        raise exc.showing(shown_pointer(top, exc.pointer)) from None


def _read_response(obj: dict[str, object], strict_fault: tuple[str, Rule] | None,
                   accept_replayed_false: bool) -> Response:
    if strict_fault is not None:
        raise fault(*strict_fault)
    if obj.get("type") != "broker_result":
        raise fault("/type", Rule.TYPE, expected="broker_result")
    if type(obj.get("protocolVersion")) is not int or obj["protocolVersion"] != PROTOCOL_VERSION:
        raise fault("/protocolVersion", Rule.PROTOCOL_VERSION_ONE)
    status_text = obj.get("status")
    status = _STATUS_BY_WIRE.get(status_text) if type(status_text) is str else None
    if status is None:
        raise fault("/status", Rule.STATUS)
    expected = _SUCCEEDED_MEMBERS if status is Status.SUCCEEDED else _ERROR_MEMBERS
    for key in obj:
        if key not in expected and key != _REPLAYED:
            raise fault(f"/{escape_token(key)}", Rule.NOT_WITH_STATUS, status=status.value)
    for key in expected:
        if key not in obj:
            raise fault(f"/{key}", Rule.MISSING_MEMBER)
    if not is_request_id(obj["requestId"]):
        raise fault("/requestId", Rule.REQUEST_ID)
    if _REPLAYED in obj and obj[_REPLAYED] is not True and not (
            accept_replayed_false and obj[_REPLAYED] is False):
        raise fault("/replayed", Rule.REPLAYED)
    replayed = obj.get(_REPLAYED) is True
    if status is Status.SUCCEEDED:
        action = obj["action"]
        if type(action) is not str or action not in ACTIONS:
            raise fault("/action", Rule.ACTION_NAME)
        spec = ACTIONS[action]
        outcome = read_object(obj["outcome"], "/outcome", shape_for(spec.outcome_type))
        return Response(request_id=obj["requestId"], status=status, action=action, outcome=outcome,
                        code=None, message=None, replayed=replayed)
    error = obj["error"]
    if not is_object(error):
        raise fault("/error", Rule.EXPECTED_OBJECT)
    for key in error:
        if key not in ("code", "message"):
            raise fault(f"/error/{escape_token(key)}", Rule.UNKNOWN_MEMBER)
    for key in ("code", "message"):
        if key not in error:
            raise fault(f"/error/{key}", Rule.MISSING_MEMBER)
    code_text = error["code"]
    code = _CODE_BY_WIRE.get(code_text) if type(code_text) is str else None
    if code is None:
        raise fault("/error/code", Rule.ERROR_CODE)
    if status not in PAIRING[code]:
        raise fault("/error/code", Rule.PAIRING, code=code.value, status=status.value)
    message = any_string(error["message"], "/error/message")
    return Response(request_id=obj["requestId"], status=status, action=None, outcome=None,
                    code=code, message=message, replayed=replayed)


#: Every member name the contract defines, at any depth (envelopes, arguments, outcomes,
#: events): the host's words, safe to show. Any other name in a pointer is the sender's.
_VOCABULARY: frozenset[str] = frozenset(REQUEST_MEMBERS).union(
    _SUCCEEDED_MEMBERS, _ERROR_MEMBERS, (_REPLAYED, "code", "message"),
    *(shape.wire_names for shape in SHAPES.values()))


def shown_pointer(document: object, pointer: str) -> str:
    """`pointer` (into `document`) as an agent may be shown it.

    A segment the contract defines and an array index stay as they are; a member name the
    sender chose becomes `<member N>`, its position in its object (document order, from 1),
    or `<member>` where the document has no such member. So the text shown is the host's
    words and numbers only, whatever names the sender wrote (issue 25: a client-supplied
    member name only as an index).
    """
    if not pointer:
        return ""
    node: object = document
    shown: list[str] = []
    for token in pointer.split("/")[1:]:
        name = token.replace("~1", "/").replace("~0", "~")
        if is_object(node):
            if name in _VOCABULARY:
                shown.append(name)
            elif name in node:
                shown.append(f"<member {list(node).index(name) + 1}>")
            else:
                shown.append("<member>")
            node = node.get(name)
        elif type(node) is list and token.isascii() and token.isdigit() and int(token) < len(node):
            shown.append(token)
            node = node[int(token)]
        else:
            shown.append("<member>")
            node = None
    return "/" + "/".join(shown)
