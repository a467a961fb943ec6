"""`buzz-broker serve`: the daemon in the foreground, as systemd (Type=notify) runs it.

Startup, in order (each fault is one line on stderr and a non-zero exit, no traceback):

1. read the config (`--config`, else ``$BUZZ_BROKER_CONFIG``, else defaults) and set up
   JSON logging on stderr at [log] level;
2. lock memory with ``mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT)`` so unsealed keys are
   never swapped out - only where it is safe (below), else a warning and carry on;
3. take the listening sockets: those systemd passed (``LISTEN_FDS``/``LISTEN_PID``, from
   fd 3: the agents' Unix socket, and TCP ones told apart by address, [server] listen_tcp's
   or [metrics] listen's) or bind [server] socket, then the TCP addresses systemd did not
   pass, under the squatting rule (`tcp_listeners`), and hold the other loopback of a
   port served on one only (`hold_siblings`). Binding comes before the token:
   clients that connect early wait in the backlog, and a socket fault is reported before a
   slow token login;
4. open the application (`daemon.wiring.running`: custody logs into the token and
   finds the KEK, the stores and the relay pool open) - `StartupError` is one line, and a
   stop signal meanwhile abandons the start (Signals, below);
5. bind the [metrics] socket (if set; a taken one is one line),
   serve HTTP on every socket with `daemon.http.serve` (agents: `action_routes`; metrics:
   `daemon.metrics.scrape_routes` under its `SCRAPE_LIMITS`), then send ``READY=1`` and a
   ``STATUS=`` line; ping ``WATCHDOG=1`` from the event loop at half of
   ``WATCHDOG_USEC`` (a wedged loop stops the pings and systemd restarts us).

Signals: one receiver for SIGTERM, SIGINT and SIGHUP is open for all of `run_server`,
from before the socket is bound until after it is removed, and one task (`_Signals.take`)
reads it; what a signal does depends on the phase (`_ON_SIGNAL`):

- serving: SIGTERM/SIGINT -> ``STOPPING=1``, the socket and every TCP listener stop
  accepting and drain their in-flight requests within one [server] shutdown_grace, then
  the application closes (its flushes, the ledger anchor, the stores) and the socket is
  removed. SIGHUP -> ``RELOADING=1`` (with ``MONOTONIC_USEC``, which systemd 253's
  Type=notify-reload requires; 252 ignores it), ``app.reload()`` (credentials and policy)
  while connections stay open, then ``READY=1`` with a ``STATUS=`` line saying what became
  of the file (`_reloaded`: reloaded; reloaded, restart to apply the settings named; or
  rejected); a failed reload is logged and the running state kept (READY=1 still follows:
  the daemon serves on).
- starting (before ``READY=1``: the token login may take a while): SIGTERM/SIGINT ->
  ``STOPPING=1``, ``serve.start_abandoned``, the start is cancelled (what it opened is
  closed) and the socket removed. SIGHUP -> kept, and the reload runs once serving.
- stopping: every signal is logged (``serve.signal_ignored``) and changes nothing: the
  drain is already bounded by shutdown_grace, and what follows it (the application's
  close) must run to its end. The service manager's SIGKILL remains the way to cut it.

Either way a stop asked by SIGTERM or SIGINT exits `EXIT_STOPPED` (0), also when the
grace cut requests (logged ``drain_deadline``): the stop was the one asked for and nothing
is left open. Why one receiver: trio re-raises, when a receiver closes, every signal still
queued in it with the handler that was there before (SIG_DFL for SIGTERM and SIGHUP), so a
receiver closed right after the first stop signal turned a second one during the drain
into a kill before anything was closed.

One daemon per state directory: `run_server` holds an exclusive flock on
``<state>/serve.lock`` (holding its pid) while it runs; a second `serve` is refused, and
`buzz-broker status` reads the lock to tell "running" without connecting to the agents'
socket (which would start the service through socket activation).

Memory locking: with ``MCL_FUTURE`` every later mapping counts against ``RLIMIT_MEMLOCK``
- its whole size, not the pages in use (malloc arenas, thread stacks) - and a mapping past
the limit fails, which CPython reports as MemoryError wherever it happens to allocate. No
finite limit can be derived for that: the address space CPython and glibc map is not
bounded by our configuration, only the bytes we hold are. (Issue 13 measured it: under
``LimitMEMLOCK=256M`` a burst of held request bodies ended the daemon with MemoryError.)
And CPython cannot lock only the bytes that hold a secret (they are copied through
interpreter buffers). So we lock *all* memory, but only where no limit can turn a burst
into MemoryError: ``RLIMIT_MEMLOCK`` unlimited (the unit sets ``LimitMEMLOCK=infinity``)
or CAP_IPC_LOCK (which lifts the limit). Under any finite limit we skip and log
``serve.mlock_skipped``. ``MCL_ONFAULT`` locks pages as they are touched instead of
populating every mapping at once, so locking adds nothing to the resident set (a thread's
whole stack is not made resident); where the kernel lacks it (before 4.4, EINVAL) we lock
without it. What bounds the memory then is the configuration ([server]
max_inflight_bytes, max_connections_per_uid, the relay and read-page byte bounds), proven
by tests/adversarial/test_memory_attack.py under ``RLIMIT_MEMLOCK=infinity`` with the
lock taken.

`run_server` is the testable core: the application factory, the environment (for
``NOTIFY_SOCKET``, ``LISTEN_FDS``, ``WATCHDOG_USEC``) and the memory locker are parameters.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import enum
import errno
import functools
import logging
import os
import resource
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from daemon import notify
from daemon.cli._common import CliError, config_from_args
from daemon.config import (ACTION_TCP, METRICS_TCP, Config, ConfigError, Reread, load_config,
                           require_relay)
from daemon.loopback_tcp import AdmissionGate, ListenerKind, TcpAdmission, address_text
from daemon.http import (
    HttpAnswer,
    HttpLimits,
    HttpRequest,
    ListenError,
    ServerControl,
    action_routes,
    bind_tcp_socket,
    bind_unix_socket,
    unlink_if_ours,
    serve,
)
from daemon.log import log_event, setup_logging
from daemon.metrics import SCRAPE_LIMITS, Metrics, scrape_routes
from daemon.state.runlock import RunLock, RunLockHeld

__all__ = [
    "HELP",
    "EXIT_STOPPED",
    "add_arguments",
    "run",
    "run_server",
    "ReloadableApplication",
    "MemoryLock",
    "lock_memory",
]

HELP = "run the daemon: serve agents on the Unix socket until SIGTERM"

_log = logging.getLogger("buzz_broker.serve")

#: Linux <sys/mman.h> (x86, arm, riscv; not powerpc/sparc/alpha, which we do not ship on).
MCL_CURRENT = 1
MCL_FUTURE = 2
MCL_ONFAULT = 4

#: CAP_IPC_LOCK's bit in /proc/self/status CapEff (linux/capability.h).
_CAP_IPC_LOCK = 14

#: `serve`'s status once SIGTERM or SIGINT stopped it in order: drained (or cut at
#: [server] shutdown_grace), or its start abandoned. SIGINT too: for a daemon Ctrl-C is
#: the stop it asked for, not an interruption (docs/operations.md, "Exit codes").
EXIT_STOPPED: Final = 0


class ReloadableApplication(Protocol):
    """What `run_server` serves: an `Application` that can also reload (SIGHUP)."""

    async def handle(self, request: HttpRequest) -> HttpAnswer: ...

    def reload(self) -> Reread: ...


AppFactory = Callable[[Config], AbstractAsyncContextManager[ReloadableApplication]]


@dataclass(frozen=True, slots=True)
class MemoryLock:
    """What `lock_memory` did: ``locked``, or why not (an errno name or a limit)."""

    locked: bool
    reason: str


def _has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def lock_memory() -> MemoryLock:
    """``mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT)`` when no limit can make it fail
    later (see the module docstring)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and not _has_cap_ipc_lock():
        return MemoryLock(
            False,
            f"RLIMIT_MEMLOCK is {soft} bytes; locking all future memory under a finite "
            "limit turns a burst into MemoryError, so it needs an unlimited RLIMIT_MEMLOCK",
        )
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT)
        if result != 0 and ctypes.get_errno() == errno.EINVAL:
            result = libc.mlockall(MCL_CURRENT | MCL_FUTURE)  # a kernel without MCL_ONFAULT
    except (OSError, AttributeError):
        return MemoryLock(False, "mlockall is not available")
    if result != 0:
        code = ctypes.get_errno()
        return MemoryLock(False, errno.errorcode.get(code, str(code)))
    return MemoryLock(True, "locked")


def _activated_sockets(fds: list[int]) -> tuple[socket.socket, dict[tuple[str, int], socket.socket]]:
    """The sockets systemd passed: the agents' Unix socket, and the loopback TCP ones.

    Told apart by family (getsockname), not by LISTEN_FDNAMES: the names are the unit's
    to choose, the family is what the fd is. Exactly one Unix stream socket is required.
    """
    unix: list[socket.socket] = []
    tcp: dict[tuple[str, int], socket.socket] = {}
    for fd in fds:
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            for held in (*unix, *tcp.values(), sock):
                held.detach()
            raise CliError("a socket passed by systemd (LISTEN_FDS) is not a listening "
                           "stream socket")
        if sock.family == socket.AF_UNIX:
            unix.append(sock)
        elif sock.family in (socket.AF_INET, socket.AF_INET6):
            host, port = sock.getsockname()[:2]
            tcp[(host, port)] = sock
        else:
            os.close(sock.detach())  # not ours to serve; closed rather than leaked
    if len(unix) != 1:
        for held in (*unix, *tcp.values()):
            held.detach()
        raise CliError(f"systemd passed {len(unix)} Unix sockets (LISTEN_FDS); the agents' "
                       "socket must be exactly one (buzz-broker.socket)")
    return unix[0], tcp


