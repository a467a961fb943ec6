"""The state directory's lock: who may use the keystore while keys are being resealed.

Rules:
- `<state_dir>/custody.lock` (0600), an advisory `flock`. Every `Custody.open` (the daemon,
  the operator's `agent`/`keys` commands) holds it SHARED until `aclose`; `keys rotate` and
  `keys migrate` hold it EXCLUSIVE for their whole run. So a rotation runs only with the
  daemon down and no other custody command running, and nothing opens custody while one
  runs: both sides refuse at once (LOCK_NB) with a line saying why, never wait.
- The kernel drops a lock when its process dies (a crash, SIGKILL), so a killed rotation
  never leaves the state directory locked.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from custody._errors import CustodyError

__all__ = ["LOCK_FILE", "StateLock"]

LOCK_FILE = "custody.lock"


class StateLock:
    """A held lock on a state directory; `release()` (idempotent) lets it go."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def shared(cls, state_dir: Path) -> StateLock:
        return cls._take(state_dir, fcntl.LOCK_SH, "a key rotation or migration is running "
                         f"on {state_dir}; wait for it to finish")

    @classmethod
    def exclusive(cls, state_dir: Path) -> StateLock:
        return cls._take(state_dir, fcntl.LOCK_EX, f"custody on {state_dir} is in use (the "
                         "daemon, the custodian or another command): stop the daemon "
                         "(systemctl stop buzz-broker), or the custodian where it holds the "
                         "keys (buzz-custodian.socket and .service), and run this again")

    @classmethod
    def _take(cls, state_dir: Path, mode: int, busy: str) -> StateLock:
        try:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
                         | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise CustodyError(f"cannot open {state_dir / LOCK_FILE}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise CustodyError(busy) from None
            raise CustodyError(f"cannot lock {state_dir / LOCK_FILE}: {exc.strerror}") from None
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
