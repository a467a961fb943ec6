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
  after the relay accepted its deletion): cleanup steps from daemon/pipeline/pending.py, data and
  not closures, because they are stored in the pending record and must still mean the
  same after a restart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from buzzwire.contract import ErrorCode, Outcome
from buzzwire.nostr import SignedEvent
from daemon.pipeline.pending import Cleanup

if TYPE_CHECKING:
    from daemon.config import PolicyConfig
    from daemon.operations.channel_read import JudgedCache, ReadLog
    from daemon.pipeline.observer import ObserverIntake
    from daemon.pipeline.policy import Authorized
    from daemon.relay.cursor import CursorCodec
    from daemon.relay.pool import RelayPool
    from daemon.state.runtimes import RuntimeStore
    from daemon.state.sessions import Principal
    from daemon.pipeline.signing import SigningBatcher

__all__ = ["Context", "Custodian", "Plan", "OperationRefused"]


class _Minted(Protocol):
    @property
    def pubkey(self) -> str: ...


class _Address(Protocol):
    @property
    def author_pubkey(self) -> str: ...
    @property
    def kind(self) -> int: ...
    @property
    def d_tag(self) -> str: ...


class _KeyRecord(Protocol):
    @property
    def owner(self) -> str: ...

    @property
    def auth_tag(self) -> tuple[str, ...] | None: ...


class Custodian(Protocol):
    """The custody intents an operation calls itself; `custody.Custody` meets it.

    Everything else an operation needs from custody goes through the `SigningBatcher`
    (signing) or the cleanup steps the publisher runs (destroy). Operations name this
    protocol, never the custody package: they hold no key and import no PKCS#11 binding.
    """

    async def mint_agent(self, *, owner: str, mint_ref: str | None) -> _Minted: ...

    #: the agent key's public record (its owner), None if unknown or destroyed
    def agent(self, pubkey: str) -> _KeyRecord | None: ...

    async def memory_address(self, agent: str, slug: str) -> _Address: ...

    #: NIP-44 v2 from `agent` to its recorded owner; one unseal per call, the conversation
    #: key never leaves custody.
    async def encrypt_to_owner(self, agent: str, plaintexts: Sequence[bytes]) -> tuple[str, ...]: ...

    #: The plaintexts of agent↔owner NIP-44 payloads, None for each that does not open.
    async def decrypt_from_owner_pair(
        self, agent: str, payloads: Sequence[str]
    ) -> tuple[bytes | None, ...]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """Everything an operation may use, for one request."""

    custody: Custodian
    signer: SigningBatcher
    relay: RelayPool
    principal: Principal
    host: PolicyConfig
    cursors: CursorCodec
    request_id: str
    now: Callable[[], int]
    #: The records authorization resolved: the requester's (agents.create) and the target
    #: (agents.update/delete). The operation acts on exactly these and resolves nothing
    #: itself. For an operation marked serialize_per_agent they were resolved under the
    #: requester's and the target's locks, which stay held until its events are published.
    authorized: Authorized
    #: what reads log, one for the daemon: rate-bounded (daemon/operations/channel_read.py)
    read_log: ReadLog
    #: read events already judged canonical and verified, one for the daemon (bounded)
    judged: JudgedCache
    #: the host's own record of each managed agent's runtime (never published)
    runtimes: RuntimeStore | None = None
    #: Names a key just minted in the public directory (pubkey, name, creator), off the
    #: event loop; a name already set is kept (daemon/state/directory.py `enroll`).
    enroll: Callable[[str, str, str | None], Awaitable[object]] | None = None
    #: Mints agents.create's key bound to this request's ledger record, or refuses
    #: (`OperationRefused`) when the mint reference outlived its record (issue 22 H1;
    #: daemon/pipeline/publisher.py `Publisher.mint`).
    mint: Callable[[], Awaitable[_Minted]] | None = None
    #: observer.emit's queue, seq store and clock (daemon/pipeline/observer.py)
    observer: ObserverIntake | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Signed events to publish, in order, and what success will report.

    Attributes:
      events: signed events, published in this order; each goes out on its author's relay
        connection.
      outcome: the contract outcome the agent receives when every event is accepted.
      rollback: cleanup steps run, in order, when the *first* event is refused (nothing
        took hold).
      commit: cleanup steps run, in order, once every event was accepted.
    """

    events: tuple[SignedEvent, ...]
    outcome: Outcome
    rollback: tuple[Cleanup, ...] = ()
    commit: tuple[Cleanup, ...] = ()

    def __post_init__(self) -> None:
        if not self.events:
            raise ValueError("a plan publishes at least one event")


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