#: In the state directory while `serve` runs: one line per TCP listener and why its port
#: may be served, for `status` (which never connects to the daemon). Removed at exit; a
#: daemon that died leaves it, and `status` reads it only while the run lock is held.
TCP_NOTE = "serve.tcp"
#: The same for the [metrics] listen port: one line, or no file.
METRICS_NOTE = "serve.metrics"


def _write_tcp_note(state_dir: str, name: str, lines: list[str]) -> None:
    path = os.path.join(state_dir, name)
    try:
        if not lines:
            os.unlink(path)
            return
        temporary = path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as note:
            note.write("".join(f"{line}\n" for line in lines))
        os.replace(temporary, path)
    except OSError:
        pass  # only `status` reads it; serving does not depend on it


#: A TCP listener ready to serve, and the line that says why its port may be served.
Listener = tuple[socket.socket, str]


def _listener(kind: ListenerKind, host: str, port: int, passed: dict[tuple[str, int], socket.socket],
              accept_risk: bool) -> Listener:
    """The socket systemd passed for the address, else one bound here under the squatting
    rule (daemon/loopback_tcp.py); taken out of `passed`."""
    held = passed.pop((host, port), None)
    why = kind.holder(port, held=held is not None, accept_risk=accept_risk)
    if why is None:
        raise CliError(kind.refusal(host, port))
    if held is None:
        try:
            held = bind_tcp_socket(host, port)
        except ListenError as exc:  # its text begins with the address
            raise CliError(f"{kind.key} {exc}") from None
    return held, f"{address_text(*held.getsockname()[:2])} ({why})"


#: The other loopback `localhost` names: glibc answers both (::1 first with Debian's
#: /etc/hosts), and a client tries them in that order.
LOCALHOST_SIBLING: Mapping[str, str] = {"127.0.0.1": "::1", "::1": "127.0.0.1"}
#: How the TCP note (and so `status`) begins the line of a sibling another process holds.
SIBLING_TAKEN = "NOT OURS"


def hold_siblings(listeners: Sequence[Listener]
                  ) -> tuple[list[socket.socket], list[tuple[int, str]]]:
    """Bind, never listen, the other loopback of every port served on one only.

    Why: a port served on 127.0.0.1 alone leaves [::1] of it free, and any local user may
    bind that and collect the credential of an agent whose base URL says `localhost`
    (Buzz's launcher writes it). Held here, such a connection is refused at once and the
    client goes on to the address that is ours. A host without that loopback has nothing
    to hold (nobody can bind it). One another process holds already is a returned line
    (with its port; the line begins with the address) for the log and `status`: held only
    while the daemon runs, it can be taken while the daemon is down (list both in
    listen_tcp and in the socket unit for systemd to hold them).
    """
    served = {sock.getsockname()[:2] for sock, _ in listeners}
    held: list[socket.socket] = []
    taken: list[tuple[int, str]] = []
    for host, port in sorted(served):
        sibling = LOCALHOST_SIBLING.get(host)
        if sibling is None or (sibling, port) in served:
            continue
        family = socket.AF_INET6 if ":" in sibling else socket.AF_INET
        try:
            guard = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        except OSError:
            continue  # no IPv6 at all: nobody can bind it either
        try:
            guard.bind((sibling, port))  # no SO_REUSEADDR: no one binds it beside us
        except OSError as exc:
            guard.close()
            if exc.errno == errno.EADDRINUSE:
                ours = address_text(host, port)
                taken.append((port, f"{address_text(sibling, port)} {SIBLING_TAKEN}: another "
                              f"process holds it; an agent whose URL says localhost:{port} may "
                              f"reach it, not this daemon (use http://{ours})"))
            continue  # EADDRNOTAVAIL: the host has no such loopback
        held.append(guard)
    return held, taken


