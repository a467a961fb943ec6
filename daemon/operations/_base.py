"""What every operation module is handed, and what a publishing operation hands back.

Rules:
- An operation never sees the HTTP layer, the ledger or a credential. It gets a `Context`
  (the principal acting, the custody facade, the relay pool, the host policy, a clock) and
  its validated arguments, and returns either a `Verdict` or — for a publishing
  operation — a `Plan`.
- A `Plan` is everything that will reach the relay, *already signed*, plus the outcome the
  agent will be told on success. The pipeline records the plan durably before the first
  byte goes to the relay (design.md "Idempotency"), so a retry after a crash re-sends the
  very same events instead of signing new ones.
- `Plan.rollback` and `Plan.commit` name host-local work that finishes the operation
  (destroy a minted key when the first event is refused; destroy a deleted agent's key
  after the relay accepted its deletion). They are data, not closures, because they are
  stored in the pending record and must still mean the same after a restart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from buzzwire.contract import ErrorCode

if TYPE_CHECKING:
    from custody import Custody
    from daemon.config import PolicyConfig
    from daemon.cursor import CursorCodec
    from daemon.relay import RelayPool
    from daemon.runtimes import RuntimeStore
    from daemon.sessions import Principal
    from daemon.signing import SigningBatcher

__all__ = ["Context", "Plan", "OperationRefused", "HOUSEKEEPING"]

#: Host-local follow-ups a plan may name, each run after the relay answered.
#:   destroy_agent: PUBKEY                    -- seal gone, record tombstoned, credentials revoked
#:   rename_agent: {"pubkey": P, "name": N}  -- the keystore's name follows the published one
#:   set_runtime: {"pubkey": P, "runtime": R} -- the host's own record of the agent's runtime
HOUSEKEEPING = frozenset({"destroy_agent", "rename_agent", "set_runtime"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """Everything an operation may use, for one request."""

    custody: Custody
    signer: SigningBatcher
    relay: RelayPool
    principal: Principal
    host: PolicyConfig
    cursors: CursorCodec
    request_id: str
    now: Callable[[], int]
    #: Serialize this request with every other read-merge-write of `agent` until its events
    #: are published (only in operations marked serialize_per_agent; the requester's own
    #: lock is already held). agents.update takes its target's, whose kind 0 it rewrites.
    hold_agent: Callable[[str], Awaitable[None]]
    #: the host's own record of each managed agent's runtime (never published)
    runtimes: RuntimeStore | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Signed events to publish, in order, and what success will report.

    Attributes:
      events: NIP-01 event objects (seven members each), published in this order; each goes
        out on its author's relay connection.
      outcome: the contract outcome the agent receives when every event is accepted.
      rollback: housekeeping run when the *first* event is refused (nothing took hold), as
        a mapping of HOUSEKEEPING name -> argument.
      commit: housekeeping run once every event was accepted.
    """

    events: tuple[Mapping[str, Any], ...]
    outcome: Any
    rollback: Mapping[str, Any] = field(default_factory=dict)
    commit: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.events:
            raise ValueError("a plan publishes at least one event")
        unknown = (set(self.rollback) | set(self.commit)) - HOUSEKEEPING
        if unknown:
            raise ValueError(f"unknown housekeeping: {sorted(unknown)}")


class OperationRefused(Exception):
    """The operation cannot go ahead and nothing took hold: the pipeline answers `failed`.

    `message` is a fixed, agent-facing sentence (never built from an exception's text);
    `detail` is for the operator log only.
    """

    def __init__(self, code: ErrorCode, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail
