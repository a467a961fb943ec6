"""The rules of a loopback TCP listener: which port may be served, who may connect, and
which requests a browser could have sent.

Why: a loopback port is reachable by every local user and by every page in a browser on
the host, none of which the Unix socket's mode keeps out. Buzz's own agents can only
reach a base URL (../shared/spec/buzz-client.md), so [server] listen_tcp serves the action
API there too, under these rules (docs/configuration.md, docs/install.md):

- **Squatting.** Any local user can bind a free port first and collect the credentials
  agents send to it. A port is served only if nobody else could have held it: a socket
  systemd passed (it bound it before any user could), a port below the kernel's
  ``net.ipv4.ip_unprivileged_port_start`` (1024 unless lowered: binding one needs
  privilege; none where the sysctl cannot be read), or the operator's explicit
  ``listen_tcp_accept_squatting_risk = true``. And a port served on one loopback only has
  its other one held unlistened while the daemon runs (daemon/cli/serve.py
  `hold_siblings`): `localhost` names both.
  ``[metrics] listen`` is under the same rule with its own opt-in,
  ``listen_accept_squatting_risk``, and its own socket unit (`ListenerKind`: one per key).
- **Who.** The peer's uid comes from the kernel (daemon/tcp_peer.py); it must be in
  ``tcp_allow_uids`` or a member (primary or supplementary) of a group in
  ``tcp_allow_groups``. An unknown uid is refused. Checked before a byte is read.
- **Browsers.** A request must carry exactly one ``Host`` naming ``127.0.0.1:P``,
  ``[::1]:P`` or ``localhost:P`` for the port it arrived on (a DNS-rebinding page names
  its own host; on port 80, the port an HTTP client leaves out, the name alone too), and
  none of ``Origin``, ``Sec-Fetch-*``, ``Upgrade`` (every browser sends one of them on a
  cross-site request; no agent does, but Node's built-in ``fetch`` sends
  ``Sec-Fetch-Mode`` on every request, so it cannot be used here). Anything else is a 403
  before routing: never judged, never audited; no CORS header is ever sent. The metrics
  TCP listener has the same rule.
- **What a 403 says.** Its ``text/plain`` body is one fixed line of ours naming the rule
  that refused (`Refusal`): an integrator whose HTTP client adds a browser's header learns
  which rule to read instead of seeing an empty answer it may take for a lost one and
  retry for ever. Nothing the client sent is echoed (no Host, no Origin). Which page can
  read it: a cross-origin one cannot (no CORS header); a DNS-rebinding page, same-origin
  with its own 403, can, and learns only which of these fixed lines applied, which the
  rule's public documentation says already.

Pure functions over values, plus the two lookups they need (the user database for group
membership, the sysctl for the privileged port range). The user database may be a network
service (LDAP, sssd) that blocks: `AdmissionGate` asks it in worker threads and keeps each
uid's verdict for `MEMBERSHIP_TTL` seconds; an admitted uid's verdict is then served for up
to `MEMBERSHIP_STALE` more while it is asked again in the background.
"""

from __future__ import annotations

import enum
import grp
import logging
import os
import pwd
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import trio

from daemon.fault_log import FaultLog

__all__ = [
    "TcpAdmission",
    "AdmissionGate",
    "MEMBERSHIP_TTL",
    "MEMBERSHIP_STALE",
    "Refusal",
    "browser_refusal",
    "HTTP_DEFAULT_PORT",
    "unprivileged_port_start",
    "port_holder",
    "HELD_BY_SYSTEMD",
    "PRIVILEGED_PORT",
    "operator_accepted",
    "address_text",
    "ListenerKind",
]

#: Why a port may be served (what `serve.tcp`, `check-config` and `status` print).
HELD_BY_SYSTEMD = "held by systemd (socket activation)"
PRIVILEGED_PORT = "a privileged port (only root can bind it first)"

#: Headers only a browser (or a page's WebSocket) sends: any one of them is refused.
_BROWSER_HEADERS = (b"origin", b"upgrade")
_BROWSER_PREFIX = b"sec-fetch-"
#: The names a request's Host may give the listener: the literals it binds
#: (daemon/config.py `TCP_HOSTS`), and `localhost`, which names both. A DNS-rebinding page
#: sends its own hostname, never one of these.
_LOOPBACK_HOSTS: Final = (b"127.0.0.1", b"[::1]", b"localhost")
#: The port an ``http`` URI means when it names none (RFC 9110 §4.2.1). Clients leave it
#: out of Host (§4.2.3, §7.2: given ``http://127.0.0.1/``, curl and Buzz's own transport
#: send ``Host: 127.0.0.1``), so a listener on it also takes the bare names. No weaker
#: against rebinding: they are the same loopback names, and a page sends its own.
HTTP_DEFAULT_PORT: Final = 80
#: Host spellings without a port, by the port they mean.
_DEFAULT_PORT_SPELLINGS: Final = {HTTP_DEFAULT_PORT: frozenset(_LOOPBACK_HOSTS)}
_SYSCTL = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
#: Seconds a uid's group verdict is fresh, counted from when the database was asked: a
#: group joined counts within this, and a group left too while the database answers.
MEMBERSHIP_TTL: Final = 5.0
#: Seconds past `MEMBERSHIP_TTL` an admission is still served while its background re-check
#: is pending, so an admitted uid never waits on the database (nor behind other uids'
#: lookups). The bound on fail-closed: a uid removed from the groups is refused at most
#: MEMBERSHIP_TTL + MEMBERSHIP_STALE seconds later, however slow the database.
MEMBERSHIP_STALE: Final = 25.0
#: uids whose verdicts are kept, per verdict (admitted, refused): the least recently used
#: goes first, and refused uids, however many, never push an admitted one out.
_MEMBERSHIP_ENTRIES: Final = 1024
#: Lookups of uids without a usable verdict at once: a stalled directory service ties up
#: at most these threads, shared by every such uid.
_LOOKUP_THREADS: Final = 4
#: Background re-checks of admitted uids at once, on threads of their own: the uids
#: waiting on `_LOOKUP_THREADS` (any local user can bring many) never delay them.
_REFRESH_THREADS: Final = 2

_log = logging.getLogger("buzz_broker.loopback_tcp")


def _accepted_hosts(port: int) -> frozenset[bytes]:
    """Every ``Host`` value that names the listener on `port`: a loopback name with the
    port, and on `HTTP_DEFAULT_PORT` also without it."""
    with_port = {b"%s:%d" % (name, port) for name in _LOOPBACK_HOSTS}
    return frozenset(with_port | _DEFAULT_PORT_SPELLINGS.get(port, frozenset()))


class Refusal(enum.Enum):
    """Why a loopback TCP listener answered 403; each value is that answer's whole
    ``text/plain`` body (docs/protocol.md §1 quotes them). Fixed words, never a byte the
    client sent."""

    #: The peer's uid is not in ``tcp_allow_uids``/``tcp_allow_groups``, or is unknown.
    UID = b"refused: this user may not connect to this listener\n"
    #: No Host (HTTP/1.0; h11 answers 400 to HTTP/1.1 without one, or to two), or one
    #: that is not the listener's own loopback name and port.
    HOST = (b"refused: Host is not this listener's "
            b"(127.0.0.1:PORT, [::1]:PORT or localhost:PORT)\n")
    #: An ``Origin``, ``Sec-Fetch-*`` or ``Upgrade`` header. Node's built-in fetch (undici)
    #: sends ``Sec-Fetch-Mode: cors`` on every request, so the line names it.
    BROWSER = (b"refused: a browser's request (Origin, Sec-Fetch-* or Upgrade header; "
               b"Node's built-in fetch always sends Sec-Fetch-Mode)\n")


def browser_refusal(headers: Sequence[tuple[bytes, bytes]], port: int) -> Refusal | None:
    """Which rule a request's headers (lowercase names, as h11 gives them) break, if any:
    the Host rule first (a rebound page breaks it whatever else it sends), then the
    browser headers."""
    hosts = [value for name, value in headers if name == b"host"]
    if len(hosts) != 1 or hosts[0].lower() not in _accepted_hosts(port):
        return Refusal.HOST
    if any(name in _BROWSER_HEADERS or name.startswith(_BROWSER_PREFIX) for name, _ in headers):
        return Refusal.BROWSER
    return None


def unprivileged_port_start() -> int:
    """The lowest port any user may bind (the sysctl), or 0 where it cannot be read.

    0, not the kernel's default 1024: unread, the range may have been lowered, and then a
    low port is as squattable as any. The shipped unit hides /proc/sys (`ProcSubset=pid`)
    and drops CAP_NET_BIND_SERVICE, so under it the daemon binds a port below 1024 itself
    only where the sysctl was lowered: such a port must be systemd's, or opted in."""
    try:
        with open(_SYSCTL, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def address_text(host: str, port: int) -> str:
    """``127.0.0.1:9464`` / ``[::1]:9464``: a listener's address as config and Host name it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def operator_accepted(opt_in: str) -> str:
    """Why a port nobody holds may be served: the operator set `opt_in` (the key's name)."""
    return f"unheld: the operator accepted the squatting risk ({opt_in})"


@dataclass(frozen=True, slots=True)
class ListenerKind:
    """A config key whose loopback TCP addresses the daemon serves, and what its squatting
    rule says about them (daemon/config.py has one per key)."""

    #: the key as the config names it, e.g. ``[server] listen_tcp``
    key: str
    #: the key in the same section whose ``true`` accepts the risk of an unheld port
    opt_in: str
    #: the socket unit that holds the key's ports under systemd
    unit: str
    #: what a local user who bound the port first could do
    risk: str

    def holder(self, port: int, *, held: bool, accept_risk: bool) -> str | None:
        """`port_holder` under this key's opt-in."""
        return port_holder(port, held=held, accept_risk=accept_risk, opt_in=self.opt_in)

    def refusal(self, host: str, port: int) -> str:
        """Why `serve` refuses an address systemd did not pass and nothing else allows."""
        return (f"{self.key} {address_text(host, port)}: port {port} is not held for the "
                f"daemon (systemd did not pass it, and any local user may bind it first and "
                f"{self.risk}); let {self.unit} hold it, or set {self.opt_in} = true")

    def rule(self, port: int, *, accept_risk: bool) -> str:
        """What `check-config` says of a port before the start: whether systemd holds it
        is known only then (the fd it passes), so each case is spelled out."""
        unheld = self.holder(port, held=False, accept_risk=accept_risk)
        if unheld is None:
            return (f"served only if systemd passes it ({self.unit}); otherwise serve "
                    "refuses it: any local user could bind it first")
        if unheld == PRIVILEGED_PORT:
            return f"served: {PRIVILEGED_PORT}"
        return f"{HELD_BY_SYSTEMD} if passed, else {unheld}"


def port_holder(port: int, *, held: bool, accept_risk: bool, opt_in: str) -> str | None:
    """Why `port` may be served, or None when it may not (the module's squatting rule).

    `opt_in` names the key whose ``true`` is `accept_risk` ([server]
    listen_tcp_accept_squatting_risk, [metrics] listen_accept_squatting_risk): the reason
    says which one let the port be served."""
    if held:
        return HELD_BY_SYSTEMD
    if 0 < port < unprivileged_port_start():
        return PRIVILEGED_PORT
    if accept_risk:
        return operator_accepted(opt_in)
    return None


@dataclass(frozen=True, slots=True)
class TcpAdmission:
    """Which peer uids may connect over TCP: ``tcp_allow_uids`` and ``tcp_allow_groups``."""

    uids: frozenset[int]
    #: The groups as the config names them (names or numeric gids), resolved per check:
    #: a group created or joined after start counts without a restart.
    groups: frozenset[str]

    def _gids(self) -> set[int]:
        gids = set()
        for group in self.groups:
            if group.isdigit():
                gids.add(int(group))
                continue
            try:
                gids.add(grp.getgrnam(group).gr_gid)
            except KeyError:
                pass  # a group that does not exist admits nobody
        return gids

    def without_lookup(self, uid: int | None) -> bool | None:
        """The verdict where the user database is not needed, else None."""
        if uid is None:
            return False
        if uid in self.uids:
            return True
        if not self.groups:
            return False
        return None

    def admits(self, uid: int | None) -> bool:
        """True for a known uid on the list or in one of the groups; never for None.

        Blocking: it may ask the user database (`AdmissionGate` calls it off the loop)."""
        quick = self.without_lookup(uid)
        if quick is not None:
            return quick
        assert uid is not None
        try:
            user = pwd.getpwuid(uid)
            member_of = set(os.getgrouplist(user.pw_name, user.pw_gid))
        except (KeyError, OSError):
            return False  # a uid without a user has no groups
        return bool(member_of & self._gids())


class _Lookup:
    """One uid's lookup under way: its connections wait for it rather than ask again."""

    __slots__ = ("done", "verdict")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.verdict: bool | None = None  # None: cut before it answered


class AdmissionGate:
    """`TcpAdmission` for the accept path: lookups in worker threads, verdicts kept a while.

    Why: with ``tcp_allow_groups`` set, each new peer needs the user database, and a slow
    one (a directory service) must not stall the listener for everyone else; a fleet of
    one uid reconnecting pays the lookup once per `MEMBERSHIP_TTL`, not per connection.
    One lookup per uid at a time, the uid's other connections waiting for its verdict: a
    burst of one user's connections would otherwise queue a lookup each on the
    `_LOOKUP_THREADS` threads, ahead of every other uid's.

    An admitted uid is re-checked in the background (`_REFRESH_THREADS`) while its verdict
    is served for `MEMBERSHIP_STALE` more seconds: one local user can own many uids
    (subordinate uids of rootless containers) that the database is slow to miss, and they
    would keep the shared lookup threads busy; a re-check queued behind them would turn an
    admitted agent away at ``request_timeout``. A uid with no usable verdict still waits
    for the shared threads: nothing tells a new agent's uid from theirs before the lookup.
    """

    def __init__(self, admission: TcpAdmission, *, nursery: trio.Nursery,
                 ttl: float = MEMBERSHIP_TTL, stale: float = MEMBERSHIP_STALE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._admission = admission
        #: owns the background re-checks: the caller cancels it once serving has ended
        self._nursery = nursery
        #: how long each verdict is served, from when the database was asked: a refusal
        #: only while fresh, an admission `stale` longer while its re-check is pending
        self._serve_for = {True: ttl + stale, False: ttl}
        self._ttl = ttl
        self._clock = clock
        #: when each uid's kept verdict was asked, one table per verdict (`_keep`)
        self._kept: dict[bool, OrderedDict[int, float]] = {True: OrderedDict(),
                                                             False: OrderedDict()}
        self._limiter = trio.CapacityLimiter(_LOOKUP_THREADS)
        self._refresh_limiter = trio.CapacityLimiter(_REFRESH_THREADS)
        #: at most one per uid connected at once, so bounded by the connection caps
        self._lookups: dict[int, _Lookup] = {}
        #: uids with a background re-check under way (at most `_REFRESH_THREADS`)
        self._refreshing: set[int] = set()
        #: re-checks that raised (not a refusal: `admits` answers those), rate-bounded
        self.recheck_faults = FaultLog(_log, "admission_recheck_fault")

    async def __call__(self, uid: int | None) -> bool:
        quick = self._admission.without_lookup(uid)
        if quick is not None:
            return quick
        assert uid is not None
        while True:
            kept = self._served(uid)
            if kept is not None:
                return kept
            under_way = self._lookups.get(uid)
            if under_way is None:
                break
            await under_way.done.wait()
            if under_way.verdict is not None:
                return under_way.verdict
            # cut by its own connection's deadline: ask again (this connection's turn)
        lookup = self._lookups[uid] = _Lookup()
        asked = self._clock()
        try:
            # abandon_on_cancel: a lookup that never returns must not hold the connection's
            # task (the caller's deadline) or a graceful stop; its thread is left to finish
            # and holds its limiter token until then, so stuck threads stay bounded.
            verdict = await trio.to_thread.run_sync(
                self._admission.admits, uid, limiter=self._limiter, abandon_on_cancel=True)
            lookup.verdict = verdict
        finally:
            del self._lookups[uid]
            lookup.done.set()
        self._keep(uid, asked, verdict)
        return verdict

    def _served(self, uid: int) -> bool | None:
        """The kept verdict still to be served, else None; an admission past its TTL starts
        its re-check."""
        now = self._clock()
        for verdict, table in self._kept.items():
            asked = table.get(uid)
            if asked is not None and now < asked + self._serve_for[verdict]:
                table.move_to_end(uid)  # least recently used goes first
                if now >= asked + self._ttl:
                    self._refresh(uid)
                return verdict
        return None

    def _keep(self, uid: int, asked: float, verdict: bool) -> None:
        """Keep `verdict`, unless a verdict asked later is kept already (a re-check and a
        lookup may answer out of order: the later question wins)."""
        if any(table.get(uid, asked) > asked for table in self._kept.values()):
            return
        self._kept[not verdict].pop(uid, None)
        table = self._kept[verdict]
        table[uid] = asked
        table.move_to_end(uid)
        while len(table) > _MEMBERSHIP_ENTRIES:
            table.popitem(last=False)

    def _refresh(self, uid: int) -> None:
        """Start `uid`'s background re-check, unless one is under way or all its threads are
        busy (the next connection tries again; the admission ages out meanwhile)."""
        if uid in self._refreshing or len(self._refreshing) >= _REFRESH_THREADS:
            return
        self._refreshing.add(uid)
        # The connection that noticed the age goes on at once; a stop cancels the re-check
        # with the gate's nursery (its thread is abandoned, as a lookup's is).
        self._nursery.start_soon(self._recheck, uid, self._clock(),
                                 name=f"admission re-check of uid {uid}")

    async def _recheck(self, uid: int, asked: float) -> None:
        try:
            verdict = await trio.to_thread.run_sync(
                self._admission.admits, uid, limiter=self._refresh_limiter,
                abandon_on_cancel=True)
        except Exception as exc:  # noqa: BLE001 - raised here, it would end the serving nursery
            # unanswered, the admission ages out and the uid's next connection looks it up
            self.recheck_faults.record((type(exc).__name__,), peer_uid=uid,
                                       error=type(exc).__name__)
            return
        finally:
            self._refreshing.discard(uid)
        self._keep(uid, asked, verdict)
