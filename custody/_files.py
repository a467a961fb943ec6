"""Reading an operator's file or input that may hold a secret: bounded, and a file only
by its own name (no symlink) and only a regular one.

Why one function for files: the daemon's `keys restore` and the custodian's `keys restore`
read the same two files (the backup, the age identity) by the same rules; a rule written
twice drifts. `read_secret_text` reads `agent import`'s secret text from a descriptor
(stdin, the terminal) under its own bound. Neither the serving daemon nor the serving
custodian imports this module.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from custody._errors import CustodyError
from custody._secret import read_limited

__all__ = ["MAX_SECRET_TEXT", "read_bounded", "read_secret_text"]

#: Longest secret text accepted on stdin: an nsec (63 chars) plus whitespace, with room.
MAX_SECRET_TEXT = 256


def read_bounded(path: Path, limit: int, what: str, *, private: bool) -> bytearray:
    """`path` (no symlink, a regular file, at most `limit` bytes) in a bytearray.

    `private`: refused with any group or other permission bit (it holds a secret).

    Raises:
        CustodyError: one line naming `what` and `path`, never the file's content.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CustodyError(f"{what} {path} is a symbolic link; name the file itself") from None
        raise CustodyError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CustodyError(f"{what} {path} is not a regular file")
        if private and st.st_mode & 0o077:
            raise CustodyError(f"{what} {path} is readable by group or others "
                               f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
        if st.st_size > limit:
            raise CustodyError(f"{what} {path} is larger than {limit} bytes")
        # Sized by fstat: a file that grows while it is read is refused, not followed.
        buf = read_limited(fd, st.st_size)
        if buf is None:
            raise CustodyError(f"{what} {path} changed while it was read")
        return buf
    except OSError as exc:
        raise CustodyError(f"cannot read {what} {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def read_secret_text(fd: int) -> bytearray:
    """Read at most MAX_SECRET_TEXT bytes of secret text from `fd` into a bytearray.

    Raises:
        CustodyError: more than MAX_SECRET_TEXT bytes (the buffer is zeroed first).
    """
    buf = read_limited(fd, MAX_SECRET_TEXT)
    if buf is None:
        raise CustodyError(f"malformed secret: more than {MAX_SECRET_TEXT} bytes of input")
    return buf
