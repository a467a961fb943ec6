"""The pipeline's copy of the custodian's public key records, kept fresh by its version.

Why: the broker asks whether an agent is live on every request, policy and the directory
read owners and NIP-OA tags on most, and NIP-44 needs the agent's owner. Asked over the
socket each time, every request would pay a round trip (and block the event loop for it).
So the pipeline keeps one snapshot of every record (the `agents` row, tombstones
included) with the `records_version` it was taken at, and answers from it.

Theory of operation:
- The version is asked at most once every `RECHECK_SECONDS`; when it differs from the
  snapshot's, the snapshot is taken again (version first, then the list: a change between
  the two is seen at the next check, never missed).
- Asked again at once, whatever the clock says: after any lifecycle call of this
  pipeline (mint, import, destroy, attach_auth, successful or not: it may have taken
  effect), after any fault talking to the custodian, and after the client connected
  afresh (a restarted custodian counts its version from scratch, so an equal number
  proves nothing): `CustodianClient` calls `expire`, and `connections` counts the
  connects.
- So a change made by this pipeline is seen by its next read; one made by another process
  (a command beside it, `--recover`) within `RECHECK_SECONDS`. The custodian checks
  liveness itself on every signature, so a stale "live" here signs nothing.
- Satisfies the daemon directory's key source (`get`, `by_mint_ref`, `all`, `v1_names`,
  `close`), as `custody.KeyIndex` does in-process: with a custodian the pipeline never
  opens the keystore file. A version-1 keystore's set-aside names are not read through
  the table: `v1_names` is empty here (docs/custodian.md).
- Thread-safe: the directory's writes run in worker threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Final, Protocol

from custody._keystore import KeyRecord

__all__ = ["RecordCache", "RECHECK_SECONDS"]

#: The longest a change made by another process goes unseen (a version check at most
#: this often: a few per second, whatever the request rate).
RECHECK_SECONDS: Final = 0.25


class _Source(Protocol):
    """What the cache asks (CustodianClient): one request each, CustodianUnavailable on fault."""

    @property
    def connections(self) -> int: ...
    def ask_version(self) -> int: ...
    def ask_records(self) -> list[KeyRecord]: ...


class RecordCache:
    def __init__(self, source: _Source, clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._clock = clock
        self._lock = threading.Lock()
        self._records: Mapping[str, KeyRecord] = {}
        self._ordered: tuple[KeyRecord, ...] = ()
        self._version: int | None = None
        self._connections = -1
        self._checked = float("-inf")
        self._expired = True

    def expire(self) -> None:
        """Ask the custodian at the next read."""
        self._expired = True

    def _fresh(self) -> tuple[Mapping[str, KeyRecord], tuple[KeyRecord, ...], int]:
        with self._lock:
            now = self._clock()
            if self._expired or now - self._checked >= RECHECK_SECONDS:
                self._expired = True  # until this check succeeds
                version = self._source.ask_version()
                if version != self._version or self._source.connections != self._connections:
                    self._connections = self._source.connections
                    listed = self._source.ask_records()
                    self._ordered = tuple(listed)
                    self._records = {r.pubkey: r for r in listed}
                    self._version = version
                self._checked, self._expired = now, False
            return self._records, self._ordered, int(self._version or 0)

    def version(self) -> int:
        return self._fresh()[2]

    def get(self, pubkey: str) -> KeyRecord | None:
        """The key's record, tombstones included; None if never held."""
        return self._fresh()[0].get(pubkey)

    def all(self, *, include_deleted: bool = False) -> list[KeyRecord]:
        """Oldest first, as the custodian lists them."""
        return [r for r in self._fresh()[1] if include_deleted or r.live]

    def by_mint_ref(self, mint_ref: str) -> KeyRecord | None:
        return next((r for r in self._fresh()[1] if r.mint_ref == mint_ref), None)

    def chain(self, pubkey: str) -> list[KeyRecord]:
        """The key and its owners held here, nearest first; stops at a loop."""
        records, chain, seen = self._fresh()[0], [], set()
        current = records.get(pubkey)
        while current is not None and current.pubkey not in seen:
            seen.add(current.pubkey)
            chain.append(current)
            current = records.get(current.owner)
        return chain

    def v1_names(self) -> dict[str, tuple[str, str | None]]:
        return {}

    def close(self) -> None:
        """The client owns the connection; nothing to close here."""
