"""Per-peer-uid shares of what the socket server holds: request bytes and connections.

Why: memory must be bounded by configuration, not by what clients send, and one local
user must not be able to starve another. The peer's uid (SO_PEERCRED, given by the
kernel, not claimed by the client) is the unit of sharing; an agent and an attacker
running as different users therefore never compete for the same share.

Rules:
- `ByteBudget` holds `total` bytes of request bodies in flight (read, being read, or with
  the application). A connection reserves a request's whole declared length *before* it
  reads (or invites, with ``100 Continue``) one body byte, and releases it once the answer
  is written. A uid's share is ``total // (uids_holding + 1)``, where `uids_holding`
  counts the uids that hold bytes now, the asking one included: one share is always left
  for a uid that holds nothing yet. A reservation that does not fit waits (`reserve`
  blocks) and the connection reads nothing meanwhile: back-pressure through the kernel's
  socket buffers instead of buffering in the daemon. The caller's read deadline bounds the
  wait. A uid holding nothing may always take one reservation that fits in what is free,
  so a share smaller than one request never wedges a uid.
- `ConnectionCounts` counts open connections per key against a cap; the server refuses a
  connection past it (it cannot wait: a waiting connection would hold a global slot). The
  keys are peer uids (``max_connections_per_uid``) and, once a request names one,
  credentials (``max_connections_per_credential``, keyed by a digest of the Authorization
  value): many agents of a fleet often run as one uid, and one of them, or a same-uid
  process replaying a header, must not use up the share of all the others.

Not fair within a uid: two processes of the same user share that user's share (docs/
reliability.md says what a same-uid attacker can still do).

Pure bookkeeping plus one trio.Event for wake-ups; no I/O, no logging.
"""

from __future__ import annotations

from collections.abc import Hashable

import trio

__all__ = ["ByteBudget", "ConnectionCounts", "Uid"]

#: The peer's uid; None when SO_PEERCRED is unavailable (all such peers share one key).
Uid = int | None


class ByteBudget:
    """Bytes of request bodies in flight, shared per uid (see the module docstring)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("the in-flight byte budget must be >= 1")
        self.total = total
        self.used = 0
        self._held: dict[Uid, int] = {}
        self._changed = trio.Event()

    def held(self, uid: Uid) -> int:
        return self._held.get(uid, 0)

    def share(self, uid: Uid) -> int:
        """What `uid` may hold now: total // (uids holding, `uid` included, + 1)."""
        holders = len(self._held) + (0 if uid in self._held else 1)
        return self.total // (holders + 1)

    def fits(self, uid: Uid, size: int) -> bool:
        if self.used + size > self.total:
            return False
        held = self.held(uid)
        return held == 0 or held + size <= self.share(uid)

    async def reserve(self, uid: Uid, size: int) -> None:
        """Take `size` bytes for `uid`, waiting until they fit. `size` must be <= total."""
        if size > self.total:
            raise ValueError("a reservation larger than the whole budget can never fit")
        if size <= 0:
            return
        while not self.fits(uid, size):
            await self._changed.wait()
        self._held[uid] = self.held(uid) + size
        self.used += size

    def release(self, uid: Uid, size: int) -> None:
        if size <= 0:
            return
        left = self.held(uid) - size
        if left < 0:
            raise ValueError("released more than was reserved")
        if left:
            self._held[uid] = left
        else:
            del self._held[uid]
        self.used -= size
        # Wake every waiter: each re-checks its own fit (shares change as uids come and go).
        self._changed.set()
        self._changed = trio.Event()


class ConnectionCounts:
    """Open connections per key (a uid, or a credential's digest), against a cap per key."""

    def __init__(self, per_uid: int) -> None:
        if per_uid < 1:
            raise ValueError("the per-uid connection cap must be >= 1")
        self.per_uid = per_uid
        self._open: dict[Hashable, int] = {}

    def open(self, uid: Hashable) -> int:
        return self._open.get(uid, 0)

    def try_open(self, uid: Hashable) -> bool:
        """Count one more connection of `uid`; False (and nothing counted) past the cap."""
        count = self.open(uid)
        if count >= self.per_uid:
            return False
        self._open[uid] = count + 1
        return True

    def close(self, uid: Hashable) -> None:
        count = self.open(uid) - 1
        if count > 0:
            self._open[uid] = count
        else:
            self._open.pop(uid, None)
