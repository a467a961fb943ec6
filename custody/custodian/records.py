"""The pipeline's copy of the custodian's public key records, kept fresh by its version.

Why: the broker asks whether an agent is live on every request, policy and the directory
read owners and NIP-OA tags on most, and NIP-44 needs the agent's owner. Asked over the
socket each time, every request would pay a round trip, and wait on the custodian. So the
pipeline keeps one snapshot of every record (the `agents` row, tombstones included) and
answers from it.

Theory of operation:
- A snapshot holds the records, the custodian's `records_version` they were listed at and
  the connection that version came over. It is replaced whole, in one assignment: a
  reader in any thread (the directory's writes run in worker threads) sees the old one or
  the new one, never a mix.
- A check asks the version; when it differs from the snapshot's, or came over another
  connection than the snapshot's (a reconnect: a restarted custodian counts its version
  from scratch, so an equal number proves nothing), the list is taken again (version
  first, then the list: a change between the two is seen at the next check, never missed).
- Tended (the daemon, from `tend`, right after custody opens): `run` is a task of the
  daemon's nursery (daemon/wiring.py). It checks every `RECHECK_SECONDS`, and at once after `expire` (the client calls it after a
  fault), over the client's own async lookup connection, each question bounded by the
  client's LOOKUP_TIMEOUT. Reads only read the snapshot and never do I/O, so a custodian
  that hangs or is restarting (socket activation: the socket accepts, nothing answers)
  never holds up the event loop: only what needs the custodian waits for it (signing,
  NIP-44, lifecycle: the client's own deadline).
- A lifecycle call of this pipeline (mint, import, destroy, attach_auth, successful or
  not: it may have taken effect) returns only after a check begun after its answer
  (`changed`; concurrent callers share one check), so its change is seen by its next
  read. If that check fails, a successful call raises CustodianUnavailable (done, but
  not yet shown: as for a custodian that died before answering) and a failed one raises
  its own error.
- A check that fails while tended leaves the last snapshot served (logged once per
  outage). That is safe: the custodian checks liveness itself on every signature, so a
  stale "live" signs nothing; and while it does not answer, no record can change through
  it (a restore or rotation needs its state lock), so the snapshot is what it was at most
  `RECHECK_SECONDS` before the outage; the first check that succeeds afterwards is on a
  new connection, which takes the list again.
- Before the first snapshot (tended): `CustodianClient.open` takes one before the daemon
  starts (no answer within LOOKUP_TIMEOUT: the daemon does not start); if there is none,
  a read raises CustodianUnavailable (the broker's `internal`), never "unknown agent".
- Untended (a command: `agent list`, `status`, `keys backup`, tests' bare clients): no task
  runs. A read makes the check itself, blocking, over the client's blocking connection,
  when the last one is `RECHECK_SECONDS` old or after `expire` (lifecycle calls expire);
  a fault is raised on every read. A command is one flow: it waits only for its own answer.
- `version()` is this cache's own count of the listings it took, not the custodian's
  number: it changes whenever the records may have (the broker keeps its liveness
  answers while it stays the same), and a restarted custodian repeating a number cannot
  make it repeat.
- Satisfies the daemon directory's key source (`get`, `by_mint_ref`, `all`, `v1_names`,
  `close`), as `custody.KeyIndex` does in-process: with a custodian the pipeline never
  opens the keystore file. A version-1 keystore's set-aside names are not read through
  the table: `v1_names` is empty here (docs/custodian.md).

WARNING: a tended cache must be read only; nothing in a read may reach `_source`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from custody._errors import CustodyError
from custody._keystore import KeyRecord

__all__ = ["CustodianUnavailable", "RecordCache", "RECHECK_SECONDS"]

_log = logging.getLogger("buzz_broker.custodian.records")

#: The longest a change made by another process goes unseen (a version check at most
#: this often: a few per second, whatever the request rate).
RECHECK_SECONDS: Final = 0.25


class CustodianUnavailable(CustodyError):
    """The custodian did not answer (not running, died mid-call, hung, or broke the
    table). Defined here, below the client that re-exports it, because a tended snapshot
    that was never taken raises it too."""


class _Source(Protocol):
    """What the cache asks (CustodianClient), one request each, CustodianUnavailable on
    a fault. A version comes with the connection it came over (compared by `==`)."""

    def ask_version(self) -> tuple[int, object]: ...
    def ask_records(self) -> list[KeyRecord]: ...
    async def fetch_version(self) -> tuple[int, object]: ...
    async def fetch_records(self) -> list[KeyRecord]: ...


@dataclass(frozen=True, slots=True)
class _Snapshot:
    records: Mapping[str, KeyRecord]
    ordered: tuple[KeyRecord, ...]
    version: int  # the custodian's, as asked over `connection`
    connection: object
    generation: int  # this cache's count of listings: what `version()` answers


class RecordCache:
    """The snapshot and how it is kept fresh (the module docstring): the directory's
    `KeySource` and the client's record reads; `tend` and `run` for the daemon."""

    def __init__(self, source: _Source, clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._clock = clock
        self._snapshot: _Snapshot | None = None
        self._generation = 0
        # untended: the blocking check, serialized across threads
        self._lock = threading.Lock()
        self._checked = float("-inf")
        self._expired = True
        # tended: the async checks, one at a time; `_begun`/`_done` number them
        self._tended: trio.lowlevel.TrioToken | None = None
        self._async_lock = trio.Lock()
        self._begun = 0
        self._done = 0
        self._wake = trio.Event()

    # --- keeping it fresh ----------------------------------------------------------------

    def expire(self) -> None:
        """Check again at once: at the next read (untended) or now, in `run` (tended).
        Safe from any thread."""
        self._expired = True
        token = self._tended
        if token is not None:
            try:
                token.run_sync_soon(lambda: self._wake.set())
            except trio.RunFinishedError:
                pass  # the daemon's loop has ended: nothing reads any more

    def _install(self, version: int, connection: object, listed: list[KeyRecord]) -> None:
        self._generation += 1
        self._snapshot = _Snapshot({r.pubkey: r for r in listed}, tuple(listed), version,
                                   connection, self._generation)

    def _stale(self, version: int, connection: object) -> bool:
        snapshot = self._snapshot
        return snapshot is None or (version, connection) != (snapshot.version,
                                                             snapshot.connection)

    async def _check(self) -> None:
        """One async check (the caller holds `_async_lock`)."""
        self._begun += 1
        number, self._expired = self._begun, False
        try:
            version, connection = await self._source.fetch_version()
            if self._stale(version, connection):
                self._install(version, connection, await self._source.fetch_records())
        except BaseException:
            self._expired = True
            raise
        self._done, self._checked = number, self._clock()

    async def refreshed(self) -> None:
        """Return once a check begun after this call has succeeded; one already under way
        when it is made does not count (it may have asked before the change).

        Raises:
            CustodianUnavailable: the check made here failed (the snapshot is unchanged).

        Cancellation: safe; a check cut off mid-way installs nothing.
        """
        wanted = self._begun + 1
        async with self._async_lock:
            if self._done < wanted:
                await self._check()

    async def changed(self) -> None:
        """After a lifecycle call: tended, `refreshed` (raises as it does); untended,
        `expire` (the next read checks)."""
        if self._tended is None:
            self.expire()
        else:
            await self.refreshed()

    def tend(self) -> None:
        """From now on reads never ask the custodian: they answer from the snapshot, which
        `run` keeps fresh. Called from the event loop (its token wakes `run`); the daemon
        calls it as soon as custody is open, so its startup reads do not ask either.

        WARNING: without `run` started soon after, the snapshot is never refreshed."""
        self._tended = trio.lowlevel.current_trio_token()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Keep the snapshot fresh until cancelled (the module docstring, "Tended"); `tend`s
        first.

        From `started()` on, reads never ask the custodian. Without a snapshot yet, one
        check is tried first (bounded by the client's LOOKUP_TIMEOUT); whatever it gives,
        `started()` follows, and reads without a snapshot raise CustodianUnavailable.
        """
        self.tend()
        if self._snapshot is None:
            try:
                await self.refreshed()
            except CustodyError:
                self._wake.set()  # the loop's first check follows at once, and logs
        task_status.started()
        failing = False
        while True:
            with trio.move_on_after(RECHECK_SECONDS):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self.refreshed()
            except CustodyError as exc:
                if not failing:
                    failing = True
                    snapshot = self._snapshot
                    _log.warning("custodian records not checked (%s): reads answer from the "
                                 "snapshot of %s records until a check succeeds",
                                 type(exc).__name__,
                                 "no" if snapshot is None else len(snapshot.ordered))
            else:
                if failing:
                    failing = False
                    _log.info("custodian records checked again: %d records",
                              len(self._current().ordered))

    # --- reads -----------------------------------------------------------------------------

    def _current(self) -> _Snapshot:
        if self._tended is not None:
            snapshot = self._snapshot
            if snapshot is None:
                raise CustodianUnavailable("no snapshot of the custodian's records yet")
            return snapshot
        with self._lock:
            now = self._clock()
            if self._expired or now - self._checked >= RECHECK_SECONDS:
                self._expired = False  # an `expire` from now on asks again
                try:
                    version, connection = self._source.ask_version()
                    if self._stale(version, connection):
                        self._install(version, connection, self._source.ask_records())
                except BaseException:
                    self._expired = True  # a fault is raised on every read until one succeeds
                    raise
                self._checked = now
            assert self._snapshot is not None
            return self._snapshot

    def version(self) -> int:
        """Changes whenever the records may have changed (this cache's listings)."""
        return self._current().generation

    def get(self, pubkey: str) -> KeyRecord | None:
        """The key's record, tombstones included; None if never held."""
        return self._current().records.get(pubkey)

    def all(self, *, include_deleted: bool = False) -> list[KeyRecord]:
        """Oldest first, as the custodian lists them."""
        return [r for r in self._current().ordered if include_deleted or r.live]

    def by_mint_ref(self, mint_ref: str) -> KeyRecord | None:
        return next((r for r in self._current().ordered if r.mint_ref == mint_ref), None)

    def chain(self, pubkey: str) -> list[KeyRecord]:
        """The key and its owners held here, nearest first; stops at a loop."""
        records, chain, seen = self._current().records, [], set()
        current = records.get(pubkey)
        while current is not None and current.pubkey not in seen:
            seen.add(current.pubkey)
            chain.append(current)
            current = records.get(current.owner)
        return chain

    def v1_names(self) -> dict[str, tuple[str, str | None]]:
        return {}

    def close(self) -> None:
        """The client owns the connections; nothing to close here."""
