"""HTTP/1.1 servers: trio for the I/O, h11 for the protocol, nothing of the contract.

The daemon's every HTTP endpoint goes through `serve`: the agents' socket (``POST
/v1/action``, `action_routes`) and the metrics admin socket and loopback TCP listener
(``GET``/``HEAD /metrics``, `daemon.metrics.scrape_routes`, with the smaller
`daemon.metrics.SCRAPE_LIMITS`). One server, so one set of bounds, one fault containment
and one stale-socket check for all of them.

Theory of operation:
- `serve()` owns one nursery. It accepts connections on a listening stream socket (one it
  was handed - by systemd socket activation, or `bind_tcp_socket` for metrics - or a Unix
  socket it binds with `bind_unix_socket`), runs one task per connection, and calls
  ``task_status.started(control)`` only once the socket is listening.
  `ServerControl.stop()` asks for a graceful stop; cancelling `serve()` is the hard stop.
- A connection task reads one request at a time with h11 (keep-alive unless
  ``limits.keep_alive`` is off; pipelined requests are read one after another from h11's
  buffer, so they are answered in order), hands a `HttpRequest` (body bytes, the raw
  Authorization value, the peer's uid/pid from SO_PEERCRED on a Unix socket) to the
  handler its `Routes` table names, and writes back its `HttpAnswer`. The handler decides
  everything about the body; this layer only enforces the transport.
- Routing is a table, (method, path) -> handler (`Routes`). A path the table has with
  another method is 405 with ``Allow`` listing the path's methods; any other target is
  404. Neither has a body (on the agents' socket: no envelope, the request was never
  judged). Other transport faults are likewise bodiless: 400 (malformed HTTP), 408 (too
  slow), 413 (body too large), 431 (headers too large), 500 (the handler raised), 505 (an
  HTTP version other than 1.0 and 1.1, which h11 would otherwise treat as 1.1; the
  connection is closed). The one exception is 403 (a TCP peer or request refused, below):
  its ``text/plain`` body is the fixed line of `daemon.loopback_tcp.Refusal` naming the
  rule, since the rule is one an ordinary HTTP client can break (Node's fetch). A HEAD
  request is answered with its handler's status and headers (the real Content-Length)
  and no body, as HTTP requires; only a table that lists HEAD routes it.

Bounds (all from `HttpLimits`: [server] in the config for the agents' socket, the fixed and
smaller `daemon.metrics.SCRAPE_LIMITS` for the metrics listeners):
- header bytes: h11's ``max_incomplete_event_size`` while the head is arriving, and the
  size of the parsed head once it is whole; beyond either, 431.
- body bytes: a ``Content-Length`` above the limit is answered 413 before one body byte is
  read (and before ``100 Continue``); a chunked body is counted as it arrives and answered
  413 the moment it crosses the limit. Either way the connection is then closed, because
  the rest of the body would have to be read to find the next request.
- body parsing: a connection yields to the others after every `BODY_EVENTS_PER_CHECKPOINT`
  body events, so a body sent in tiny chunks (thousands parsed from one read) costs its
  CPU in turns and does not hold the event loop while other connections wait.
- read time: one deadline covers reading a whole request (headers and body), and the same
  deadline bounds how long an idle keep-alive connection is kept. A client that is too slow
  mid-request gets 408 and is disconnected; an idle one is just closed. Writing the answer
  has the same deadline, so a client that never reads cannot pin a task.
- concurrent connections: a semaphore of ``max_connections`` slots is taken *before*
  ``accept()``. At the limit we wait, we do not close: new clients queue in the kernel's
  listen backlog and are served as slots free up (idle connections free theirs within
  ``request_timeout``). Closing would turn a burst into transport failures that every
  agent must retry; waiting turns it into latency.
- connections per peer uid: past ``max_connections_per_uid`` open connections of one uid
  (SO_PEERCRED), a new connection of that uid is answered 503 and closed at once. It
  cannot wait like the global cap does: the uid is only known after ``accept()``, and a
  waiting connection would hold a global slot that another user's agent needs. On a TCP
  listener a connection counts from the moment its uid is known, while ``admit`` is still
  deciding it: else one local user, while the user database is slow, could hold every
  global slot with connections waiting on their lookups.
- connections per credential (when ``max_connections_per_credential`` is set: the TCP
  listeners): a connection is counted under the credential (a digest of the Authorization
  value, its case-insensitive scheme folded) of its first request that carries one; past the cap that request is answered 503
  and the connection closed. One agent of a fleet that shares a uid cannot use up the
  uid's share. The count is per peer uid and credential: another uid that learned a
  credential cannot use up its owner's share of it (it only spends its own).
- body bytes in flight: ``max_inflight_bytes``, shared per peer uid (`daemon.peer_shares`).
  A request's declared length (``max_body_bytes`` for a chunked body) is reserved before
  ``100 Continue`` and before one body byte is read, and released once its answer is
  written. Past its uid's share a connection waits and reads nothing (back-pressure: the
  client's writes block in the kernel); the read deadline bounds the wait (408). Until a
  connection holds a reservation it reads at most `HEAD_RECEIVE_SIZE` bytes at a time, so
  what h11 buffers beyond a head is small and bounded per connection.

Loopback TCP listeners (the action API's [server] listen_tcp, the metrics listener): the
peer's uid comes from the kernel for the exact connection (`daemon.tcp_peer`; None when
unknown) and is the key of the per-uid bounds as SO_PEERCRED's is on a Unix socket. The
action API passes ``admit`` (its allow-list): a uid it refuses, unknown included, gets a
403 (`Refusal.UID`) before a byte is read. Every request on a TCP listener must pass
`daemon.loopback_tcp.browser_refusal` (its Host is the listener's own loopback literal; no
Origin, Sec-Fetch-* or Upgrade) before routing, else a 403 whose body names the rule
broken and the connection is closed: no handler sees it. No CORS header is ever written.

Credentials: the value of the single ``Authorization`` header is handed over as received
(decoded as ASCII). Two or more Authorization headers, or a non-ASCII value, are handed
over as ``""`` - present but malformed - so authentication fails for them as it does for
any unusable credential, and nothing tries to guess which header was meant.

Disconnects: a client that goes away mid-request ends its task at the next read (h11
reports the truncated message); nothing is left behind. A client that goes away while a
handler is handling its request does not cancel the handler (the pipeline must be
allowed to record what it did); the answer's write fails and the task ends.

Graceful stop: `ServerControl.stop()` closes the listener (no new connections), cuts every
connection that is waiting for or reading a request, and lets connections whose request is
with a handler finish and write their answer (with ``Connection: close``), for up to
``shutdown_grace`` seconds from the `stop()` call; then whatever is left is cancelled.
Servers stopped in one step (the daemon's socket and its TCP listeners) thus share one
grace period; whoever runs several must wait for all of them before cancelling any.

Errors: an exception from a handler never reaches the client. It is logged (type
name only: its text could carry a secret) and answered 500 without a body, the very last
resort - a handler is expected to always answer. Every other unexpected exception in a
connection task (from h11, from writing an unusable answer, from this module) ends that
connection only - answered 500 first if no response was started - and never `serve`.
Faults are logged through `daemon.fault_log.FaultLog`: once per cause, then at most one
line per cause per minute with a count, because a client that can trip a fault at will
must not be able to fill the log's disk.

WARNING: the order of checks for a request (browser rule on TCP -> route -> credential
count -> 413 -> reserve -> 100 Continue -> body) is what makes "a browser's request
reaches no handler", "413 before the body is read" and "no body byte read beyond the uid's
share" true; keep `_Connection._read_request` in that order.
"""

