"""One daemon per state directory, and a way to ask "is it running?" without connecting.

Rules:
- `serve` holds an exclusive, non-blocking flock(2) on ``<state>/serve.lock`` for its whole
  life, with its pid written in the file. The kernel drops the lock when the process dies,
  however it dies (SIGKILL, watchdog abort), so a stale file never reads as "running".
- A second `serve` on the same state directory gets `RunLockHeld` naming the holder's pid
  (after retrying for up to a second, so a `status` probing at that moment is no fault).
- `running_pid(state_dir)` is what `buzz-broker status` asks: it tries a shared lock on the
  file (opened read-only; never created), and answers the holder's pid or None. It never
  touches the agents' socket: a connection there would start the service (socket
  activation) and answer the wrong question.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunLock", "RunLockHeld", "running_pid", "LOCK_NAME"]

LOCK_NAME = "serve.lock"
#: `running_pid` holds a shared lock for microseconds; a starting daemon retries across that.
_ATTEMPTS = 20
_PAUSE = 0.05


class RunLockHeld(Exception):
    """Another daemon holds the state directory: one line naming its pid."""


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


@dataclass
class RunLock:
    """The held lock; `release()` (idempotent) drops it."""

    fd: int | None

    @classmethod
    def acquire(cls, state_dir: str | os.PathLike[str]) -> RunLock:
        """Create the state directory if needed (0700), take the lock, write our pid.

        Raises:
            RunLockHeld: another process holds it, or the file cannot be opened.
        """
        directory = Path(state_dir)
        path = directory / LOCK_NAME
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise RunLockHeld(f"cannot open {path}: {exc.strerror}; [state] dir must be the "
                              "daemon's user's to write") from None
        for attempt in range(_ATTEMPTS):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt + 1 < _ATTEMPTS:
                    time.sleep(_PAUSE)  # a `status` may hold a shared lock for a moment
        else:
            pid = _read_pid(fd)
            os.close(fd)
            raise RunLockHeld(
                f"another buzz-broker serve (pid {pid or '?'}) runs on {directory}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd)

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the only descriptor drops the flock


def running_pid(state_dir: str | os.PathLike[str]) -> int | None:
    """The pid of the `serve` holding `state_dir`, or None when none does.

    Raises:
        PermissionError: the lock file exists but this user cannot open it.
    """
    path = Path(state_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or -1
        return None
    finally:
        os.close(fd)
