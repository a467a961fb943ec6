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
- A failure (another OS, a seccomp filter that denies prctl, no glibc) is logged as a
  warning and is not fatal: the systemd unit sets the same limits (but M_PERTURB), and
  refusing to start would be worse.

Alternatives considered: doing this only in `serve` (misses the CLI and anything else that
opens custody), and mlockall (swapping is the unit's job: it needs CAP_IPC_LOCK).

Why M_PERTURB (mallopt(3)): python-pkcs11 has the token write each C_Decrypt/C_Encrypt
output (the agent key under AES-GCM; under encrypt-then-MAC the keystream, which opens the
sealed blob) into a heap buffer of its own that it frees unzeroed, out of custody's reach:
a scan of the custodian found both there after the calls returned
(tests/custodian/test_custodian_memory.py). With M_PERTURB glibc fills each chunk as it
frees it, except a chunk it keeps in its per-thread cache (1032 usable bytes or fewer), so
custody asks for a larger buffer (`_token.OUTPUT_BUFFER_BYTES`). Rejected: C_Decrypt through
ctypes into a buffer of ours (more hazmat: python-pkcs11's mechanism code, twice). Cost: a
memset of each malloc'd block (not CPython's small objects) at malloc and at free. The
systemd units close the two gaps for everything else (plaintexts, credentials): with
PYTHONMALLOC=malloc and GLIBC_TUNABLES=glibc.malloc.tcache_count=0 every free is filled
(tests/security/test_plaintext_lifetime.py); an allocator is chosen at interpreter start,
so this function cannot do it.
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
#: glibc malloc.h: mallopt's parameter for the byte freed memory is filled with; any byte
#: but 0 (which turns it off), 0xA5 being easy to recognise in a dump.
M_PERTURB, PERTURB_BYTE = -6, 0xA5


def harden_process() -> None:
    """Turn core dumps off, make this process undumpable (Linux) and have glibc overwrite
    freed heap memory. Never raises.

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
    try:
        libc = ctypes.CDLL(None)
        if libc.mallopt(M_PERTURB, PERTURB_BYTE) != 1:  # mallopt answers 1 on success
            raise OSError("mallopt(M_PERTURB) refused")
    except (OSError, AttributeError) as exc:
        log.warning("freed heap memory is not overwritten (mallopt M_PERTURB): %s",
                    type(exc).__name__)


def is_dumpable() -> bool | None:
    """PR_GET_DUMPABLE as a bool; None where it cannot be read (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
    return None if value < 0 else bool(value)
