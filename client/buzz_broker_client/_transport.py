"""The agent client's transport: one HTTP/1.1 POST /v1/action over a Unix socket or loopback TCP.

Rules:
- This module moves bytes and nothing else. It knows nothing of the contract: it sends
  the frozen body it is handed, verbatim, and returns the status line and body it got
  back. Deciding what those bytes mean is `buzz_broker_client.client`'s job (spec §HTTP
  binding).
- It runs on any event loop anyio supports (asyncio, trio): every await is anyio's.
- Every way an exchange can die — refused connect, a dropped connection, a timeout the
  caller imposes, an HTTP framing the peer got wrong, a body over the bound — comes out
  as one exception, `TransportFailure`, with a fixed-vocabulary `detail` for operators.
  None of those is a verdict (spec §HTTP binding: "transport failures are never promoted
  to verdicts"). A failure to *connect* is its subclass `ConnectFailure`, whose `kind`
  (`CONNECT_KINDS`) says why: before the connect succeeds not one byte has left, which is
  what lets the client tell a setup problem (no socket, no permission) from a lost request.
- Plain HTTP goes to loopback only (127.0.0.0/8, ::1, `localhost`). The spec says a host
  served over anything else "is publishing that authority": the credential is the whole
  of an agent's authority, so `Endpoint.parse` refuses any other host at construction,
  before a byte can leave. There is no TLS here: an `https://` address is refused rather
  than silently downgraded.
- The credential is only ever written into the Authorization header. It is validated at
  construction (`Credential`, `credential_refusal`) so h11, whose errors quote a bad
  header value, never sees an invalid one, and it has a redacting repr. The head that
  carries it is built and sent in its own frame (`_send_request`), which has returned
  before the wait for the answer: a caller's timeout or cancel lands in that wait, and a
  traceback rendered with its locals (traceback's capture_locals, pytest --showlocals, an
  error tracker) never shows it.

One request per connection: the client opens a fresh connection for each attempt and
closes it after the response. A retry therefore never inherits a half-read response
from a connection that broke, and the host's per-connection limits never see a stale
keep-alive socket. On a local socket the connect costs microseconds.

WARNING: the address forms `Endpoint.parse` accepts are listed in docs/agents.md (section 1)
and in `AsyncBrokerClient`'s docstring.
"""

from __future__ import annotations

import errno
import grp
import ipaddress
import os
import pwd
import stat
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import anyio
import anyio.abc
import h11

from buzzwire.loopback import LOOPBACK_NAMES, is_loopback_host

from ._env import _shown_path

__all__ = [
    "Credential",
    "credential_refusal",
    "Endpoint",
    "HttpReply",
    "TransportFailure",
    "ConnectFailure",
    "ConnectKind",
    "CONNECT_KINDS",
    "ClosedDirectory",
    "closed_directory",
    "exchange",
    "MAX_RESPONSE_BYTES",
    "MAX_HEADER_BYTES",
]

#: The route, fixed by spec §HTTP binding ("One endpoint").
ACTION_PATH = b"/v1/action"

#: Bound on any response body. The largest legal answer is a 500-event page (spec
#: channel.read limit) of events whose content may each be up to 64 KiB as published
#: by other clients; JSON escaping can grow that several times. 64 MiB covers it and
#: still stops a runaway peer from filling memory. Each action's own bound, smaller
#: (`_bounds.response_bytes`), is what the client passes `exchange`.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024

#: Bound on the response head, h11's own default (16 KiB, what common servers accept).
MAX_HEADER_BYTES = 16 * 1024

#: The longest Unix socket path, in bytes: sockaddr_un's sun_path holds 108 with the
#: terminating NUL (the host's own bound, daemon/http.py, not imported: the client stands
#: alone).
MAX_SOCKET_PATH_BYTES = 107

#: Read size per receive call.
_RECEIVE_CHUNK = 64 * 1024

#: Longest credential accepted. Session credentials are short opaque tokens; this only
#: stops an accidental file (a key, a log) being sent as a header.
MAX_CREDENTIAL_BYTES = 1024

#: The Host header for a Unix socket, where there is no host name (RFC 9112 §3.2 still
#: requires the header in HTTP/1.1).
_UNIX_HOST = b"localhost"


class TransportFailure(Exception):
    """No HTTP response could be read: the request's fate is unknown.

    `detail` is a fixed phrase for operators ("connect failed", "connection closed
    before a response", ...). It never contains the credential or the body.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


ConnectKind = Literal["missing", "permission", "refused", "other"]

#: errno of a failed connect -> what it means for an agent. ENOENT/ENOTDIR: no socket at the
#: path. EACCES/EPERM: the socket (or a directory on its path) is not open to this user.
#: ECONNREFUSED: a socket file with nobody listening (a broker that died) or a TCP port
#: nobody serves. Everything else is "other".
CONNECT_KINDS: Mapping[int, ConnectKind] = MappingProxyType({
    errno.ENOENT: "missing",
    errno.ENOTDIR: "missing",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.ECONNREFUSED: "refused",
})


class ConnectFailure(TransportFailure):
    """The connect itself failed: nothing was sent. `kind` is from `CONNECT_KINDS`."""

    def __init__(self, kind: ConnectKind) -> None:
        super().__init__("connect failed" if kind == "other" else f"connect failed ({kind})")
        self.kind: ConnectKind = kind


def _connect_kind(exc: OSError) -> ConnectKind:
    # anyio's TCP connect wraps the per-address errors in ConnectionFailed (an OSError
    # without errno); its cause carries the real one.
    for candidate in (exc, exc.__cause__):
        code = candidate.errno if isinstance(candidate, OSError) else None
        if code is not None and code in CONNECT_KINDS:
            return CONNECT_KINDS[code]
    return "other"


def credential_refusal(value: object) -> TypeError | ValueError | None:
    """The error that refuses `value` as the bearer credential, or None when nothing does.

    Made here, raised by the caller, whose frame drops the value first, so that no frame on
    the error's traceback holds it (`_env`'s docstring); its message never quotes it.
    """
    if not isinstance(value, str):  # bytes read in binary mode, say: no comparison below
        return TypeError("credential must be a str")
    if not value:
        return ValueError("credential is empty")
    if len(value) > MAX_CREDENTIAL_BYTES:
        return ValueError(f"credential is longer than {MAX_CREDENTIAL_BYTES} bytes")
    if not all("\x21" <= c <= "\x7e" for c in value):
        return ValueError("credential must be visible ASCII with no spaces")
    return None


class Credential:
    """The bearer credential: opaque, held privately, never shown.

    Raises:
        TypeError: not a str.
        ValueError: empty, too long, or not visible ASCII (RFC 9110 token68-ish: the
            value must survive as a header field unchanged). The message never quotes it.
    """

    __slots__ = ("__value",)

    def __init__(self, value: str) -> None:
        # This frame stays on the traceback of what it raises: the value is dropped first
        # (the rule in `_env`'s docstring).
        refusal = credential_refusal(value)
        if refusal is not None:
            del value
            raise refusal
        self.__value = value

    def authorization(self) -> bytes:
        """The Authorization header value. Call sites: `exchange` only."""
        return b"Bearer " + self.__value.encode("ascii")

    def __repr__(self) -> str:
        return "Credential(<redacted>)"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:
        # Pickling would write the secret wherever the pickle goes.
        raise TypeError("a Credential cannot be pickled")


def _socket_path(path: str) -> str:
    """`path` made absolute, when a Unix socket can be there.

    A path no socket can have could only ever fail to connect, with nothing sent: refused
    here, where the address is read, rather than answered as a call's "fate unknown".
    The message never quotes the path (it may be a credential put in the wrong place).

    Raises:
        ValueError: the absolute path is longer than `MAX_SOCKET_PATH_BYTES` in the file
            system's encoding, holds a NUL, or cannot be encoded.
    """
    if "\x00" in path:
        raise ValueError("broker socket path holds a NUL byte: no file path can")
    absolute = os.path.abspath(path)
    try:
        size = len(os.fsencode(absolute))
    except UnicodeEncodeError:
        raise ValueError("broker socket path cannot be encoded as a file name") from None
    if size > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"broker socket path is {size} bytes made absolute; a Unix socket's is at most "
            f"{MAX_SOCKET_PATH_BYTES} bytes (sockaddr_un): use a shorter path to it (a "
            "symlink to the socket works)"
        )
    return absolute


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Endpoint:
    """Where the host listens: a Unix socket path, or a loopback TCP address.

    Shown (`describe`, its repr) with a path that looks like a credential left out, as
    `_env` leaves out such a credential file path: a harness that put the token where the
    socket goes would otherwise see it in every repr and setup error it logs. The path is
    still the one connected to.
    """

    kind: Literal["unix", "tcp"]
    path: str | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, address: str) -> Endpoint:
        """Accept a socket path (`/run/b.sock`, `b.sock`, `unix:…`) or `http://<loopback>[:port][/]`.

        Raises:
            ValueError: anything else — `https://` or another scheme, a host that is not
                loopback, a path or query after the authority; a socket path no socket
                can have (`_socket_path`).
        """
        if not isinstance(address, str) or not address:
            raise ValueError("broker address is empty")
        if address.startswith("unix://"):
            raise ValueError("write a Unix socket as unix:/path (or just the path), not unix://")
        if address.startswith("unix:"):
            return cls(kind="unix", path=_socket_path(address[len("unix:") :]))
        if "://" not in address:
            # A path, relative ones included (`--socket broker.sock` from the state dir):
            # made absolute now, so a later chdir cannot change which socket is meant.
            return cls(kind="unix", path=_socket_path(address))
        parts = urllib.parse.urlsplit(address)
        if parts.scheme != "http":
            raise ValueError(
                "broker address must be a socket path or http:// on loopback "
                f"(scheme {parts.scheme or 'none'!r} refused)"
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise ValueError("broker http:// address takes only a host and a port")
        host = parts.hostname
        try:
            port = parts.port or 80
        except ValueError:
            raise ValueError("broker http:// address has an invalid port") from None
        if host is None:
            raise ValueError("broker http:// address has no host")
        if not is_loopback_host(host):
            raise ValueError(
                "plain HTTP is refused except to loopback (127.0.0.0/8, ::1, localhost)"
            )
        if host.lower() in LOOPBACK_NAMES:
            # Pin the name rather than resolving it: a hosts file that maps `localhost`
            # elsewhere must not carry the credential off the machine.
            return cls(kind="tcp", host="127.0.0.1", port=port)
        return cls(kind="tcp", host=str(ipaddress.ip_address(host)), port=port)

    def describe(self) -> str:
        """A human form for logs and messages."""
        if self.kind == "unix":
            assert self.path is not None
            return f"unix:{_shown_path(self.path)}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def __repr__(self) -> str:
        return f"Endpoint({self.describe()!r})"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClosedDirectory:
    """A directory above the socket that this user may not pass through (no search
    permission), as `SocketPermissionDenied` names it: its path, mode, owner and group
    (names where they resolve, else the numbers)."""

    path: str
    mode: int
    owner: str
    group: str


def closed_directory(endpoint: Endpoint) -> ClosedDirectory | None:
    """The first directory on the socket's path this user cannot search, or None.

    A connect refused with EACCES may be the socket's own mode or a directory above it
    that this user may not pass through; the advice differs (the socket's group cannot
    open a directory). Only `access` (as the real uid: an agent is not set-uid) and `stat`
    are used: neither opens anything, so a hostile file on the path (a FIFO, a device)
    cannot hang on or be touched by it. None for a TCP
    address, a path that is not shown (`Endpoint.describe`: its directories are not shown
    either), or when every directory lets this user through (then the socket is the cause).
    """
    path = endpoint.path
    if endpoint.kind != "unix" or path is None or _shown_path(path) != path:
        return None
    chain = [os.path.dirname(path)]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    for directory in reversed(chain):  # from / down: the first closed one is the cause
        if os.access(directory, os.X_OK):
            continue
        try:
            st = os.stat(directory)
        except OSError:
            return None
        return ClosedDirectory(path=directory, mode=stat.S_IMODE(st.st_mode),
                               owner=_user_name(st.st_uid), group=_group_name(st.st_gid))
    return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


@dataclass(frozen=True, slots=True)
class HttpReply:
    """What came back: the status code and the whole body (possibly empty)."""

    status: int
    body: bytes


async def _connect(endpoint: Endpoint) -> anyio.abc.ByteStream:
    if endpoint.kind == "unix":
        assert endpoint.path is not None
        return await anyio.connect_unix(endpoint.path)
    assert endpoint.host is not None and endpoint.port is not None
    return await anyio.connect_tcp(endpoint.host, endpoint.port)


async def exchange(
    endpoint: Endpoint, credential: Credential, body: bytes, *,
    max_body: int = MAX_RESPONSE_BYTES, connected: Callable[[], None] | None = None,
) -> HttpReply:
    """POST `body` verbatim to /v1/action and read the whole response.

    Args:
        endpoint: where the host listens (already checked loopback-or-socket).
        credential: sent only as `Authorization: Bearer …`.
        body: the frozen request bytes; sent unchanged.
        max_body: the most response body bytes read; past it, `TransportFailure`.
        connected: called once the connect succeeded, before the first byte is sent:
            from then on the request may reach the host, whatever happens next.

    Returns:
        The status code and body of the final (non-1xx) response.

    Raises:
        ConnectFailure: the connect failed; nothing was sent.
        TransportFailure: for every other way the exchange can fail.

    Cancellation:
        Safe at any point; the connection is closed. Deadlines are the caller's
        (`anyio.move_on_after` around this call).

    Resource handling:
        The connection is opened here and always closed here.
    """
    try:
        stream = await _connect(endpoint)
    except OSError as exc:
        raise ConnectFailure(_connect_kind(exc)) from None
    async with stream:
        if connected is not None:
            connected()
        try:
            return await _exchange_on(stream, endpoint, credential, body,
                                      min(max_body, MAX_RESPONSE_BYTES))
        except h11.ProtocolError:
            # h11's message can quote header bytes: keep it out.
            raise TransportFailure("malformed HTTP from the host") from None
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise TransportFailure("connection broken") from None


async def _send_request(
    stream: anyio.abc.ByteStream, conn: h11.Connection, endpoint: Endpoint,
    credential: Credential, body: bytes,
) -> None:
    """Write the whole request, in one write: the one place the credential is on the wire.

    Its own frame, returned before `_exchange_on` waits for the answer: a caller's timeout
    or cancel lands in that wait, and whatever renders the traceback with its locals must
    find neither the header nor bytes holding it. While this frame is alive the request is
    held only as a memoryview (whose repr is its address), never as a named `bytes` or
    `h11.Request`.
    """
    host = _UNIX_HOST if endpoint.kind == "unix" else endpoint.describe()[len("http://") :].encode()
    wire = memoryview(b"".join(part for part in (
        conn.send(h11.Request(
            method=b"POST",
            target=ACTION_PATH,
            headers=[
                (b"Host", host),
                (b"Authorization", credential.authorization()),
                (b"Content-Type", b"application/json"),
                (b"Content-Length", str(len(body)).encode("ascii")),
                (b"Connection", b"close"),
            ],
        )),
        conn.send(h11.Data(data=body)),
        conn.send(h11.EndOfMessage()),
    ) if part is not None))
    await stream.send(wire)  # type: ignore[arg-type]  # any bytes-like is sent


async def _exchange_on(
    stream: anyio.abc.ByteStream, endpoint: Endpoint, credential: Credential, body: bytes,
    max_body: int,
) -> HttpReply:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
    await _send_request(stream, conn, endpoint, credential, body)

    status: int | None = None
    chunks: list[bytes] = []
    size = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = bytes(await stream.receive(_RECEIVE_CHUNK))
            except anyio.EndOfStream:
                data = b""  # h11 reads b"" as the peer closing, and answers ConnectionClosed
            conn.receive_data(data)
            continue
        if isinstance(event, h11.InformationalResponse):
            continue  # 1xx: the real answer follows
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > max_body:
                raise TransportFailure("response body over the bound")
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            assert status is not None  # h11 orders Response before EndOfMessage
            return HttpReply(status, b"".join(chunks))
        elif isinstance(event, h11.ConnectionClosed):
            raise TransportFailure("connection closed before a response")
        else:  # pragma: no cover - h11 has no other client-side events
            raise TransportFailure("unexpected HTTP event")