def tcp_listeners(config: Config, passed: dict[tuple[str, int], socket.socket]
                  ) -> tuple[list[Listener], Listener | None]:
    """The action API's TCP listeners (each [server] listen_tcp address) and the metrics
    one ([metrics] listen), each with why it may be served.

    The config is the source of truth for *whether* an address is served; under systemd the
    units (buzz-broker-tcp.socket, buzz-broker-metrics.socket) are what bind them, told
    apart by address: a passed TCP socket the config does not name is refused, and a named
    address systemd did not pass is bound here, under the squatting rule.

    Raises:
        CliError: a passed socket the config does not name, an unheld port without the
            operator's opt-in, or a port that cannot be bound. Sockets opened so far, and
            every passed one, are closed.
    """
    server, metrics = config.server, config.metrics
    named = {*server.listen_tcp, *([metrics.listen] if metrics.listen else [])}
    listeners: list[Listener] = []
    try:
        for host, port in passed:
            if (host, port) not in named:
                raise CliError(f"systemd passed a TCP socket on {address_text(host, port)} that "
                               "neither [server] listen_tcp nor [metrics] listen names; name "
                               "it, or remove it from its socket unit")
        for host, port in server.listen_tcp:
            listeners.append(_listener(ACTION_TCP, host, port, passed,
                                       server.listen_tcp_accept_squatting_risk))
        scrape = None if metrics.listen is None else _listener(
            METRICS_TCP, *metrics.listen, passed, metrics.listen_accept_squatting_risk)
    except BaseException:
        for sock, _ in listeners:
            sock.close()
        for sock in passed.values():
            sock.close()
        raise
    return listeners, scrape


def _send(environ: MutableMapping[str, str], *lines: str) -> None:
    try:
        notify.notify(*lines, environ=environ)
    except OSError as exc:
        log_event(_log, "serve.notify_failed", level=logging.WARNING, errno=exc.errno)


