"""Host keys: a 32-byte secret in a file of the state directory, made once, read at start.

Rules:
- A host key is `HOST_KEY_BYTES` random bytes in `<state_dir>/<name>`, mode 0600. Its
  users: the read-cursor MAC key (`cursor-mac.key`, daemon/relay/cursor.py) and the audit
  log's body MAC key (`audit-mac.key`, daemon/state/audit_mac.py). Each user names its
  own file; this module only makes and reads one.
- Made once, atomically: written and fsynced under a private temporary name (created
  0600 with O_EXCL, so there is no window in which it is readable), then hard-linked
  into place. Two processes racing on first use end up with one key (the loser's
  temporary file is removed and it reads the winner's), and no reader ever sees a
  half-written file.
- Read strictly: a file that is not a regular file (a symlink is not followed, a FIFO
  not waited on), is readable by group or other, or does not hold exactly
  `HOST_KEY_BYTES` bytes is refused with `HostKeyError`, whose one-line message names
  the file and the fix. It is never repaired or replaced: a key that changed silently
  would turn every cursor invalid, and give a retry another audit MAC than its first
  attempt's.
- The key never reaches a message, a log or a repr (the callers hold it in objects whose
  `__repr__` redacts it).

WARNING: docs/install.md ("What a file backup of the host holds") and
docs/operations.md ("The body MAC") list the key files; keep them in step with the users.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Final

__all__ = ["HOST_KEY_BYTES", "HostKeyError", "load_or_create"]

#: 32 bytes: RFC 2104 §3 asks for an HMAC key at least as long as the hash output
#: (SHA-256: L = 32); longer adds nothing.
HOST_KEY_BYTES: Final = 32

#: The key file's mode: the daemon's user alone.
_FILE_MODE: Final = 0o600


class HostKeyError(Exception):
    """A host key file is unusable (operator error); the message names the file and the fix."""


def load_or_create(directory: Path | str, name: str, *, what: str) -> bytes:
    """The host key in `<directory>/<name>`, made on first use.

    Args:
        directory: the state directory (it must exist).
        name: the key file's name, e.g. `cursor-mac.key`.
        what: what the key is, for messages ("cursor MAC key").

    Returns:
        The `HOST_KEY_BYTES` bytes of the key.

    Raises:
        HostKeyError: the file exists but has the wrong size, is not a regular file, or is
            readable by group/other; or it cannot be created or opened.
    """
    directory = Path(directory)
    path = directory / name
    if not os.path.lexists(path):
        _create(directory, path, what)
    return _read(path, what)


def _create(directory: Path, path: Path, what: str) -> None:
    tmp = directory / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     _FILE_MODE)
    except OSError as exc:
        raise HostKeyError(f"cannot create the {what} in {directory}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(HOST_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process won the race; use its key
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, what: str) -> bytes:
    try:
        # O_NONBLOCK: a FIFO put there opens at once (and is refused below) instead of
        # holding the start until something writes to it; a regular file ignores it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise HostKeyError(f"cannot open the {what} {path}: {exc.strerror}") from None
    try:
        # Checked on the descriptor before any read: reading a directory fails with an
        # OSError that names no key file.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HostKeyError(f"the {what} {path} is not a regular file")
        if info.st_mode & 0o077:
            raise HostKeyError(f"the {what} {path} is readable by others; chmod 600 it")
        key = b""
        while len(key) <= HOST_KEY_BYTES:  # one byte past the size tells a longer file
            chunk = os.read(fd, HOST_KEY_BYTES + 1 - len(key))
            if not chunk:
                break
            key += chunk
    finally:
        os.close(fd)
    if len(key) != HOST_KEY_BYTES:
        raise HostKeyError(f"the {what} {path} must hold exactly {HOST_KEY_BYTES} bytes")
    return key
