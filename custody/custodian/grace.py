"""Destroy's grace period: the sealed key of a destroyed agent, kept for a while.

Why: `destroy` is in the message table, so a compromised pipeline could destroy every
key. Before the custodian destroys one, it keeps a copy of the sealed blob (sealed under
the token's KEK, so no secret in the clear) here for `grace_seconds`; the operator brings
it back with `buzz-broker custodian FILE --recover PUBKEY` (recover.py reads it with
`kept_copy`, and `revive_agent` checks it through the unseal door first). Past the grace
period a copy is deleted (at the next destroy, and at start), and the destroy is final. A
copy is sealed under the KEK that `keys rotate` destroys: it refuses while one is kept,
unless told (custody/custodian/keys.py). The commands delete one with forget.py's
`forget_copy`. This module is what the serving custodian needs: keep, and purge.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["Graveyard"]


class Graveyard:
    def __init__(self, directory: Path, grace_seconds: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.grace = grace_seconds
        self.clock = clock
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.purge()

    @classmethod
    def beside(cls, log_path: Path, grace_seconds: int) -> Graveyard:
        """The custodian's own: `destroyed/` beside its signed log."""
        return cls(log_path.parent / "destroyed", grace_seconds)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The copies changed by one process at a time (an exclusive flock on the directory):
        a command's purge beside the custodian must not find a copy past its grace, then
        delete the fresh one a destroy put in its place meanwhile (a review: a key lost)."""
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def path(self, pubkey: str) -> Path:
        return self.directory / f"{pubkey}.sealed"  # pubkey: 64 hex, checked by the table

    def keep(self, pubkey: str, blob: bytes) -> None:
        """Write the copy durably before the key is destroyed (tmp, fsync, rename, and the
        directory fsynced: the tombstone's commit that follows must not outlive the copy)."""
        tmp = self.directory / f".{pubkey}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        with self.locked():
            os.replace(tmp, self.path(pubkey))
            directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
            self._purge()

    def purge(self) -> list[str]:
        """Delete the copies past the grace period; the pubkeys of those kept."""
        with self.locked():
            return self._purge()

    def _purge(self) -> list[str]:
        now, kept = self.clock(), []
        for path in sorted(self.directory.glob("*.sealed")):
            try:
                if now - path.stat().st_mtime > self.grace:
                    path.unlink()
                else:
                    kept.append(path.stem)
            except FileNotFoundError:
                continue
        return kept