from __future__ import annotations

import errno
import grp
import hashlib
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import h11
import trio

from daemon.fault_log import FaultLog
from daemon.log import log_event
from daemon.loopback_tcp import Refusal, browser_refusal
from daemon.peer_shares import ByteBudget, ConnectionCounts
from daemon.tcp_peer import peer_uid

__all__ = [
    "HttpRequest",
    "HttpAnswer",
    "Application",
    "Handler",
    "Routes",
    "action_routes",
    "HttpLimits",
    "ServerControl",
    "ListenError",
    "serve",
    "bind_unix_socket",
    "bind_tcp_socket",
    "unlink_if_ours",
    "ACTION_PATH",
]

_log = logging.getLogger("buzz_broker.http")

#: The one endpoint (agent-broker.md §HTTP binding; NIP-BA "Session and transport").
ACTION_PATH = b"/v1/action"

#: How much we ask the kernel for per read of a body whose bytes are reserved, at most:
#: never more than the body still to come, or HEAD_RECEIVE_SIZE if that is less.
RECEIVE_SIZE = 65536
#: How much we ask for per read while a connection holds no reservation (a head, or the
#: next request on a keep-alive connection): bytes h11 keeps beyond the head stay small.
HEAD_RECEIVE_SIZE = 4096
#: Body events handled between two schedule points, at most. One read of a chunked body
#: can hold thousands of chunks (a 64 KiB read of 1-byte chunks is ~11,000), all parsed
#: from h11's buffer without another read, so without yielding: at ~5 us each (h11
#: alone, measured) one such read held the loop some 55 ms and every other connection
#: waited. 64 events is ~0.3 ms. A Content-Length body is one event a read (and a read
#: yields already), so the bound costs it nothing.
BODY_EVENTS_PER_CHECKPOINT = 64

#: SO_SNDBUF asked for an accepted loopback TCP connection. Why: with the kernel's
#: default start (tcp_wmem's 16 KiB), a 40 KB answer (a poll of 100 events) leaves in
#: pieces, and loopback's 64 KiB MSS makes the client's kernel hold its ACK of a partial
#: segment for the delayed-ACK timer (40 ms): measured, half the polls of a fleet waited
#: ~40 ms in send (docs/performance.md "fleet"). A bound, not an allocation: the kernel
#: charges only the bytes queued, and autotuning may reach its own maximum anyway.
SEND_BUFFER_BYTES = 1024 * 1024


