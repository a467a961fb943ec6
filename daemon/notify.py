"""systemd's service protocols over the standard library: sd_notify and socket activation.

Rules:
- `notify(...)` sends one datagram to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the
  Linux abstract namespace). Without that variable it does nothing and says so by
  returning False: the daemon runs the same under systemd, in a terminal and in tests.
  A failed send is logged by the caller, never fatal: readiness is a courtesy to the
  service manager, not part of serving agents.
- `listen_fds()` implements the ``LISTEN_FDS``/``LISTEN_PID`` contract (sd_listen_fds(3)):
  the fds start at 3, and they are ours only when ``LISTEN_PID`` is our pid (otherwise
  they were meant for a parent that exec'd us, and we leave them alone). The variables
  are removed from the environment once read, so a child process never claims them.
- `watchdog_interval()` reads ``WATCHDOG_USEC`` (and ``WATCHDOG_PID`` when set) and
  returns the interval in seconds; the caller pings at half of it, as sd_watchdog_enabled(3)
  recommends.

The messages are fixed strings built here (`READY`, `STOPPING`, `WATCHDOG`, `RELOADING`,
`status()`, `monotonic_usec()`):
a STATUS line is operator text and must not contain newlines (the protocol is one
assignment per line).

WARNING: the messages are systemd's protocol (sd_notify(3), sd_listen_fds(3)); docs/configuration.md
("Outside the file") says which ones the daemon sends and when.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, MutableMapping

__all__ = [
    "READY",
    "STOPPING",
    "WATCHDOG",
    "RELOADING",
    "LISTEN_FDS_START",
    "status",
    "monotonic_usec",
    "notify",
    "listen_fds",
    "watchdog_interval",
]

READY = "READY=1"
STOPPING = "STOPPING=1"
WATCHDOG = "WATCHDOG=1"
RELOADING = "RELOADING=1"

#: sd_listen_fds(3): passed descriptors start at 3 (SD_LISTEN_FDS_START).
LISTEN_FDS_START = 3


def status(text: str) -> str:
    """A ``STATUS=`` line; newlines would start a new assignment, so they become spaces."""
    return "STATUS=" + text.replace("\n", " ").replace("\r", " ")


def monotonic_usec() -> str:
    """``MONOTONIC_USEC=`` now: systemd 253's Type=notify-reload needs it beside RELOADING=1."""
    return f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"


def _address(raw: str) -> str | bytes:
    # sd_notify(3): "@" at the start names a socket in the abstract namespace (leading NUL).
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    return raw


def notify(*lines: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `lines` (joined by newlines) to the service manager in one datagram.

    Args:
        lines: assignments such as `READY`, `status("serving")`.
        environ: where to find ``NOTIFY_SOCKET``; the process environment unless given.

    Returns:
        True when the datagram was sent, False when there is no ``NOTIFY_SOCKET``.

    Raises:
        OSError: the socket exists but the send failed (the caller logs it).
    """
    env = os.environ if environ is None else environ
    raw = env.get("NOTIFY_SOCKET", "")
    if not raw:
        return False
    payload = "\n".join(lines).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.sendto(payload, _address(raw))
    return True


def listen_fds(environ: MutableMapping[str, str] | None = None, *, unset: bool = True) -> list[int]:
    """The descriptors systemd passed us, or [] when there are none meant for this process.

    Args:
        environ: the environment to read (the process's unless given).
        unset: remove ``LISTEN_PID``/``LISTEN_FDS``/``LISTEN_FDNAMES`` once read, so children
            do not inherit the claim.

    Returns:
        ``[3, 4, …]``, one per passed descriptor, each marked close-on-exec.

    Raises:
        ValueError: the variables are present but malformed (one clear line for the operator).
    """
    env = os.environ if environ is None else environ
    pid_text = env.get("LISTEN_PID")
    count_text = env.get("LISTEN_FDS")
    if unset:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(name, None)
    if pid_text is None or count_text is None:
        return []
    try:
        pid = int(pid_text)
        count = int(count_text)
    except ValueError:
        raise ValueError("LISTEN_PID/LISTEN_FDS are not integers") from None
    if pid != os.getpid():
        return []
    if count < 0:
        raise ValueError("LISTEN_FDS is negative")
    fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + count))
    for fd in fds:
        os.set_inheritable(fd, False)
    return fds


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """The watchdog timeout in seconds, or None when no watchdog is asked of this process.

    Raises:
        ValueError: ``WATCHDOG_USEC`` is present but not a positive integer.
    """
    env = os.environ if environ is None else environ
    usec_text = env.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    pid_text = env.get("WATCHDOG_PID")
    if pid_text and pid_text.isdigit() and int(pid_text) != os.getpid():
        return None
    try:
        usec = int(usec_text)
    except ValueError:
        raise ValueError("WATCHDOG_USEC is not an integer") from None
    if usec <= 0:
        raise ValueError("WATCHDOG_USEC is not positive")
    return usec / 1_000_000
