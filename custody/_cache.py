"""The unsealed-key cache: OFF by default; for tokens too slow to unseal per signature.

Why it exists: a TPM 2.0 through tpm2-pkcs11 takes 8-15 ms an unseal (field-lab.md), so
a TPM host signs at most ~100 events a second through one token worker. With the cache on,
an agent's key is unsealed once and reused for a bounded time.

Rules (each one is the exposure it bounds):
- Off unless `entries` > 0 (config `[pkcs11] unsealed_cache_entries`; `CachePolicy` is
  `_records`'), and off, this module is never imported (`_facade`). At most `entries`
  keys are held; the least recently used is wiped to make room.
- Time-limited from the UNSEAL, not from the last use: a key is held at most `seconds`
  (`unsealed_cache_seconds`) after it left the token, however often it is used; expired
  entries are wiped on the next cache access and at close.
- Locked twice over: the keys live in ONE C buffer of entries x 32 bytes that is
  `mlock`ed (never written to swap); if the kernel refuses the lock, the cache stays off
  and a warning says why. And every access runs in the token worker holding the token
  lock (`require_lock`), the same place unsealed keys already live.
- A hit needs the agent's CURRENT blob to be byte-identical to the one the key was
  unsealed from: a destroyed agent (no blob) or a resealed one (rotation) never hits; a
  stale entry is wiped when found, and `evict` wipes a destroyed agent's entry at once. The key was checked by every defence
  of `_sealed.unseal` when it entered; a hit copies it into a fresh `Secret` the caller
  wipes as usual.
- `clear()` (custody close) wipes every slot.

Exposure, stated: with the cache on, up to `entries` agent keys sit in the daemon's
memory for up to `seconds` each after their last unseal, instead of for the
microseconds of one signature. A memory-disclosure bug in the daemon process, or root
reading its memory, gets those keys; core dumps and same-uid ptrace are already off
(`_process`), and the buffer is not swapped. Nothing else changes: the keys still never
leave the process, and the token is still needed to unseal anything not cached.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coincurve._libsecp256k1 import ffi

from custody._records import MAX_CACHE_ENTRIES, MAX_CACHE_SECONDS, CachePolicy
from custody._secret import SECRET_SIZE, Secret
from custody._worker import require_lock

__all__ = ["CachePolicy", "UnsealedCache", "MAX_CACHE_ENTRIES", "MAX_CACHE_SECONDS"]

log = logging.getLogger("buzz_broker.custody")

@dataclass(slots=True)
class _Entry:
    slot: int
    blob: bytes
    expires: float


def _mlock(buffer: Any, size: int) -> str | None:
    """Lock `buffer` in RAM; None on success, else why not."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    address = int(ffi.cast("uintptr_t", buffer))
    if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) != 0:
        return f"mlock failed (errno {ctypes.get_errno()}); raise LimitMEMLOCK"
    return None


class UnsealedCache:
    """See the module docstring. Every method runs in the token worker."""

    __slots__ = ("_policy", "_clock", "_buffer", "_entries", "_free")

    def __init__(self, policy: CachePolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self._clock = clock
        self._buffer: Any = None
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._free: list[int] = []
        if policy.entries:
            size = policy.entries * SECRET_SIZE
            buffer = ffi.new("unsigned char[]", size)
            refused = _mlock(buffer, size)
            if refused is not None:
                log.warning("unsealed-key cache stays off: %s", refused)
                return
            self._buffer = buffer
            self._free = list(range(policy.entries))
            log.info("unsealed-key cache on: up to %d keys, %g s each after unseal",
                     policy.entries, policy.seconds)

    @property
    def enabled(self) -> bool:
        return self._buffer is not None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, agent: str, blob: bytes, into: Secret) -> bool:
        """Copy `agent`'s cached key into `into` if it was unsealed from `blob` and has not
        expired; False otherwise (`into` untouched)."""
        require_lock()
        if not self.enabled:
            return False
        self._sweep()
        entry = self._entries.get(agent)
        if entry is None:
            return False
        if entry.blob != blob:
            self.evict(agent)  # the record was resealed or swapped: that key is stale
            return False
        self._entries.move_to_end(agent)
        ffi.memmove(into.cdata, self._slot(entry.slot), SECRET_SIZE)
        return True

    def put(self, agent: str, blob: bytes, secret: Secret) -> None:
        """Hold a copy of `secret` (just unsealed from `blob`, every defence passed)."""
        require_lock()
        if not self.enabled:
            return
        self.evict(agent)
        if not self._free:
            _, oldest = self._entries.popitem(last=False)
            self._wipe(oldest.slot)
        slot = self._free.pop()
        ffi.memmove(self._slot(slot), secret.cdata, SECRET_SIZE)
        self._entries[agent] = _Entry(slot, blob, self._clock() + self._policy.seconds)

    def evict(self, agent: str) -> None:
        require_lock()
        entry = self._entries.pop(agent, None)
        if entry is not None:
            self._wipe(entry.slot)

    def clear(self) -> None:
        require_lock()
        for agent in list(self._entries):
            self.evict(agent)

    def _sweep(self) -> None:
        now = self._clock()
        for agent in [a for a, e in self._entries.items() if e.expires <= now]:
            self.evict(agent)

    def _slot(self, slot: int) -> Any:
        return self._buffer + slot * SECRET_SIZE

    def _wipe(self, slot: int) -> None:
        ffi.memmove(self._slot(slot), bytes(SECRET_SIZE), SECRET_SIZE)
        self._free.append(slot)
