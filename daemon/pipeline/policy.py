"""Authorization: may this principal do this request here?

Rules (spec I2, §Results; issue 4):
- Runs after authentication and validation, before execution. Returns a `Refusal`
  (a failed-only code and a fixed message) or `Authorized`: the agent records it resolved
  (the requester's for agents.create, the target's for agents.update/delete). That is
  the one resolution: the operation acts on exactly these records and resolves nothing
  itself, and the pipeline locks the target it names. It has no side effects and does
  no I/O beyond reading the public agent directory it is handed.
- The checks are data: `CHECKS` is an ordered table of (name, check); the first refusal
  wins. The order puts the host's switch first (`[policy] disabled_actions`), then the
  session's own scope (action, then channel), then the action-specific rules. NIP-BA
  (issue 23): an action the operator switched off is `unsupported` for every credential,
  whatever its scope, so that Buzz's client can carry on after a live signal the host
  does not offer; an offered action the credential lacks is `unauthorized`. That a host
  switched an action off is host configuration any credential may learn: the answer is the
  same for every credential and says nothing about any session or agent.
- Messages are fixed templates (style.md #12); nothing from an exception or from
  another agent's record ever reaches one.

Decisions (recorded here because the spec leaves them to the host):
- A `runtime`, `provider` or `model` this host does not offer is `invalid_request`: the
  argument failed this host's validation and nothing ran. `unsupported` is for an action
  the host does not offer (spec: "host knows the action but does not offer it"), which is
  not the case; `action_failed` promises the action ran, which it did not. NIP-BA: these
  choices are host-declared and an unknown one MUST be refused, not silently substituted,
  so each is checked exactly against its `[policy]` list (`CHOICES`); an empty list offers
  none. A request that names none is not checked: it chooses nothing to substitute.
- A reaction longer than `MAX_REACTION_CHARS` (64 characters) is `invalid_request`, as an
  unoffered choice is: NIP-BA and the contract allow 66, but Buzz's relay refuses a kind 7
  of more than 64 Unicode scalars (ingest.rs `MAX_REACTION_EMOJI_CHARS`), and NIP-BA lets a
  host restrict the reaction vocabulary. Refused here, before the target is read or
  anything signed, rather than `action_failed` by the relay after both.
- agents.update/delete by pubkey answer `unauthorized` with one message whether the
  pubkey is unknown, deleted, or owned by someone else. Distinct answers would let any
  session probe which pubkeys this host holds and who owns them; ownership is the only
  thing authorization decides, so one answer says exactly that much. By name, the search
  covers only the requester's own live agents, so "no such agent" and "ambiguous"
  (`action_failed`, as the issue asks) reveal nothing about anyone else.
- Depth (the rule itself is `daemon.state.directory.child_depth`): agents.create is
  refused (`unauthorized`, naming the limit) when the depth of the agent it would make
  exceeds `max_agent_depth`. A requester this host does not hold (or that was deleted)
  may not create agents at all.

The action sets below derive from the contract's `ActionSpec` facts (their
argument members); `CHECKS` is the only list of checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, TypeAlias, TypeVar

from buzzwire.contract import ACTIONS, ErrorCode, normalize_channel_id
from daemon.state.directory import child_depth
from daemon.state.sessions import Principal

if TYPE_CHECKING:
    # Typing only: daemon.config reads [limits] through daemon.state.ratelimit, which imports
    # Refusal from here, so a runtime import would be circular.
    from daemon.config import PolicyConfig

__all__ = [
    "Authorized",
    "Refusal",
    "authorize",
    "within_credential",
    "envelope_within_credential",
    "resolve_target",
    "AgentView",
    "AgentLookup",
    "CHECKS",
    "CHANNEL_ACTIONS",
    "RUNTIME_ACTIONS",
    "CHOICES",
    "CHOICE_ACTIONS",
    "MAX_REACTION_CHARS",
    "TARGET_ACTIONS",
    "REFUSALS",
    "UNOFFERED",
    "unoffered",
]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A failed verdict decided before anything ran: a code and a fixed, secret-free message."""

    code: ErrorCode
    message: str


