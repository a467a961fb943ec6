"""The custodian's listening socket when systemd holds it (buzz-custodian.socket).

sd_listen_fds(3): PID 1 binds the socket and passes it as fd 3 with ``LISTEN_PID`` (this
process) and ``LISTEN_FDS`` (how many). Why the custodian takes it rather than binding its
own: the daemon's first request connects before the custodian exists, and the connection
waits in the socket's backlog while PID 1 starts the custodian (and while it restarts after
a crash); PID 1 also gives the socket its owner and mode before any other process runs.
A copy of daemon/notify.py's reader, since custody imports nothing from daemon/.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["ActivationError", "inherited_socket"]

#: sd_listen_fds(3): passed descriptors start at 3.
_FIRST = 3


class ActivationError(Exception):
    """Variables present but not usable: one line for the operator."""


def inherited_socket(path: Path, environ: MutableMapping[str, str] | None = None
                     ) -> socket.socket | None:
    """The listening Unix socket systemd passed for `path`, or None when none was passed.

    The variables are removed once read, so nothing this process starts inherits the claim.
    Raises `ActivationError` if they are malformed, pass more than one descriptor, or the
    descriptor is not a listening stream socket bound to `path` (a unit whose
    ListenStream= differs from `[custodian] socket` would otherwise serve the wrong path).
    """
    env = os.environ if environ is None else environ
    pid_text, count_text = env.pop("LISTEN_PID", None), env.pop("LISTEN_FDS", None)
    env.pop("LISTEN_FDNAMES", None)
    if pid_text is None or count_text is None:
        return None
    try:
        pid, count = int(pid_text), int(count_text)
    except ValueError:
        raise ActivationError("LISTEN_PID/LISTEN_FDS are not integers") from None
    if pid != os.getpid():
        return None
    if count != 1:
        raise ActivationError(f"systemd passed {count} sockets; the custodian takes exactly one")
    try:
        sock = socket.socket(fileno=_FIRST)  # ENOTSOCK if it is not one
    except OSError as exc:
        raise ActivationError(f"the socket systemd passed: {exc.strerror}") from None
    sock.set_inheritable(False)
    bound = sock.getsockname()
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or bound != str(path):
        sock.detach()
        raise ActivationError(f"systemd passed {bound!r}, the configuration names {str(path)!r} "
                              "([custodian] socket must equal ListenStream=)")
    return sock
