"""The client's setup errors: the broker cannot be used at all, and nothing was done.

Rules:
- An operation method answers everything about *its request* with an `Answer` (a verdict,
  or "fate unknown"); it raises only for the problems below, each of which means the
  request provably had no effect, and each of whose messages says what to do.
- Which is which is a table (`SETUP_PROBLEMS`), read by the client and by the tests:
  a connect that failed with "missing", "permission" or "refused" on *every* attempt
  (so not one byte reached a host), a loopback TCP listener's 403 naming the rule the
  request broke (`LISTENER_REFUSALS`: refused before any handler saw it), or the host's
  verdict `failed` + `unauthenticated`. The table also says which are retried first: a
  missing socket may appear (a restarting broker); a permission or a listener's rule
  does not change by waiting, and is raised at the first attempt.
- Messages name paths and environment variables, never the credential (which they
  cannot reach: the exceptions are built from the endpoint's description, the directory
  above the socket that refused this user when one did, and fixed text).

WARNING: docs/agents.md ("When it cannot work at all") lists these types and their
messages' advice; change both together.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ._transport import ClosedDirectory
    from .client import Failed

__all__ = [
    "SetupError",
    "NotConfigured",
    "BrokerUnreachable",
    "SocketMissing",
    "NothingListening",
    "SocketPermissionDenied",
    "CredentialRefused",
    "ListenerRefused",
    "SetupProblem",
    "SETUP_PROBLEMS",
    "LISTENER_REFUSALS",
    "SOCKET_ENV",
    "CREDENTIAL_ENV",
    "CREDENTIAL_FILE_ENV",
]

#: The environment variables an agent's harness hands it the broker in (as SSH_AUTH_SOCK
#: does for ssh-agent).
SOCKET_ENV = "BUZZ_BROKER_SOCKET"
CREDENTIAL_ENV = "BUZZ_BROKER_CREDENTIAL"
CREDENTIAL_FILE_ENV = "BUZZ_BROKER_CREDENTIAL_FILE"


class SetupError(Exception):
    """This client cannot act through the broker at all. Nothing was done; read the message."""


class NotConfigured(SetupError, ValueError):
    """No address or credential given and none in the environment, or an unusable one."""


class BrokerUnreachable(SetupError):
    """No broker answered at the address on any attempt (nothing was sent)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where


class SocketMissing(BrokerUnreachable):
    """There is no socket at the path."""

    def __init__(self, where: str) -> None:
        super().__init__(where, (
            f"no broker socket at {where}: start buzz-broker (systemctl start buzz-broker), "
            f"or set ${SOCKET_ENV} to its server.socket path"
        ))


class NothingListening(BrokerUnreachable):
    """The socket file (or TCP port) is there but nobody accepts: the broker is not running."""

    def __init__(self, where: str) -> None:
        super().__init__(where, (
            f"nothing is listening at {where}: the broker is not running (a socket left "
            f"behind by a stopped one?); start buzz-broker, or check ${SOCKET_ENV}"
        ))


class SocketPermissionDenied(SetupError):
    """The socket exists but this user may not open it, or may not reach it.

    `closed` is the directory above the socket that stops this user, when one does
    (`_transport.closed_directory`): then the message names it, since the socket's group
    cannot open a directory. Without it, the socket's own mode is the cause.
    """

    def __init__(self, where: str, closed: ClosedDirectory | None = None) -> None:
        super().__init__(f"permission denied on the broker socket {where}: "
                         + (_SOCKET_ITSELF if closed is None else _closed_advice(closed)))
        self.where = where


_SOCKET_ITSELF = (
    "this user may not open it; add the agent's user to the socket's group "
    "(server.socket_group in the broker's config) and start a new login session, or ask "
    "the broker's operator"
)


def _closed_advice(closed: ClosedDirectory) -> str:
    """What to do about a directory above the socket that this user cannot pass through.

    A directory whose group may pass lets the agent in once its user joins that group; one
    whose group may not (0700, say) lets no group in, whatever the socket's own group is.
    """
    where = f"the directory {closed.path} above it (mode {closed.mode:04o}, owner " \
            f"{closed.owner}, group {closed.group}) does not let this user through"
    if closed.mode & stat.S_IXGRP:
        return (f"{where}; add the agent's user to group {closed.group} and start a new "
                "login session, or ask the broker's operator")
    return (f"{where}, nor any group: its mode, not the socket's group, is the problem; the "
            "broker's operator must open it to the socket's group (chgrp, chmod 0750) or put "
            "server.socket in a directory the agent's user can reach")


class CredentialRefused(SetupError):
    """The host's verdict was `failed` + `unauthenticated`: nothing happened.

    `answer` is that verdict (a `Failed`, with the envelope as received).
    """

    def __init__(self, answer: Failed) -> None:
        super().__init__(
            "the broker refused this credential (unauthenticated): it is wrong, expired or "
            "revoked, or bound to another user; ask the broker's operator for a new one "
            f"(buzz-broker credential issue) and point ${CREDENTIAL_FILE_ENV} at it"
        )
        self.answer = answer


class ListenerRefused(SetupError):
    """A loopback TCP listener's rule refused the request: nothing happened; not retried.

    A 403 whose body is one fixed line naming the rule (`LISTENER_REFUSALS`: your user,
    the `Host` header, a browser's header), sent before any handler saw the request. The
    same request is refused again, so it is raised at once. `line` is the listener's line.
    """

    def __init__(self, where: str, line: str) -> None:
        super().__init__(f"the broker's listener at {where} refused the request before "
                         f"judging it, and refuses it again if sent again: {line} "
                         "(docs/protocol.md section 1, \"On loopback TCP\")")
        self.where = where
        self.line = line


#: The loopback TCP listener's 403 bodies, each one fixed line naming the rule the request
#: broke: daemon/loopback_tcp.py `Refusal`, which this client, standing alone, does not
#: import (tests/client/test_listener_refusal.py holds the two equal). A 403 with any
#: other body (a proxy's page) is no answer, as any status without an envelope.
LISTENER_REFUSALS: frozenset[bytes] = frozenset({
    b"refused: this user may not connect to this listener\n",
    b"refused: Host is not this listener's (127.0.0.1:PORT, [::1]:PORT or localhost:PORT)\n",
    b"refused: a browser's request (Origin, Sec-Fetch-* or Upgrade header; Node's built-in "
    b"fetch always sends Sec-Fetch-Mode)\n",
})


@dataclass(frozen=True, slots=True)
class SetupProblem:
    """What an attempt turned away before the host acted on it becomes."""

    #: the error, from the endpoint's description (`Endpoint.describe`)
    error: Callable[[str], SetupError]
    #: retried first (raised only when every attempt of the call was turned away so);
    #: False: raised at once, as waiting cannot change it
    retried: bool


#: How an attempt was turned away -> its setup problem: a connect kind (transport
#: `CONNECT_KINDS`; "other" connect failures stay "no answer"), or a listener's line
#: (`LISTENER_REFUSALS`, without its newline).
SETUP_PROBLEMS: Mapping[str, SetupProblem] = MappingProxyType({
    "missing": SetupProblem(SocketMissing, retried=True),
    "refused": SetupProblem(NothingListening, retried=True),
    "permission": SetupProblem(SocketPermissionDenied, retried=False),
    **{line: SetupProblem(partial(ListenerRefused, line=line), retried=False)
       for line in (body.decode("ascii").rstrip("\n") for body in LISTENER_REFUSALS)},
})