def _size_send_buffer(conn: trio.socket.SocketType) -> None:
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    except OSError:
        pass  # the kernel's default stays: slower on large answers, still correct


#: After accept() fails for lack of descriptors/memory, pause before retrying rather than
#: spinning; the same value trio's serve_listeners uses.
ACCEPT_RETRY_SLEEP = 0.1
_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})

#: listen(2) backlog: where clients wait while all connection slots are taken.
LISTEN_BACKLOG = 1024

#: sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107

#: Bodiless reasons, sent as the status line's phrase.
_REASONS: dict[int, bytes] = {
    200: b"OK",
    400: b"Bad Request",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
    505: b"HTTP Version Not Supported",
}

#: The HTTP versions served; h11 parses any `HTTP/d.d` and keeps it alive like 1.1.
_VERSIONS = frozenset({b"1.0", b"1.1"})

#: What a connection past its uid's cap gets before it is closed (no request was read, so
#: h11 cannot write it: a server may not answer before a request in its state machine).
_TOO_MANY_FROM_UID = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)
#: What a TCP connection whose peer uid is unknown or not allowed gets, before a byte of
#: its request is read ([server] tcp_allow_uids / tcp_allow_groups).
_NOT_ADMITTED = (
    b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%s" % (len(Refusal.UID.value), Refusal.UID.value)
)
#: What a TCP connection whose uid the user database did not decide within
#: `request_timeout` gets: not the refusal's 403, which a client rightly never retries, as
#: the same uid is admitted once a lookup of it answers. Fixed words, as the 403 lines.
UNDECIDED_BODY = b"unavailable: the user database did not answer in time; try again\n"
_UNDECIDED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%s" % (len(UNDECIDED_BODY), UNDECIDED_BODY)
)
#: How long that answer may take to write before the connection is simply closed.
_REFUSE_WRITE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """What a handler gets: never the path or method (its route fixed them)."""

    body: bytes
    #: The Authorization header's value as sent ("Bearer ..."), None if absent, "" if
    #: unusable (repeated, non-ASCII). Never logged, never in repr.
    authorization: str | None = field(repr=False)
    peer_uid: int | None
    peer_pid: int | None
    #: Arrived on a loopback TCP listener ([server] listen_tcp): the pipeline accepts only
    #: uid-bound credentials there unless the operator says otherwise.
    over_tcp: bool = False


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """What a handler answers: an HTTP status and the body bytes (None = no body)."""

    status: int
    body: bytes | None
    content_type: str = "application/json"


class Application(Protocol):
    """The pipeline behind the agents' socket. `handle` must always return an answer."""

    async def handle(self, request: HttpRequest) -> HttpAnswer: ...


#: What a route calls; like `Application.handle`, it must always return an answer.
Handler = Callable[[HttpRequest], Awaitable[HttpAnswer]]


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A request routing turns away here, before any handler: a status and its headers."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...] = ()


_NOT_FOUND = _Refusal(404)


@dataclass(frozen=True, slots=True)
class Routes:
    """What one socket serves: a table from (method, path) to the handler that answers.

    A path the table has with another method is refused 405 with ``Allow`` naming the
    path's methods (sorted); any other target is 404. Methods and paths are bytes as they
    appear on the request line (methods upper case).
    """

    table: Mapping[tuple[bytes, bytes], Handler]
    #: Match the path without its ``?query`` (a Prometheus scrape config may add
    #: parameters). False: the target must equal a path byte for byte, as the spec's one
    #: agent endpoint does (``/v1/action?x=1`` is 404).
    ignore_query: bool = False

    def find(self, method: bytes, target: bytes) -> Handler | _Refusal:
        """The handler for this request line, or how routing refuses it."""
        path = target.split(b"?", 1)[0] if self.ignore_query else target
        handler = self.table.get((method, path))
        if handler is not None:
            return handler
        allowed = sorted(m for m, p in self.table if p == path)
        if not allowed:
            return _NOT_FOUND
        return _Refusal(405, ((b"Allow", b", ".join(allowed)),))


