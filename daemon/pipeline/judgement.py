"""The judgement steps: may this fresh, authenticated request run, and on what?

Rules (README "How a request is judged", steps 4 and 5):
- The steps are data: `JUDGEMENT` is an ordered table of (phase, name, step); `judge`
  walks it and the first step that answers a `Verdict` decides (always `failed`: every
  judgement refusal is recorded like any verdict, so one requestId has one verdict).
- A step answers a refusal, nothing, or what it resolved (`policy.Authorized`, the agent
  records the operation will act on). `judge` returns `Admitted`: the validated request
  and those records. Nothing else resolves them again.
- Runs only for a fresh request: the ledger has already answered replays, conflicts and
  resumed work, so a replay never costs quota (the rate limit step takes units). A retry
  of a record an earlier attempt left without pending work (`recorded`: agents.create
  reserved, then crashed or ended indeterminate before sending) is judged again, since
  policy may have changed meanwhile, but takes no units: that attempt already paid them
  (docs/operations.md, "A replay costs no quota").
- authorize is policy's `authorize`, then `unoffered`: an action this host never offers
  (liveness.ping) is refused `unsupported` before the rate limits and before anything
  runs, so it is a refusal like any other (charged to its credential's refusal share, no
  tombstone, no unit taken).
- Steps have no side effects beyond the rate limiter's units (the broker logs what
  validation refused: it is the one that bounds its lines).

WARNING: `PIPELINE` in daemon/pipeline/broker.py names the phases in order; the phases here must be
a contiguous run of it (tests/policy/test_judgement.py checks both, and README's list).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from buzzwire.contract import Reading, Request, Verdict
from daemon.config import PolicyConfig
from daemon.pipeline.policy import (AgentLookup, AgentView, Authorized, Refusal, authorize,
                                    unoffered)
from daemon.state.ratelimit import RateLimiter
from daemon.state.sessions import Principal

__all__ = ["Admission", "Admitted", "JUDGEMENT", "judge"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    """One fresh, authenticated request, and what the judgement steps consult."""

    principal: Principal
    reading: Reading
    policy: PolicyConfig
    agents: AgentLookup[AgentView]
    limiter: RateLimiter
    now: float
    #: an earlier attempt of this record passed judgement and paid its units (`Fresh.recorded`)
    recorded: bool = False


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request may run: validated, and on the records authorization resolved."""

    request: Request
    authorized: Authorized


Step: TypeAlias = Callable[[Admission], "Verdict | Authorized | None"]


def _validate(a: Admission) -> Verdict | None:
    # The agent is told where and which rule (issue 25): `error.message`, from the
    # contract's one table. Its pointer, like the log's, names a member the agent chose
    # by position only (`shown_pointer`): the name could be anything, a credential pasted
    # in the wrong place included.
    error = a.reading.error
    if error is None:
        return None
    return Verdict.failed(error.code, error.message)


def _authorize(a: Admission) -> Verdict | Authorized:
    decision = authorize(a.principal, _request(a), a.policy, a.agents)
    if isinstance(decision, Refusal):
        return Verdict.failed(decision.code, decision.message)
    # An action the host never offers (liveness.ping): refused here, before anything
    # runs, like a switched-off one (policy `UNOFFERED`).
    refused = unoffered(_request(a))
    if refused is not None:
        return Verdict.failed(refused.code, refused.message)
    return decision


def _rate_limit(a: Admission) -> Verdict | None:
    # Recorded like every verdict (I3): the identical bytes replay this refusal; a new
    # attempt after the limit frees up is a new requestId.
    if a.recorded:
        return None
    limited = a.limiter.take(a.principal, _request(a).action, a.now)
    return None if limited is None else Verdict.failed(limited.code, limited.message)


#: (phase in daemon.pipeline.broker.PIPELINE, step name, step), in order; the first verdict wins.
JUDGEMENT: Final[tuple[tuple[str, str, Step], ...]] = (
    ("validate", "validate", _validate),
    ("authorize", "authorize", _authorize),
    ("authorize", "rate_limit", _rate_limit),
)


def judge(admission: Admission) -> Verdict | Admitted:
    """Walk `JUDGEMENT`: the first refusal, or the request admitted with its records."""
    authorized = Authorized()
    for _phase, _name, step in JUDGEMENT:
        answer = step(admission)
        if isinstance(answer, Verdict):
            return answer
        if answer is not None:
            authorized = answer
    return Admitted(_request(admission), authorized)


def _request(a: Admission) -> Request:
    # Every step after `validate` sees a request that passed it.
    assert a.reading.request is not None, "judgement: a step ran before validate passed"
    return a.reading.request