async def run_server(
    config: Config,
    app_factory: AppFactory,
    *,
    environ: MutableMapping[str, str] | None = None,
    memory_lock: Callable[[], MemoryLock] = lock_memory,
    task_status: trio.TaskStatus[ServerControl] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns `EXIT_STOPPED` once stopped in order.

    Args:
        config: the loaded configuration.
        app_factory: opens the application (`daemon.wiring.running` in production).
        environ: the environment for the systemd protocols (the process's unless given).
        memory_lock: locks memory; tests pass a fake so the test process is not locked.
        task_status: ``started(control)`` once READY=1 has been sent; never, when a stop
            signal abandons the start (the call then returns `EXIT_STOPPED`).

    Returns:
        `EXIT_STOPPED`: stopped by SIGTERM or SIGINT, the drain done or cut at [server]
        shutdown_grace (``drain_deadline``), or the start abandoned; the application
        closed and the socket removed either way.

    Raises:
        CliError: the socket could not be taken (raised as it is), or the application or
            the metrics socket failed to start (inside an exception group: `run` looks
            through it).

    Signals:
        Owns SIGTERM, SIGINT and SIGHUP for its whole duration, through one receiver
        (main thread only): see the module docstring.
    """
    env = os.environ if environ is None else environ
    started_at = time.monotonic()
    # Open before anything is bound and closed after everything is removed: see `_Signals`.
    with trio.open_signal_receiver(*_ASKS) as received:
        # With a custodian the daemon opens no PIN, whatever [pkcs11] still names.
        pin = ("none: the custodian holds the keys" if config.custody.custodian_socket
               else config.pkcs11.pin_origin)
        log_event(_log, "serve.starting", pid=os.getpid(),
                  config=config.source or "built-in defaults", config_origin=config.origin,
                  pin=pin)

        lock = memory_lock()
        if lock.locked:
            log_event(_log, "serve.mlock", locked=True)
        else:
            log_event(_log, "serve.mlock_skipped", level=logging.WARNING, reason=lock.reason)

        # Before the socket: a second daemon must not even bind (or unlink) the first one's.
        try:
            run_lock = RunLock.acquire(config.state.dir)
        except RunLockHeld as exc:
            raise CliError(str(exc)) from None
        try:
            return await _run_locked(config, app_factory, env, started_at, received,
                                     task_status)
        finally:
            run_lock.release()


async def _run_locked(
    config: Config,
    app_factory: AppFactory,
    env: MutableMapping[str, str],
    started_at: float,
    received: AsyncIterator[int],
    task_status: trio.TaskStatus[ServerControl],
) -> int:
    server = config.server
    try:
        fds = notify.listen_fds(env)
    except ValueError as exc:
        raise CliError(f"socket activation: {exc}") from None
    bound_path: str | None = None
    passed: dict[tuple[str, int], socket.socket] = {}
    if fds:
        raw, passed = _activated_sockets(fds)
        where = "socket passed by systemd"
    else:
        _send(env, notify.status(f"binding {server.socket}"))
        try:
            raw = bind_unix_socket(server.socket, mode=server.socket_mode, group=server.socket_group)
        except ListenError as exc:
            raise CliError(str(exc)) from None
        bound_path = os.path.abspath(server.socket)
        where = bound_path
    bound_inode = os.stat(bound_path).st_ino if bound_path else None
    log_event(_log, "serve.listening", socket=where, activated=bool(fds))
    try:
        tcp, scrape = tcp_listeners(config, passed)
    except CliError:
        raw.close()
        if bound_path is not None:
            unlink_if_ours(bound_path, bound_inode)
        raise
    held = [*tcp, *([scrape] if scrape else [])]
    guards, taken = hold_siblings(held)
    held += [(guard, "") for guard in guards]
    for _sock, described in tcp:
        log_event(_log, "serve.tcp", listen=described)
    for _port, line in taken:
        log_event(_log, "serve.tcp_sibling_taken", level=logging.WARNING, listen=line)
    scrape_port = scrape[0].getsockname()[1] if scrape else None
    _write_tcp_note(config.state.dir, TCP_NOTE, [described for _sock, described in tcp]
                    + [line for port, line in taken if port != scrape_port])
    _write_tcp_note(config.state.dir, METRICS_NOTE, [] if scrape is None else
                    [scrape[1], *(line for port, line in taken if port == scrape_port)])
    limits = HttpLimits(
        max_connections=server.max_connections,
        max_connections_per_uid=server.max_connections_per_uid,
        max_inflight_bytes=server.max_inflight_bytes,
        max_body_bytes=server.max_body_bytes,
        max_header_bytes=server.max_header_bytes,
        request_timeout=server.request_timeout,
        shutdown_grace=server.shutdown_grace,
    )
    try:
        watchdog = notify.watchdog_interval(env)
    except ValueError as exc:
        raw.close()
        for sock, _ in held:
            sock.close()
        raise CliError(f"watchdog: {exc}") from None
    admission = TcpAdmission(server.tcp_allow_uids, server.tcp_allow_groups)

    # Everything above is synchronous: a signal that came meanwhile waits in `received`
    # for the task below (its first checkpoint is inside the application's start).
    signals = _Signals(env)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(signals.take, received)
            try:
                with signals.start_scope:
                    _send(env, notify.status("opening the token, the stores and the relay pool"))
                    async with app_factory(config) as app:
                        await _serve_until_stopped(app, raw, limits, env, watchdog, where,
                                                   started_at, task_status, signals,
                                                   config.metrics.socket, scrape, tcp,
                                                   admission,
                                                   server.max_connections_per_credential)
            finally:
                # Only now: the application has closed (its last flushes ran), and every
                # signal until here was taken by the task and logged, not left queued.
                nursery.cancel_scope.cancel()
    finally:
        raw.close()
        for sock, _ in held:
            sock.close()
        _write_tcp_note(config.state.dir, TCP_NOTE, [])
        _write_tcp_note(config.state.dir, METRICS_NOTE, [])
        if bound_path is not None:
            unlink_if_ours(bound_path, bound_inode)
    log_event(_log, "serve.stopped")
    return EXIT_STOPPED


async def _serve_until_stopped(
    app: ReloadableApplication,
    raw: socket.socket,
    limits: HttpLimits,
    env: MutableMapping[str, str],
    watchdog: float | None,
    where: str,
    started_at: float,
    task_status: trio.TaskStatus[ServerControl],
    signals: _Signals,
    metrics_socket: str | None = None,
    scrape: Listener | None = None,
    tcp: list[Listener] | None = None,
    admission: TcpAdmission | None = None,
    per_credential: int | None = None,
) -> None:
    """Serve every listener until a stop signal has stopped them and they have drained."""
    # An application with a metrics registry (the broker) gets the connection gauge and
    # the [metrics] listeners that are configured; a test application has neither.
    metrics: Metrics | None = getattr(app, "metrics", None)
    # One gauge for every listener of the action API: the sum of their open connections.
    open_per_listener: dict[int, int] = {}

    def gauge(listener: int) -> Callable[[int], None] | None:
        if metrics is None:
            return None
        registry = metrics

        def on_connections(count: int) -> None:
            open_per_listener[listener] = count
            registry.set_open_connections(sum(open_per_listener.values()))

        return on_connections

    on_connections = gauge(0)

    async with trio.open_nursery() as nursery:
        if metrics is not None:
            await _start_metrics(nursery, metrics, metrics_socket, scrape)

        async def serve_then_finish(task_status: trio.TaskStatus[list[ServerControl]]
                                    ) -> None:
            # Every listener of the action API in a nursery of its own, which ends only
            # once the last of them has drained: a request in flight on a TCP listener
            # must not be cut because the socket happened to be idle.
            async with trio.open_nursery() as servers:
                started: list[ServerControl] = [await servers.start(functools.partial(
                    serve, action_routes(app), raw, limits, on_connections=on_connections))]
                # Its re-checks in the outer nursery, cancelled once the listeners drained.
                gate = (AdmissionGate(admission, nursery=nursery) if admission is not None
                        else _nobody)
                for index, (sock, _described) in enumerate(tcp or (), start=1):
                    # The same bounds as the socket, each listener with its own shares.
                    tcp_limits = dataclasses.replace(
                        limits, max_connections_per_credential=per_credential)
                    started.append(await servers.start(functools.partial(
                        serve, action_routes(app), sock, tcp_limits,
                        on_connections=gauge(index), admit=gate)))
                task_status.started(started)
            nursery.cancel_scope.cancel()  # drained: stop the watchdog and metrics tasks

        controls: list[ServerControl] = await nursery.start(serve_then_finish)
        if signals.stop_asked:
            # Taken at the checkpoint just passed, while starting: the start scope is
            # cancelled, and the nursery's end cancels the listeners. No READY=1.
            return
        _send(env, notify.READY, notify.status(f"serving on {where}"))
        log_event(
            _log,
            "serve.ready",
            socket=where,
            startup_ms=round((time.monotonic() - started_at) * 1000, 1),
            watchdog_seconds=watchdog,
        )
        if watchdog is not None:
            nursery.start_soon(_watchdog, env, watchdog / 2)
        task_status.started(controls[0])  # the agents' socket's, handed to our own caller
        # No checkpoint since `stop_asked` was read: no signal was taken in between, and
        # from here a stop drains `controls` (serve_then_finish then ends this nursery).
        signals.serving(app, controls, where)


class _Phase(enum.Enum):
    """Where the daemon is in its life, as far as its signals are concerned."""

    #: From before the socket is bound until READY=1: the token login, the stores, the
    #: relay pool, the listeners starting.
    STARTING = "starting"
    #: READY=1 was sent: serving until a stop signal.
    SERVING = "serving"
    #: A stop signal was taken: draining (or abandoning the start), then closing.
    STOPPING = "stopping"


class _Ask(enum.Enum):
    """What a signal asks of the daemon."""

    STOP = "stop"
    RELOAD = "reload"


#: The signals the daemon owns, and what each asks: systemd stops with SIGTERM
#: (KillSignal=) and reloads with SIGHUP (the unit's ExecReload=); a terminal's Ctrl-C
#: is SIGINT. The receiver `run_server` opens takes exactly these.
_ASKS: Final[Mapping[signal.Signals, _Ask]] = {
    signal.SIGTERM: _Ask.STOP,
    signal.SIGINT: _Ask.STOP,
    signal.SIGHUP: _Ask.RELOAD,
}


@dataclass(frozen=True, slots=True)
class _Serving:
    """What a signal acts on once READY=1 was sent."""

    app: ReloadableApplication
    controls: list[ServerControl]
    where: str

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.controls)


class _Signals:
    """The daemon's one owner of SIGTERM, SIGINT and SIGHUP, for all of `run_server`.

    `run_server` opens the one receiver before anything is bound; `take`, a task of the
    nursery around the application, reads every signal and does what `_ON_SIGNAL` says
    for the phase; the task is cancelled only once the application has closed. The
    phase moves STARTING -> SERVING (`serving`, when READY=1 is sent) -> STOPPING (a stop
    signal), or STARTING -> STOPPING.

    WARNING - why nothing else may read or close the receiver: when a trio signal
    receiver closes, every signal still queued in it is raised again with the handler
    that was there before - SIG_DFL for SIGTERM and SIGHUP, which ends the process on the
    spot, and trio's KeyboardInterrupt for SIGINT. A signal queued and never read is
    therefore a kill wherever the receiver closes. Only a signal in the last instant,
    after the task is cancelled, still meets the default action: when the receiver
    closes, once the application is closed, the socket removed and ``serve.stopped``
    logged - the exit status is then the signal's, with nothing left to close.
    """

    def __init__(self, env: MutableMapping[str, str]) -> None:
        self._env = env
        self._phase = _Phase.STARTING
        self._serving: _Serving | None = None
        self._reload_asked = False
        #: Around the application's start *and* its serving (cancel scopes must nest with
        #: the application's own nursery, so it cannot end at READY=1); cancelled only by
        #: a stop while starting. Made here, so a stop taken before the start enters it
        #: still counts: a scope cancelled before it is entered is cancelled on entry.
        self.start_scope = trio.CancelScope()

    @property
    def stop_asked(self) -> bool:
        return self._phase is _Phase.STOPPING

    def serving(self, app: ReloadableApplication, controls: list[ServerControl],
                where: str) -> None:
        """READY=1 was sent: a stop now drains `controls`, and SIGHUP reloads `app`."""
        if self._phase is not _Phase.STARTING:
            raise AssertionError(f"serving() while {self._phase.value}")
        self._phase = _Phase.SERVING
        self._serving = _Serving(app, controls, where)
        if self._reload_asked:
            self._reload_asked = False
            _reload(app, self._env, where)

    async def take(self, received: AsyncIterator[int]) -> None:
        """Act on every signal until cancelled (a nursery task)."""
        async for signum in received:
            sig = signal.Signals(signum)
            _ON_SIGNAL[self._phase, _ASKS[sig]](self, sig.name)

    def _abandon_start(self, name: str) -> None:
        self._phase = _Phase.STOPPING
        _send(self._env, notify.STOPPING, notify.status(f"stopping ({name}) before ready"))
        log_event(_log, "serve.start_abandoned", signal=name)
        self.start_scope.cancel()

    def _reload_when_serving(self, name: str) -> None:
        # The configuration was read before the start: a change the sender meant to
        # apply would be lost if this were dropped. Many SIGHUPs make one reload.
        self._reload_asked = True
        log_event(_log, "serve.reload_deferred", signal=name)

    def _drain(self, name: str) -> None:
        serving = self._serving
        assert serving is not None  # SERVING has it
        self._phase = _Phase.STOPPING
        in_flight = serving.in_flight
        _send(self._env, notify.STOPPING,
              notify.status(f"stopping ({name}): draining {in_flight} request(s)"))
        log_event(_log, "serve.stopping", signal=name, in_flight=in_flight,
                  connections=sum(c.connections for c in serving.controls))
        # All in one step: their grace periods run from the same instant, and
        # serve_then_finish waits for the last one before cancelling anything.
        for each in serving.controls:
            each.stop()

    def _reload_now(self, _name: str) -> None:
        serving = self._serving
        assert serving is not None  # SERVING has it
        _reload(serving.app, self._env, serving.where)

    def _ignore(self, name: str) -> None:
        # Not "a second stop cuts the drain": the grace is the operator's bound already,
        # and a second SIGTERM is as often a script's or supervisor's as an impatient
        # person's; cutting would turn requests that were about to finish into
        # indeterminate ones. Nor a reload: the application is closing.
        log_event(_log, "serve.signal_ignored", level=logging.WARNING, signal=name,
                  in_flight=0 if self._serving is None else self._serving.in_flight)


#: What each signal does in each phase (`_Signals`): every pair has its row.
_ON_SIGNAL: Final[Mapping[tuple[_Phase, _Ask], Callable[[_Signals, str], None]]] = {
    (_Phase.STARTING, _Ask.STOP): _Signals._abandon_start,
    (_Phase.STARTING, _Ask.RELOAD): _Signals._reload_when_serving,
    (_Phase.SERVING, _Ask.STOP): _Signals._drain,
    (_Phase.SERVING, _Ask.RELOAD): _Signals._reload_now,
    (_Phase.STOPPING, _Ask.STOP): _Signals._ignore,
    (_Phase.STOPPING, _Ask.RELOAD): _Signals._ignore,
}


async def _nobody(_uid: int | None) -> bool:
    return False


async def _start_metrics(
    nursery: trio.Nursery,
    registry: Metrics,
    socket_path: str | None,
    scrape: Listener | None,
) -> None:
    """The configured metrics listeners, served by `daemon.http.serve` in `nursery`.

    Both are bound before READY=1, so a taken path or port fails the start with one line
    (the TCP one in `tcp_listeners`, under its squatting rule, with the action API's).
    They are cancelled with the nursery, after every listener of the action API has
    drained: a scrape during the drain still shows it.
    """
    if socket_path:
        try:
            await nursery.start(functools.partial(
                serve, scrape_routes(registry), socket_path, SCRAPE_LIMITS, socket_mode=0o600))
        except ListenError as exc:  # its text begins with the path
            raise CliError(f"[metrics] socket {exc}") from None
        log_event(_log, "serve.metrics", socket=socket_path)
    if scrape is not None:
        sock, described = scrape
        await nursery.start(serve, scrape_routes(registry), sock, SCRAPE_LIMITS)
        log_event(_log, "serve.metrics", listen=described)


def _reloaded(reread: Reread) -> str:
    """The STATUS= words for a reload that ran: `systemctl status` shows them until the
    next one, and `systemctl reload` cannot fail for a file the daemon refused (ExecReload=
    only sends the signal), so this line and the journal's warnings are where it shows."""
    if reread.rejected is not None:
        return "reload rejected the config file (still on the previous one; see the journal)"
    if reread.waiting:
        return "reloaded; restart to apply " + ", ".join(reread.waiting)
    return "reloaded"


def _reload(app: ReloadableApplication, env: MutableMapping[str, str], where: str) -> None:
    # systemd shows the unit "reloading" from RELOADING=1 until READY=1.
    _send(env, notify.RELOADING, notify.monotonic_usec(), notify.status("reloading"))
    try:
        reread = app.reload()
    except Exception as exc:  # noqa: BLE001 - keep serving with the state we have
        log_event(_log, "serve.reload_failed", level=logging.ERROR, error=type(exc).__name__)
        _send(env, notify.READY, notify.status(f"serving on {where}; last reload failed"))
        return
    log_event(_log, "serve.reloaded", config="rejected" if reread.rejected is not None
              else "applied", restart_needed=list(reread.waiting))
    _send(env, notify.READY, notify.status(f"serving on {where}; {_reloaded(reread)}"))


async def _watchdog(env: MutableMapping[str, str], every: float) -> None:
    while True:
        _send(env, notify.WATCHDOG)
        await trio.sleep(every)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve` takes no arguments of its own: everything is in the config file."""


@asynccontextmanager
async def _broker_factory(config: Config) -> AsyncIterator[ReloadableApplication]:
    """`daemon.wiring.running`, with its `StartupError` turned into the command's one-line fault."""
    from daemon.wiring import StartupError, running

    source = config.source

    def reload_config() -> Config:
        # SIGHUP re-reads the same file, in the process environment as it is now
        # (`os.environ`, load_config's default: the daemon only removes systemd's LISTEN_*
        # variables from it, so what a config reads is as at the start). Of it only
        # $CREDENTIALS_DIRECTORY is read once a file is named (the PIN's origin), and with it
        # the reread compares with the running config key by key (restart_only_changes):
        # read with no environment, every reload under systemd said "[pkcs11] pin_file
        # changed" (tests/test_serve.py
        # ::test_real_broker_reload_under_a_systemd_credential_restarts_nothing).
        return load_config(source)

    try:
        async with running(config, config_loader=reload_config if source else None) as app:
            yield app
    except StartupError as exc:
        raise CliError(str(exc)) from None


def _single(exc: BaseException) -> BaseException:
    """Look through trio's exception groups of one member, to find a CliError."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:  # a fault of the file leaves nothing behind: before the state lock and the socket
        require_relay(config)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    setup_logging(config.log.level)
    try:
        return trio.run(run_server, config, _broker_factory)
    except BaseExceptionGroup as group:
        inner = _single(group)
        if isinstance(inner, (CliError, KeyboardInterrupt)):
            raise inner from None
        log_event(_log, "serve.crashed", level=logging.ERROR, error=type(inner).__name__)
        raise