def action_routes(app: Application) -> Routes:
    """The agents' socket: ``POST /v1/action`` and nothing else (spec §HTTP binding)."""
    return Routes({(b"POST", ACTION_PATH): app.handle})


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpLimits:
    """Transport bounds; defaults equal the [server] defaults in docs/configuration.md."""

    max_connections: int = 1024
    #: Open connections one peer uid may hold; an agent runtime needs a handful.
    max_connections_per_uid: int = 128
    #: Open connections one credential (the Authorization value) may hold, so one agent,
    #: or anything sending its header, cannot use up its uid's share for the others; None:
    #: no such bound (the agents' socket: its group already keeps strangers out).
    max_connections_per_credential: int | None = None
    #: Bytes of request bodies in flight, shared per peer uid (module docstring).
    max_inflight_bytes: int = 64 * 1024 * 1024
    #: 512 KiB: the spec's largest valid request must get a verdict, not a 413 — 64 KiB of
    #: content that JSON escapes 6x (control characters as \u00XX) is 384 KiB, plus the
    #: envelope. Buzz's relay takes frames up to 512 KiB too.
    max_body_bytes: int = 524288
    #: 16 KiB, the header cap h11 itself defaults to (node, tomcat and IIS use 8-16 KiB).
    max_header_bytes: int = 16384
    #: Seconds to read one request, to keep an idle connection, and to write one answer.
    request_timeout: float = 10.0
    #: Seconds in-flight requests get to finish after a graceful stop.
    shutdown_grace: float = 10.0
    #: False: one request per connection, its answer sent with ``Connection: close`` (the
    #: metrics listeners: a scraper reconnects per scrape, so an idle one holds no slot).
    keep_alive: bool = True

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_connections_per_uid,
               self.max_connections_per_credential or 1) < 1:
            raise ValueError("max_connections and the per-uid/credential caps must be >= 1")
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError("max_inflight_bytes must be >= max_body_bytes")
        if self.max_body_bytes < 0 or self.max_header_bytes < 1:
            raise ValueError("max_body_bytes must be >= 0 and max_header_bytes >= 1")
        if not self.request_timeout > 0 or self.shutdown_grace < 0:
            raise ValueError("request_timeout must be > 0 and shutdown_grace >= 0")


class ListenError(Exception):
    """The socket could not be set up: one line for the operator (path and reason)."""


# --------------------------------------------------------------------------- binding


