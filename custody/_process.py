"""Process hardening: a process that holds unsealed keys must not be dumped or traced.

Rules:
- `harden_process()` turns core dumps off (`RLIMIT_CORE` soft and hard limits 0: a crash
  writes no core, and the process cannot raise the limit again) and marks the process
  undumpable (`prctl(PR_SET_DUMPABLE, 0)`, Linux): no core even through a pipe handler,
  no `ptrace` attach by processes of the same uid (gdb, py-spy) without CAP_SYS_PTRACE,
  and `/proc/<pid>/` entries (mem, environ, fd, maps) owned by root and closed to the
  same uid. `/proc/<pid>/stat` and `/status` stay world-readable (RSS, CPU times), so
  benchmarks that read them still work from any user.
- `Custody.open` and `init_kek` call it first, before a PIN is read or a key unsealed, so
  every path in (the daemon, the operator CLI, a hand-run serve, a container without the
  systemd unit's LimitCORE=0) is covered. Calling it twice is harmless.
- A failure (another OS, a seccomp filter that denies prctl) is logged as a warning and is
  not fatal: the systemd unit sets the same limits, and refusing to start would be worse.

Alternatives considered: doing this only in `serve` (misses the CLI and anything else that
opens custody), and mlockall (swapping is the unit's job: it needs CAP_IPC_LOCK).
"""

from __future__ import annotations

import ctypes
import logging
import resource
import sys

__all__ = ["harden_process", "is_dumpable"]

log = logging.getLogger("buzz_broker.custody")

#: linux/prctl.h: PR_SET_DUMPABLE takes 0 (not dumpable) or 1; PR_GET_DUMPABLE reads it.
PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3


def harden_process() -> None:
    """Turn core dumps off and make this process undumpable (Linux). Never raises.

    Errors are logged (warning, with the errno name only) and the process goes on: see the
    module docstring.
    """
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (OSError, ValueError) as exc:
        log.warning("could not turn core dumps off (RLIMIT_CORE): %s", type(exc).__name__)
    if not sys.platform.startswith("linux"):
        log.warning("process not marked undumpable: PR_SET_DUMPABLE is Linux-only")
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")
    except (OSError, AttributeError) as exc:
        log.warning("could not mark the process undumpable: %s", type(exc).__name__)


def is_dumpable() -> bool | None:
    """PR_GET_DUMPABLE as a bool; None where it cannot be read (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
    return None if value < 0 else bool(value)