class AgentView(Protocol):
    """The public fields policy reads from an agent record (the directory's AgentRecord)."""

    @property
    def pubkey(self) -> str: ...
    @property
    def owner(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def depth(self) -> int: ...
    @property
    def deleted_at(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Authorized:
    """The request may go ahead, on these records (resolved once, by `authorize`).

    `requester`: the requester's own live record, for the actions that need it
    (agents.create: its depth); `target`: the live agent it owns that `target` names
    (agents.update, agents.delete). None where the action has no such agent.
    """

    requester: AgentView | None = None
    target: AgentView | None = None


_R = TypeVar("_R", bound=AgentView, covariant=True)
_R2 = TypeVar("_R2", bound=AgentView)


class AgentLookup(Protocol[_R]):
    """Read-only public agent records: `daemon.state.directory.AgentDirectory` satisfies it."""

    def agent(self, pubkey: str) -> _R | None: ...
    def agents(self, *, include_deleted: bool = False) -> Sequence[_R]: ...


class _Target(Protocol):
    @property
    def pubkey(self) -> str | None: ...
    @property
    def name(self) -> str | None: ...


class _Request(Protocol):
    @property
    def action(self) -> str: ...
    @property
    def args(self) -> object: ...


#: Actions whose arguments carry `channelId` (spec §Operations). The credential's
#: channels must include it: a credential is bound to its conversation (spec §Conformance).
CHANNEL_ACTIONS: Final = frozenset(n for n, spec in ACTIONS.items() if spec.channel_scoped)

#: The host-declared choices (NIP-BA "Managed agents"): (argument, its `PolicyConfig` field).
#: The argument's wire name is also its attribute on the parsed arguments and its key in
#: `REFUSALS`. One table, one check: a choice added here is checked like the others.
CHOICES: Final[tuple[tuple[str, str], ...]] = (
    ("runtime", "runtimes"),
    ("provider", "providers"),
    ("model", "models"),
)

#: For each choice, the actions whose arguments may carry it (from the contract's facts).
CHOICE_ACTIONS: Final = {
    arg: frozenset(n for n, spec in ACTIONS.items() if arg in spec.arg_members.all)
    for arg, _field in CHOICES
}

#: Actions whose arguments may carry `runtime`; "a host refuses a runtime it cannot resolve".
RUNTIME_ACTIONS: Final = CHOICE_ACTIONS["runtime"]

#: The longest reaction this host publishes, in characters (Unicode scalars, counted after
#: the contract's trim): Buzz's relay refuses more (module docstring). The contract's bound
#: (`buzzwire.contract.MAX_REACTION_CHARS`, NIP-BA's 66) stays the wire's.
MAX_REACTION_CHARS: Final = 64

#: Actions that act on an existing agent named by `target`: the requester must own it.
TARGET_ACTIONS: Final = frozenset(n for n, spec in ACTIONS.items() if spec.targets_agent)

#: The fixed refusals, keyed by reason. Depth's message names the configured limit.
REFUSALS: Final = {
    "action": Refusal(ErrorCode.UNAUTHORIZED, "this action is not permitted for this session"),
    "channel": Refusal(ErrorCode.UNAUTHORIZED, "this channel is not permitted for this session"),
    "disabled": Refusal(ErrorCode.UNSUPPORTED, "this host does not offer this action"),
    "requester": Refusal(
        ErrorCode.UNAUTHORIZED, "the requesting agent is not held by this host"
    ),
    "runtime": Refusal(ErrorCode.INVALID_REQUEST, "runtime is not offered by this host"),
    "provider": Refusal(ErrorCode.INVALID_REQUEST, "provider is not offered by this host"),
    "model": Refusal(ErrorCode.INVALID_REQUEST, "model is not offered by this host"),
    "reaction": Refusal(ErrorCode.INVALID_REQUEST,
                        f"reaction is longer than this host's relay takes "
                        f"({MAX_REACTION_CHARS} characters)"),
    "not_owned": Refusal(ErrorCode.UNAUTHORIZED, "the target is not an agent this session owns"),
    "no_such_name": Refusal(ErrorCode.ACTION_FAILED, "no such agent"),
    "ambiguous": Refusal(
        ErrorCode.ACTION_FAILED,
        "the name matches several of your agents; name the target by pubkey",
    ),
}

#: Actions this host knows but never offers, whatever its configuration, each with its
#: own reason: liveness.ping (daemon/operations/liveness_ping.py: no turn is bound to a
#: session here). Refused `unsupported` like a switched-off action, and like it before
#: anything runs: the judgement's authorize step (daemon/pipeline/judgement.py) asks
#: `unoffered` once `authorize` let the request through, so a credential without the
#: action or the channel is still `unauthorized`, and the refusal takes no rate-limit
#: unit, is charged to its credential's refusal share and leaves no tombstone (recorder
#: `keeping`). Not one of `CHECKS`: `authorize` says what a principal may do, and is asked
#: again under locks; this is what the host cannot do for anyone.
UNOFFERED: Final[dict[str, Refusal]] = {
    "liveness.ping": Refusal(
        ErrorCode.UNSUPPORTED,
        "liveness.ping is not offered: this host runs no agent runtime, so no turn is bound "
        "to a session it could check"),
}


def unoffered(r: _Request) -> Refusal | None:
    """The refusal of an action this host never offers (`UNOFFERED`), else None."""
    return UNOFFERED.get(r.action)


_DEPTH_TEMPLATE: Final = "agents.create would exceed this host's agent depth limit of {limit}"


def _depth_refusal(limit: int) -> Refusal:
    return Refusal(ErrorCode.UNAUTHORIZED, _DEPTH_TEMPLATE.format(limit=int(limit)))


def resolve_target(
    principal: Principal, target: _Target, agents: AgentLookup[_R2]
) -> _R2 | Refusal:
    """The live agent owned by the principal that `target` names, or the refusal.

    By pubkey: it must exist, be live, and be owned by the principal; otherwise the one
    `unauthorized` answer (see the module docstring). By name: among the principal's own
    live agents; none -> action_failed "no such agent"; several -> action_failed saying
    the name is ambiguous.
    """
    if target.pubkey is not None:
        record = agents.agent(target.pubkey)
        if record is None or record.deleted_at is not None or record.owner != principal.agent:
            return REFUSALS["not_owned"]
        return record
    matches = [
        a
        for a in agents.agents()
        if a.owner == principal.agent and a.deleted_at is None and a.name == target.name
    ]
    if not matches:
        return REFUSALS["no_such_name"]
    if len(matches) > 1:
        return REFUSALS["ambiguous"]
    return matches[0]


_Dir: TypeAlias = AgentLookup[AgentView]
#: A check answers a refusal, nothing, or what it resolved (merged into `Authorized`).
_Check: TypeAlias = "Callable[[Principal, _Request, PolicyConfig, _Dir], Refusal | Authorized | None]"


def within_credential(p: Principal, r: _Request) -> Refusal | None:
    """The checks that depend on the credential alone: its actions and its channels.

    The ledger belongs to the agent and is shared by all of the agent's credentials, so
    these are also what a credential must pass to be handed a recorded verdict: a narrower
    credential may not replay what a wider one did. (The host- and state-dependent checks
    are not repeated for a replay: a deleted target must not turn a recorded success into
    a refusal.)
    """
    if r.action not in p.actions:
        return REFUSALS["action"]
    if r.action in CHANNEL_ACTIONS and getattr(r.args, "channel_id") not in p.channels:
        return REFUSALS["channel"]
    return None


def envelope_within_credential(p: Principal, action: object, channel: object) -> bool:
    """`within_credential` for a request that could not be read, as far as its envelope can
    be: its `action`, and for an action bound to a channel its `args.channelId` (anything
    else where neither could be read: an absent, repeated or mistyped member). True only
    when the credential holds that action and that channel: a request it could not hold
    even if it were valid is outside its scope, whatever else is wrong with it (the broker
    then records its refusal for this credential alone, never for its agent)."""
    if type(action) is not str or action not in p.actions:
        return False
    if action not in CHANNEL_ACTIONS:
        return True
    return type(channel) is str and normalize_channel_id(channel) in p.channels


def _check_credential(
    p: Principal, r: _Request, host: PolicyConfig, agents: _Dir
) -> Refusal | None:
    return within_credential(p, r)


def _check_disabled(
    p: Principal, r: _Request, host: PolicyConfig, agents: _Dir
) -> Refusal | None:
    return REFUSALS["disabled"] if r.action in host.disabled_actions else None


def _check_depth(
    p: Principal, r: _Request, host: PolicyConfig, agents: _Dir
) -> Refusal | Authorized | None:
    if r.action != "agents.create":
        return None
    requester = agents.agent(p.agent)
    if requester is None or requester.deleted_at is not None:
        return REFUSALS["requester"]
    if child_depth(requester) > host.max_agent_depth:
        return _depth_refusal(host.max_agent_depth)
    return Authorized(requester=requester)


def _check_choices(
    p: Principal, r: _Request, host: PolicyConfig, agents: _Dir
) -> Refusal | None:
    for arg, field in CHOICES:
        if r.action not in CHOICE_ACTIONS[arg]:
            continue
        chosen = getattr(r.args, arg)
        if chosen is not None and chosen not in getattr(host, field):
            return REFUSALS[arg]
    return None


def _check_reaction(
    p: Principal, r: _Request, host: PolicyConfig, agents: _Dir
) -> Refusal | None:
    if r.action != "reaction.add" or len(getattr(r.args, "reaction")) <= MAX_REACTION_CHARS:
        return None
    return REFUSALS["reaction"]


def _check_target(
    p: Principal, r: _Request, host: PolicyConfig, agents: _Dir
) -> Refusal | Authorized | None:
    if r.action not in TARGET_ACTIONS:
        return None
    found = resolve_target(p, getattr(r.args, "target"), agents)
    return found if isinstance(found, Refusal) else Authorized(target=found)


#: The checks, in order; the first refusal wins.
CHECKS: Final[tuple[tuple[str, _Check], ...]] = (
    ("disabled", _check_disabled),
    ("credential", _check_credential),
    ("depth", _check_depth),
    ("choices", _check_choices),
    ("reaction", _check_reaction),
    ("target", _check_target),
)


def authorize(
    principal: Principal,
    request: _Request,
    host: PolicyConfig,
    agents: AgentLookup[AgentView],
) -> Authorized | Refusal:
    """What the principal may run this (validated) request on, or the refusal.

    Args:
        principal: from SessionStore.authenticate.
        request: a validated contract Request (`.action`, `.args`).
        host: the host's [policy] configuration.
        agents: the public agent directory (daemon.state.directory.AgentDirectory).

    Returns:
        The first check's refusal, in `CHECKS` order; else `Authorized` with the records
        the checks resolved.
    """
    requester: AgentView | None = None
    target: AgentView | None = None
    for _name, check in CHECKS:
        answer = check(principal, request, host, agents)
        if isinstance(answer, Refusal):
            return answer
        if answer is not None:
            requester = answer.requester or requester
            target = answer.target or target
    return Authorized(requester=requester, target=target)