def _gid(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ListenError(f"socket group {group!r} does not exist") from None


def _replace_stale(path: str) -> None:
    """Remove a socket file nobody listens on; refuse anything else at `path`."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ListenError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: left behind by a process that died
        return
    except OSError as exc:
        raise ListenError(f"{path}: cannot probe existing socket ({exc.strerror})") from None
    finally:
        probe.close()
    raise ListenError(f"{path}: another process is already listening on this socket")


def unlink_if_ours(path: str, inode: int | None) -> None:
    """Remove the socket file at `path` if it is still the one we bound (same inode).

    A newer daemon may already have replaced it (a restart racing our exit): its socket
    must stay. Every error is ignored: the file is gone or was never ours.
    """
    if inode is None:
        return
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def bind_unix_socket(path: str, *, mode: int = 0o660, group: str | None = None) -> socket.socket:
    """Create the listening socket at `path`, with its permissions set before anyone can connect.

    The directory is created 0750 if missing (and given `group`, so the group can reach
    the socket). The socket is bound under a temporary name, chmod/chown'ed, set listening
    and then renamed over `path`: there is no moment when `path` exists with the wrong
    permissions, and a stale socket is replaced atomically.

    Raises:
        ListenError: one line naming the path and the reason.
    """
    path = os.path.abspath(path)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ListenError(f"{path}: socket path longer than {MAX_SOCKET_PATH_BYTES} bytes")
    gid = _gid(group) if group is not None else None
    directory = os.path.dirname(path)
    try:
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o750, exist_ok=True)
            os.chmod(directory, 0o750)  # makedirs is subject to the umask
            if gid is not None:
                os.chown(directory, -1, gid)
    except OSError as exc:
        raise ListenError(f"{directory}: cannot create socket directory ({exc.strerror})") from None
    _replace_stale(path)
    # The temporary name must fit in sun_path too; keep it short and in the same directory.
    temporary = os.path.join(directory, f".bb{os.getpid()}.tmp")
    if len(os.fsencode(temporary)) > MAX_SOCKET_PATH_BYTES:
        temporary = path + "~"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        sock.bind(temporary)
        try:
            os.chmod(temporary, mode)
            if gid is not None:
                os.chown(temporary, -1, gid)
            sock.listen(LISTEN_BACKLOG)
            os.rename(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        sock.close()
        raise ListenError(f"{path}: cannot bind socket ({exc.strerror})") from None
    except BaseException:
        sock.close()
        raise
    return sock


def bind_tcp_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` (port 0 picks a free one).

    This module does not judge the address: the one caller (the metrics listener) is
    handed a loopback address the config already checked (``[metrics] listen``).

    Raises:
        ListenError: ``"<host>:<port>: <reason>"`` (IPv6 hosts in brackets).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        # A restart must not wait out TIME_WAIT of the last scrape's connection.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenError(f"{where}: {exc.strerror or exc}") from None
    return sock


# --------------------------------------------------------------------------- the server


class _Answered:
    """Marker: the request was refused (404/405) and answered without a handler."""


_ANSWERED = _Answered()


class _Closed(Exception):
    """The connection is over (peer gone, protocol error already answered, or cut)."""


def _peer_credentials(sock: trio.socket.SocketType) -> tuple[int | None, int | None]:
    # Linux SO_PEERCRED: struct ucred { pid_t pid; uid_t uid; gid_t gid; }. Only a Unix
    # socket has a peer process to name: on TCP Linux answers pid 0 and uid -1, made-up
    # values, so a TCP peer's uid comes from the kernel's socket table (daemon/tcp_peer.py;
    # None when unknown) and its pid stays unknown.
    if sock.family != socket.AF_UNIX:
        return peer_uid(sock), None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None, None
    pid, uid, _gid_ = struct.unpack("3i", raw)
    return uid, pid


def _fold_scheme(value: bytes) -> bytes:
    """An Authorization value with its auth scheme (up to the first space) in lower case."""
    scheme, space, rest = value.partition(b" ")
    return scheme.lower() + space + rest


def _authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    values = [value for name, value in headers if name == b"authorization"]
    if not values:
        return None
    if len(values) > 1:
        return ""
    try:
        return values[0].decode("ascii")
    except UnicodeDecodeError:
        return ""


class ServerControl:
    """Handed out by `serve` through ``task_status.started``: stop it, and watch it."""

    def __init__(
        self,
        on_connections: Callable[[int], None] | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        limits = limits or HttpLimits()
        self._on_connections = on_connections
        #: Request body bytes in flight, per peer uid.
        self.budget = ByteBudget(limits.max_inflight_bytes)
        #: Open connections per peer uid.
        self.per_uid = ConnectionCounts(limits.max_connections_per_uid)
        #: Open connections per (peer uid, digest of the Authorization value).
        self.per_credential = (ConnectionCounts(limits.max_connections_per_credential)
                               if limits.max_connections_per_credential else None)
        #: Unexpected faults in connection tasks, rate-bounded.
        self.faults = FaultLog(_log, "connection_fault")
        #: Exceptions a handler raised instead of answering, rate-bounded.
        self.app_faults = FaultLog(_log, "application_error")
        #: Connections refused past their uid's cap, rate-bounded per uid.
        self.refusals = FaultLog(_log, "uid_connection_cap", level=logging.WARNING)
        #: TCP connections refused: uid unknown or not allowed, or a browser's request.
        self.tcp_refusals = FaultLog(_log, "tcp_refused", level=logging.WARNING)
        #: Accepts retried (out of descriptors): every ACCEPT_RETRY_SLEEP while it lasts.
        self.accept_retries = FaultLog(_log, "accept_retry", level=logging.WARNING)
        self._stop = trio.Event()
        #: When `stop` was first called: the drain's grace runs from here, so servers
        #: stopped together share one grace period, however late each one wakes.
        self._stopped_at = 0.0
        self._idle = trio.Event()
        self._idle.set()
        #: Connections open now.
        self.connections = 0
        #: Requests handed to a handler and not yet answered.
        self.in_flight = 0
        self._readers: set[trio.CancelScope] = set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop accepting, cut connections between requests, let in-flight requests finish."""
        if not self._stop.is_set():
            self._stopped_at = trio.current_time()
        self._stop.set()
        for scope in list(self._readers):
            scope.cancel()

    def _opened(self) -> None:
        self.connections += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        if self._on_connections is not None:
            self._on_connections(self.connections)

    def _closed(self) -> None:
        self.connections -= 1
        if self.connections == 0:
            self._idle.set()
        if self._on_connections is not None:
            self._on_connections(self.connections)


class _Connection:
    """One accepted connection: a loop of read request -> handler -> write answer."""

    def __init__(
        self,
        stream: trio.SocketStream,
        routes: Routes,
        limits: HttpLimits,
        control: ServerControl,
        peer: tuple[int | None, int | None],
        tcp_port: int | None = None,
    ) -> None:
        self.stream = stream
        #: The local port of a TCP connection (the Host it must name); None on a Unix socket.
        self.tcp_port = tcp_port
        #: The (peer uid, credential digest) this connection is counted under
        #: (`ServerControl.per_credential`).
        self.credential: tuple[int | None, bytes] | None = None
        self.routes = routes
        self.limits = limits
        self.control = control
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.peer_uid, self.peer_pid = peer
        #: Body bytes this connection holds of its uid's share (0 between requests).
        self.reserved = 0
        #: Of those, the ones not read yet: a read asks for no more (pipelined requests
        #: behind the body would sit in h11's buffer, outside the share).
        self.unread = 0
        #: The request being answered is HEAD: its answer goes without body bytes.
        self.head = False

    async def run(self) -> None:
        try:
            while not self.control.stopping:
                request = await self._read_with_deadline()
                if request is None:
                    return
                if isinstance(request, _Answered):
                    # Refused by routing and answered already; on to the next request.
                    if self.h11.our_state is h11.MUST_CLOSE:
                        return
                    self.h11.start_next_cycle()
                    continue
                self.control.in_flight += 1
                try:
                    answer = await self._call(*request)
                finally:
                    self.control.in_flight -= 1
                await self._respond(answer.status, answer.body, answer.content_type)
                self._release()
                if self.h11.our_state is h11.MUST_CLOSE or self.control.stopping:
                    return
                self.h11.start_next_cycle()
        except _Closed:
            return
        except Exception as exc:  # noqa: BLE001 - one connection's fault must not end serve
            self.control.faults.record(
                ("connection", type(exc).__name__),
                where="connection",
                exception=type(exc).__name__,
                peer_uid=self.peer_uid,
            )
            await self._answer_fault()
        finally:
            self._release()
            if self.credential is not None and self.control.per_credential is not None:
                self.control.per_credential.close(self.credential)
                self.credential = None
            with trio.move_on_after(0.5) as cleanup:
                cleanup.shield = True
                await self.stream.aclose()

    def _release(self) -> None:
        self.control.budget.release(self.peer_uid, self.reserved)
        self.reserved = self.unread = 0

    async def _answer_fault(self) -> None:
        """A bodiless 500 if a request was read and no response begun; else nothing."""
        if self.h11.our_state is not h11.SEND_RESPONSE:
            return
        try:
            await self._respond(500, None, close=True)
        except Exception:  # noqa: BLE001 - the connection is being closed either way
            pass

    async def _call(self, handler: Handler, request: HttpRequest) -> HttpAnswer:
        started = time.monotonic()
        try:
            answer = await handler(request)
            if not isinstance(answer, HttpAnswer):
                raise TypeError(f"handler returned {type(answer).__name__}, not HttpAnswer")
            return answer
        except Exception as exc:  # noqa: BLE001 - the transport's last resort, logged
            self.control.app_faults.record(
                (type(exc).__name__,),
                exception=type(exc).__name__,
                duration_ms=round((time.monotonic() - started) * 1000, 1),
            )
            return HttpAnswer(500, None)

    async def _read_with_deadline(self) -> tuple[Handler, HttpRequest] | _Answered | None:
        """The next request; `_ANSWERED` if it was refused here; None to end the connection."""
        with trio.CancelScope() as reader:
            reader.deadline = trio.current_time() + self.limits.request_timeout
            self.control._readers.add(reader)
            try:
                return await self._read_request()
            finally:
                self.control._readers.discard(reader)
        # Cut: by the deadline, or by a graceful stop.
        idle = self.h11.their_state is h11.IDLE and not self.h11.trailing_data[0]
        if not idle and not self.control.stopping:
            log_event(_log, "request_timeout", level=logging.DEBUG, peer_uid=self.peer_uid)
            await self._respond(408, None, close=True)
        return None

    async def _next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._protocol_error(exc)
                raise _Closed from None
            if event is not h11.NEED_DATA:
                return event
            size = max(HEAD_RECEIVE_SIZE, min(RECEIVE_SIZE, self.unread))
            try:
                data = await self.stream.receive_some(size)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise _Closed from None
            self.h11.receive_data(data)

    async def _protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        # A truncated message (peer closed mid-request) has nobody to answer.
        if self.h11.their_state is h11.ERROR and self.h11.trailing_data[1]:
            return
        status = exc.error_status_hint if exc.error_status_hint in _REASONS else 400
        log_event(_log, "bad_request", level=logging.DEBUG, status=status, peer_uid=self.peer_uid)
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._respond(status, None, close=True)

    async def _read_request(self) -> tuple[Handler, HttpRequest] | _Answered | None:
        self.head = False
        event = await self._next_event()
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise _Closed  # pragma: no cover - h11 yields Request first in state IDLE
        headers = list(event.headers)
        # 0. Header bytes. h11's max_incomplete_event_size only bounds a head that has not
        # arrived whole; a head that came in one read is measured here, as it was sent
        # (request line + "name: value\r\n" per field + the blank line).
        head_size = len(event.method) + len(event.target) + 12 + 2
        head_size += sum(len(name) + len(value) + 4 for name, value in headers)
        if head_size > self.limits.max_header_bytes:
            await self._respond(431, None, close=True)
            raise _Closed
        if event.http_version not in _VERSIONS:
            await self._respond(505, None, close=True)
            raise _Closed
        self.head = event.method == b"HEAD"
        # 0b. On TCP, what a browser could have sent goes no further (daemon/loopback_tcp.py):
        # no handler, no envelope, no audit record; the connection is closed. The answer's
        # body names the rule broken, in fixed words (`Refusal`).
        refusal = browser_refusal(headers, self.tcp_port) if self.tcp_port is not None else None
        if refusal is not None:
            self.control.tcp_refusals.record(("browser", refusal.name), reason=refusal.name.lower(),
                                             peer_uid=self.peer_uid)
            await self._respond(403, refusal.value, "text/plain", close=True)
            raise _Closed
        # 1. Route. No refusal carries a body, so a bodiless request keeps its connection.
        route = self.routes.find(event.method, event.target)
        length_text = next((v for n, v in headers if n == b"content-length"), None)
        chunked = any(n == b"transfer-encoding" for n, _ in headers)
        has_body = chunked or (length_text is not None and int(length_text) > 0)
        if isinstance(route, _Refusal):
            extra = list(route.headers)
            if has_body:
                await self._respond(route.status, None, extra=extra, close=True)
                raise _Closed
            await self._next_event()  # the EndOfMessage of a bodiless request
            await self._respond(route.status, None, extra=extra)
            return _ANSWERED
        # 1b. Count the connection under the credential it carries (the first one, or a new
        # one on a kept-alive connection); past that credential's cap, 503 and close.
        if not await self._count_credential(headers):
            raise _Closed
        # 2. A declared length over the limit: refused before reading (or inviting) the body.
        if length_text is not None and int(length_text) > self.limits.max_body_bytes:
            await self._respond(413, None, close=True)
            raise _Closed
        # 3. Reserve the body's bytes of this uid's share; until they fit, read nothing.
        if has_body:
            size = self.limits.max_body_bytes if chunked or length_text is None else int(length_text)
            await self.control.budget.reserve(self.peer_uid, size)
            self.reserved = self.unread = size
        # 4. Only now tell an "Expect: 100-continue" client to send the body.
        if self.h11.they_are_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, headers=[]))
        # 5. The body, counted as it arrives (chunked bodies have no declared length).
        body = bytearray()
        events = 0
        while True:
            part = await self._next_event()
            if isinstance(part, h11.Data):
                events += 1
                if events % BODY_EVENTS_PER_CHECKPOINT == 0:
                    # Let every other connection run: one body must not hold the loop.
                    await trio.lowlevel.checkpoint()
                body += part.data
                self.unread = max(0, self.reserved - len(body))
                if len(body) > self.limits.max_body_bytes:
                    await self._respond(413, None, close=True)
                    raise _Closed
            elif isinstance(part, h11.EndOfMessage):
                break
            else:
                raise _Closed  # pragma: no cover - h11 yields only Data/EndOfMessage here
        return route, HttpRequest(
            body=bytes(body),
            authorization=_authorization(headers),
            peer_uid=self.peer_uid,
            peer_pid=self.peer_pid,
            over_tcp=self.tcp_port is not None,
        )

    async def _count_credential(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Move this connection under the credential its request carries; False if refused.

        Keyed by a digest, never the value (memory holds no credential); a request without
        Authorization keeps the connection where it was. The auth scheme is case-insensitive
        (RFC 9110 11.1), so it is folded first: every spelling of one credential is one key.
        The peer's uid is part of the key: a credential can leak to another local user (a
        log, a shared file), and that uid, which can never authenticate with a uid-bound
        credential, must not fill its owner's share. Unknown uids (None) share one key per
        credential, as they share one per-uid count.
        """
        counts = self.control.per_credential
        value = [_fold_scheme(v) for n, v in headers if n == b"authorization"]
        if counts is None or not value:
            return True
        key = (self.peer_uid, hashlib.sha256(b"\n".join(value)).digest())
        if key == self.credential:
            return True
        if self.credential is not None:
            counts.close(self.credential)
            self.credential = None
        if not counts.try_open(key):
            self.control.refusals.record(("credential",), peer_uid=self.peer_uid,
                                         cap=self.limits.max_connections_per_credential)
            await self._respond(503, None, close=True)
            return False
        self.credential = key
        return True

    async def _respond(
        self,
        status: int,
        body: bytes | None,
        content_type: str = "application/json",
        *,
        extra: list[tuple[bytes, bytes]] | None = None,
        close: bool = False,
    ) -> None:
        headers: list[tuple[bytes, bytes]] = list(extra or [])
        payload = body or b""
        if body is not None:
            headers.append((b"Content-Type", content_type.encode("ascii")))
        headers.append((b"Content-Length", str(len(payload)).encode("ascii")))
        if close or self.control.stopping or not self.limits.keep_alive:
            headers.append((b"Connection", b"close"))
        reason = _REASONS.get(status, b"")
        events: list[h11.Event] = [h11.Response(status_code=status, headers=headers, reason=reason)]
        # HEAD: the headers a GET would get (Content-Length included), never the bytes.
        if payload and not self.head:
            events.append(h11.Data(data=payload))
        events.append(h11.EndOfMessage())
        # One write for the whole answer: a head and a body written apart are two
        # segments, and the second may wait for the first one's (delayed) ACK.
        await self._send(*events)

    async def _send(self, *events: h11.Event) -> None:
        try:
            data = b"".join(self.h11.send(event) or b"" for event in events)
        except h11.LocalProtocolError:
            raise _Closed from None  # the state machine refuses: nothing sane left to send
        if not data:
            return
        # The same deadline as reading: a client that never reads cannot hold the task.
        with trio.move_on_after(self.limits.request_timeout) as scope:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.h11.send_failed()
                raise _Closed from None
            except BaseException:
                self.h11.send_failed()
                raise
        if scope.cancelled_caught:
            self.h11.send_failed()
            raise _Closed


async def serve(
    routes: Routes,
    listener: socket.socket | str,
    limits: HttpLimits,
    *,
    socket_mode: int = 0o660,
    socket_group: str | None = None,
    on_connections: Callable[[int], None] | None = None,
    admit: Callable[[int | None], Awaitable[bool]] | None = None,
    task_status: trio.TaskStatus[ServerControl] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the `routes` table on `listener` until stopped.

    Args:
        routes: which handler answers which (method, path); anything else is 404/405.
        listener: a listening stream socket (AF_UNIX from socket activation, or TCP from
            `bind_tcp_socket`), or a path to bind with `bind_unix_socket` (then removed
            again when `serve` returns, if it is still the socket we bound).
        limits: transport bounds.
        socket_mode, socket_group: permissions of a socket bound from a path.
        on_connections: called with the number of open connections whenever it changes
            (the metrics gauge).
        admit: on a TCP listener, which peer uids (daemon/tcp_peer.py; None = unknown) may
            connect, asked in the connection's task (so a slow user database holds up only
            that connection); a refused one gets a 403 (`Refusal.UID`) before a byte is
            read, one not decided within ``limits.request_timeout`` a 503 (`UNDECIDED_BODY`:
            the same uid is admitted once its lookup answers, so a client may retry it).
            None admits every peer (the metrics listener). Every TCP listener also refuses what a
            browser could send (daemon/loopback_tcp.py).
        task_status: ``started(control)`` once the socket is listening.

    Returns:
        After `ServerControl.stop()` and the drain (up to ``limits.shutdown_grace``).

    Raises:
        ListenError: the socket could not be bound (before `started`).

    Cancellation:
        Cancelling `serve` is the hard stop: every connection and in-flight request is
        cancelled at once.

    Resource handling:
        Every connection's stream is closed by its task; the listener is closed, and a
        socket file this call created is unlinked, before it returns.
    """
    bound_path: str | None = None
    if isinstance(listener, str):
        raw = bind_unix_socket(listener, mode=socket_mode, group=socket_group)
        bound_path = os.path.abspath(listener)
    else:
        raw = listener
    bound_inode = os.stat(bound_path).st_ino if bound_path else None
    sock = trio.socket.from_stdlib_socket(raw)
    tcp = raw.family in (socket.AF_INET, socket.AF_INET6)
    control = ServerControl(on_connections, limits)
    slots = trio.Semaphore(limits.max_connections)
    try:
        async with trio.open_nursery() as nursery:
            accept_scope = trio.CancelScope()

            async def connection(stream: trio.SocketStream,
                                 peer: tuple[int | None, int | None]) -> None:
                uid = peer[0]
                # Counted under its uid first, before the allow-list is asked: a connection
                # waiting on the user database is open, and one uid must not hold every
                # global slot while lookups are slow.
                counted = control.per_uid.try_open(uid)
                try:
                    if not counted:
                        control.refusals.record(("uid", uid), peer_uid=uid,
                                                cap=limits.max_connections_per_uid)
                        await refuse(stream, _TOO_MANY_FROM_UID)
                    elif not (verdict := await admitted(uid)):
                        # Keyed by the reason too: one must not hide the other for a minute.
                        reason = "not allowed" if verdict is False else "undecided"
                        control.tcp_refusals.record(("uid", uid, reason), peer_uid=uid,
                                                    reason=reason)
                        await refuse(stream, _NOT_ADMITTED if verdict is False else _UNDECIDED)
                    else:
                        port = stream.socket.getsockname()[1] if tcp else None
                        await _Connection(stream, routes, limits, control, peer, port).run()
                finally:
                    await trio.aclose_forcefully(stream)  # refused, or cancelled: ours to close
                    if counted:
                        control.per_uid.close(uid)
                    control._closed()
                    slots.release()

            async def admitted(uid: int | None) -> bool | None:
                """The allow-list's verdict; None: not decided within request_timeout."""
                if not tcp or admit is None:
                    return True
                # The allow-list may need the user database, which can block: it is asked
                # in the connection's own task, never in the accept loop.
                try:
                    with trio.fail_after(limits.request_timeout):
                        return await admit(uid)
                except trio.TooSlowError:
                    return None  # a user database that does not answer admits nobody

            async def refuse(stream: trio.SocketStream, answer: bytes) -> None:
                try:
                    with trio.move_on_after(_REFUSE_WRITE_SECONDS):
                        await stream.send_all(answer)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            async def accept_loop() -> None:
                with accept_scope:
                    while True:
                        await slots.acquire()
                        try:
                            conn, _ = await sock.accept()
                        except OSError as exc:
                            slots.release()
                            if exc.errno in _ACCEPT_RETRY_ERRNOS:
                                control.accept_retries.record((exc.errno,), errno=exc.errno)
                                await trio.sleep(ACCEPT_RETRY_SLEEP)
                                continue
                            raise
                        except BaseException:
                            slots.release()
                            raise
                        control._opened()
                        if tcp:
                            _size_send_buffer(conn)
                        peer = _peer_credentials(conn)
                        nursery.start_soon(connection, trio.SocketStream(conn), peer)

            nursery.start_soon(accept_loop)
            task_status.started(control)
            await control._stop.wait()
            accept_scope.cancel()
            sock.close()  # new clients now get ECONNREFUSED instead of waiting in the backlog
            with trio.move_on_at(control._stopped_at + limits.shutdown_grace):
                await control._idle.wait()
            if control.connections:
                log_event(_log, "drain_deadline", level=logging.WARNING, cut=control.connections)
            nursery.cancel_scope.cancel()
    finally:
        sock.close()
        if bound_path is not None:
            unlink_if_ours(bound_path, bound_inode)
