"""`buzz-broker serve`: readiness, watchdog, SIGHUP reload, SIGTERM drain, startup faults.

The application is a small fake injected through `run_server`'s factory, so these tests
exercise the daemon's edges (socket, systemd protocols, signals) on their own. Some run
the daemon as a real child process: one with a socket passed through LISTEN_FDS, and the
signal tests whose failure is the process dying (a signal with its default action would
end the test process itself in-process). The last ones run the real broker.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from custody import TokenConfig
from daemon.cli import main
from daemon.cli import serve as serve_cli
from daemon.cli._common import CliError
from daemon.cli.serve import EXIT_STOPPED, MemoryLock, ReloadableApplication, run_server
from daemon.config import PIN_CREDENTIAL, Config, Reread, load_config
from daemon.http import HttpAnswer, HttpRequest, ServerControl, bind_unix_socket
from daemon.log import log_event, setup_logging
from daemon.state.audit import AUDIT_DIRNAME, audit_files
from tests.adversarial._daemon import DaemonProcess, envelope, post, request_body, setup_state
from tests.fixtures.broker import write_config as broker_config
from tests.fixtures.relay import free_port
from tests.scripted_relay import Script, ScriptedRelay
from tests.test_http import Reader, req

ROOT = Path(__file__).resolve().parent.parent
CREDENTIAL = "Bearer tok-serve-secret-0123456789"


class FakeApp:
    """Echoes; a body of b"slow" takes 0.5 s; counts reloads."""

    def __init__(self) -> None:
        self.reloads = 0
        self.opened = False
        self.closed = False

    async def handle(self, request: HttpRequest) -> HttpAnswer:
        if request.body == b"slow":
            await trio.sleep(0.5)
        return HttpAnswer(200, b'{"echo":' + json.dumps(request.body.decode()).encode() + b"}")

    def reload(self) -> Reread:
        self.reloads += 1
        return Reread()


def fake_factory(app: FakeApp) -> serve_cli.AppFactory:
    @asynccontextmanager
    async def factory(config: Config) -> AsyncIterator[ReloadableApplication]:
        app.opened = True
        try:
            yield app
        finally:
            app.closed = True

    return factory


def gated_start_factory(app: FakeApp, gate: str) -> serve_cli.AppFactory:
    """As `fake_factory`, but the start (the token login, in production) lasts until the
    file `gate` exists; a start cancelled meanwhile logs ``test.start_cancelled``."""

    @asynccontextmanager
    async def factory(config: Config) -> AsyncIterator[ReloadableApplication]:
        try:
            while not os.path.exists(gate):
                await trio.sleep(0.01)
        except trio.Cancelled:
            log_event(logging.getLogger("buzz_broker.test"), "test.start_cancelled")
            raise
        async with fake_factory(app)(config) as opened:
            yield opened

    return factory


def no_lock() -> MemoryLock:
    # The test process must not lock its memory (it may well be permitted to here).
    return MemoryLock(False, "not in tests")


@pytest.fixture
def sockdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="bbs", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write_config(sockdir: str, socket_name: str = "b.sock", extra: str = "",
                 server: str = "", shutdown_grace: float = 5) -> Config:
    path = Path(sockdir) / "broker.toml"
    path.write_text(
        f'[server]\nsocket = "{socket_name}"\nshutdown_grace = {shutdown_grace}\n{server}'
        f'[state]\ndir = "state"\n'
        # serve refuses a file without one before it binds anything; the fake apps never dial it
        f'[relay]\nurl = "ws://127.0.0.1:9"\n{extra}'
    )
    return load_config(str(path), environ={})


class Datagrams:
    """The test's NOTIFY_SOCKET: collects what the daemon sends."""

    def __init__(self, path: str) -> None:
        self.sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path = path
        self.seen: list[str] = []

    async def bind(self) -> None:
        await self.sock.bind(self.path)

    async def until(self, wanted: str, timeout: float = 5.0) -> list[str]:
        """Messages up to and including the first one containing `wanted`."""
        got: list[str] = []
        with trio.fail_after(timeout):
            while True:
                message = (await self.sock.recv(4096)).decode()
                got.append(message)
                self.seen.append(message)
                if wanted in message.split("\n"):
                    return got


async def test_lifecycle_ready_watchdog_reload_drain(sockdir: str) -> None:
    config = write_config(sockdir)
    dgrams = Datagrams(os.path.join(sockdir, "notify"))
    await dgrams.bind()
    env = {"NOTIFY_SOCKET": dgrams.path, "WATCHDOG_USEC": "200000"}
    app = FakeApp()
    exit_codes: list[int] = []

    async def runner(task_status: trio.TaskStatus[ServerControl]) -> None:
        code = await run_server(
            config, fake_factory(app), environ=env, memory_lock=no_lock, task_status=task_status
        )
        exit_codes.append(code)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            control: ServerControl = await nursery.start(runner)
            before_ready = await dgrams.until("READY=1")
            assert any(m.startswith("STATUS=opening") for m in before_ready)
            assert app.opened
            await dgrams.until("WATCHDOG=1", timeout=1.0)
            await dgrams.until("WATCHDOG=1", timeout=1.0)  # pings keep coming

            stream = await trio.open_unix_socket(config.server.socket)
            reader = Reader(stream)
            await stream.send_all(req(b"one", headers=f"Authorization: {CREDENTIAL}\r\n"))
            first = await reader.next()
            assert first is not None and first[0] == 200

            # SIGHUP reloads without dropping the connection, between RELOADING=1 (with
            # the MONOTONIC_USEC systemd 253's notify-reload wants) and READY=1.
            os.kill(os.getpid(), signal.SIGHUP)
            reloading = (await dgrams.until("RELOADING=1", timeout=2.0))[-1].split("\n")
            assert reloading[0] == "RELOADING=1"
            assert any(re.fullmatch(r"MONOTONIC_USEC=[1-9][0-9]*", m) for m in reloading)
            ready_again = (await dgrams.until("READY=1", timeout=2.0))[-1].split("\n")
            assert ready_again[0] == "READY=1" and ready_again[1].endswith("; reloaded")
            assert app.reloads == 1  # READY=1 came after the reload, not before
            await stream.send_all(req(b"two"))
            second = await reader.next()
            assert second is not None and second[2] == b'{"echo":"two"}'

            # SIGTERM while a request is in flight: STOPPING=1, and the request finishes.
            await stream.send_all(req(b"slow"))
            with trio.fail_after(2):
                while control.in_flight == 0:
                    await trio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            await dgrams.until("STOPPING=1", timeout=2.0)
            last = await reader.next()
            assert last is not None and last[0] == 200 and last[2] == b'{"echo":"slow"}'
            assert last[1]["connection"] == "close"
    assert exit_codes == [0]
    assert app.closed
    assert not os.path.exists(config.server.socket), "the socket it bound is removed"


class GatedApp(FakeApp):
    """A body of b"gated" is answered once `release` is set; b"forever" never is."""

    def __init__(self) -> None:
        super().__init__()
        self.release = trio.Event()
        #: Requests with the application now, and those it was cancelled in.
        self.waiting = 0
        self.cut = 0

    async def handle(self, request: HttpRequest) -> HttpAnswer:
        if request.body not in (b"gated", b"forever"):
            return await super().handle(request)
        self.waiting += 1
        try:
            if request.body == b"gated":
                await self.release.wait()
            else:
                await trio.sleep_forever()
        except trio.Cancelled:
            self.cut += 1
            raise
        finally:
            self.waiting -= 1
        return HttpAnswer(200, b'{"gated":true}')


def tcp_server(port: int) -> str:
    # A port the test picked: nobody holds it for the daemon, hence the opt-in.
    return (f'listen_tcp = ["127.0.0.1:{port}"]\nlisten_tcp_accept_squatting_risk = true\n'
            f"tcp_allow_uids = [{os.getuid()}]\n")


async def tcp_send(port: int, body: bytes) -> tuple[trio.SocketStream, Reader]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(
        f"POST /v1/action HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return stream, Reader(stream)


async def test_sigterm_drains_a_tcp_request_while_the_socket_is_idle(sockdir: str) -> None:
    """A request on a TCP listener, nothing on the socket: SIGTERM lets it finish.

    The daemon used to wait for the socket's server alone and then cancel everything:
    with the socket idle (a host whose agents all use TCP) the TCP request was cut at once.
    """
    port = free_port()
    config = write_config(sockdir, server=tcp_server(port))
    dgrams = Datagrams(os.path.join(sockdir, "notify"))
    await dgrams.bind()
    app = GatedApp()
    exit_codes: list[int] = []

    async def runner(task_status: trio.TaskStatus[ServerControl]) -> None:
        exit_codes.append(await run_server(config, fake_factory(app),
                                           environ={"NOTIFY_SOCKET": dgrams.path},
                                           memory_lock=no_lock, task_status=task_status))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(runner)
            stream, reader = await tcp_send(port, b"gated")
            with trio.fail_after(5):
                while app.waiting == 0:
                    await trio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            stopping = (await dgrams.until("STOPPING=1"))[-1]
            assert "STATUS=stopping (SIGTERM): draining 1 request(s)" in stopping.split("\n")
            # Whatever the stop was going to cut, it has cut by the time every task waits.
            await trio.testing.wait_all_tasks_blocked()
            assert (app.waiting, app.cut) == (1, 0)
            app.release.set()
            answer = await reader.next()
            assert answer is not None and answer[0] == 200 and answer[2] == b'{"gated":true}'
            assert answer[1]["connection"] == "close"
            assert await reader.eof()
            await stream.aclose()
    assert exit_codes == [0]


async def test_sigterm_cuts_a_tcp_request_at_the_grace(sockdir: str) -> None:
    """Past [server] shutdown_grace a TCP request is cut, and not before: another request
    finishing inside the grace is answered, the stopping line counts both listeners'."""
    port = free_port()
    config = write_config(sockdir, server=tcp_server(port), shutdown_grace=1)
    app = GatedApp()
    exit_codes: list[int] = []
    out = io.StringIO()
    setup_logging("info", stream=out)

    async def runner(task_status: trio.TaskStatus[ServerControl]) -> None:
        exit_codes.append(await run_server(config, fake_factory(app), environ={},
                                           memory_lock=no_lock, task_status=task_status))

    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(runner)
                stuck, stuck_reader = await tcp_send(port, b"forever")
                gated, gated_reader = await tcp_send(port, b"gated")
                idle = await trio.open_unix_socket(config.server.socket)
                with trio.fail_after(5):
                    while app.waiting < 2:
                        await trio.sleep(0.01)
                os.kill(os.getpid(), signal.SIGTERM)
                await trio.testing.wait_all_tasks_blocked()
                assert (app.waiting, app.cut) == (2, 0)  # both still draining
                app.release.set()
                answer = await gated_reader.next()
                assert answer is not None and answer[0] == 200
                assert app.cut == 0  # one request done does not end the others' grace
                assert await stuck_reader.eof()  # cut: no answer at all
                assert app.cut == 1
                for stream in (stuck, gated, idle):
                    await stream.aclose()
    finally:
        setup_logging("info")
    assert exit_codes == [0]
    stopping = [json.loads(line) for line in out.getvalue().splitlines()
                if '"serve.stopping"' in line]
    assert [(s["in_flight"], s["connections"]) for s in stopping] == [(2, 3)]


async def test_second_daemon_on_the_same_state_is_refused(sockdir: str) -> None:
    config = write_config(sockdir)
    app = FakeApp()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(
                run_server, config, fake_factory(app), environ={}, memory_lock=no_lock))
            other = write_config(sockdir, socket_name="other.sock")
            second = FakeApp()
            with pytest.raises(CliError, match=rf"another buzz-broker serve \(pid {os.getpid()}\)"):
                await run_server(other, fake_factory(second), environ={}, memory_lock=no_lock)
            assert not second.opened
            os.kill(os.getpid(), signal.SIGTERM)


async def test_metrics_listener_on_a_taken_port_is_one_line_before_ready(sockdir: str) -> None:
    """[metrics] listen: served with the daemon; a port already taken fails the start, before
    the app opens. (Free ports are >= 1024: the opt-in lets the daemon bind them, as an
    operator's would.)"""
    import socket as pysocket

    from daemon.metrics import Metrics
    from tests.fixtures.relay import free_port

    class WithMetrics(FakeApp):
        metrics = Metrics(actions=("message.post",))

    port = free_port()
    config = write_config(sockdir, extra=f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
                          "listen_accept_squatting_risk = true\n")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(
                run_server, config, fake_factory(WithMetrics()), environ={}, memory_lock=no_lock))
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                answer = await stream.receive_some(65536)
            assert answer.startswith(b"HTTP/1.1 200 ")
            os.kill(os.getpid(), signal.SIGTERM)

    taken = pysocket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        busy = write_config(sockdir, extra='[metrics]\nlisten = "127.0.0.1:%d"\n'
                            "listen_accept_squatting_risk = true\n" % taken.getsockname()[1])
        dgrams = Datagrams(os.path.join(sockdir, "notify"))
        await dgrams.bind()
        app = WithMetrics()
        with pytest.raises(CliError) as info:
            await run_server(busy, fake_factory(app),
                             environ={"NOTIFY_SOCKET": dgrams.path}, memory_lock=no_lock)
        fault = info.value
        assert not app.opened  # bound with the action API's ports, before the token opens
        assert re.fullmatch(r"\[metrics\] listen 127\.0\.0\.1:[0-9]+: Address already in use",
                            str(fault))
        with trio.move_on_after(0.2):
            await dgrams.until("READY=1")
            raise AssertionError("READY=1 was sent although the metrics port was taken")
    finally:
        taken.close()


async def test_metrics_socket_taken_by_a_live_listener_is_one_line_before_ready(sockdir: str) -> None:
    """[metrics] socket: a socket another process listens on is left alone and fails the start."""
    from daemon.metrics import Metrics

    class WithMetrics(FakeApp):
        metrics = Metrics(actions=("message.post",))

    admin = os.path.join(sockdir, "admin.sock")
    live = bind_unix_socket(admin, mode=0o600)
    try:
        config = write_config(sockdir, extra='[metrics]\nsocket = "admin.sock"\n')
        dgrams = Datagrams(os.path.join(sockdir, "notify"))
        await dgrams.bind()
        with pytest.raises(BaseExceptionGroup) as info:
            await run_server(config, fake_factory(WithMetrics()),
                             environ={"NOTIFY_SOCKET": dgrams.path}, memory_lock=no_lock)
        fault = serve_cli._single(info.value)
        assert isinstance(fault, CliError)
        assert str(fault) == (f"[metrics] socket {admin}: another process is already "
                              "listening on this socket")
        with trio.move_on_after(0.2):
            await dgrams.until("READY=1")
            raise AssertionError("READY=1 was sent although the metrics socket was taken")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with probe:
            probe.connect(admin)  # the live listener's socket is still there
    finally:
        live.close()


async def test_socket_fault_reported_before_the_app_opens(sockdir: str) -> None:
    config = write_config(sockdir)
    Path(config.server.socket).write_text("not a socket")
    app = FakeApp()
    with pytest.raises(CliError, match="not a socket"):
        await run_server(config, fake_factory(app), environ={}, memory_lock=no_lock)
    assert not app.opened


async def test_bad_listen_fds_is_one_line(sockdir: str) -> None:
    config = write_config(sockdir)
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "many"}
    with pytest.raises(CliError, match="socket activation"):
        await run_server(config, fake_factory(FakeApp()), environ=env, memory_lock=no_lock)


async def test_failed_reload_keeps_serving(sockdir: str) -> None:
    config = write_config(sockdir)

    class BadReload(FakeApp):
        def reload(self) -> Reread:
            raise RuntimeError("store unreadable")

    app = BadReload()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(
                    run_server, config, fake_factory(app), environ={}, memory_lock=no_lock
                )
            )
            os.kill(os.getpid(), signal.SIGHUP)
            await trio.sleep(0.05)
            stream = await trio.open_unix_socket(config.server.socket)
            await stream.send_all(req(b"still"))
            answer = await Reader(stream).next()
            assert answer is not None and answer[0] == 200
            os.kill(os.getpid(), signal.SIGTERM)


def test_startup_error_is_one_line_and_nonzero(
    sockdir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_config(sockdir)

    @asynccontextmanager
    async def failing(config: Config) -> AsyncIterator[ReloadableApplication]:
        # What _broker_factory turns a StartupError into; raised from inside a nursery so
        # the exception-group unwrapping in `run` is exercised too.
        async with trio.open_nursery():
            raise CliError("token 'buzz-broker': not found in module")
        yield FakeApp()  # pragma: no cover

    monkeypatch.setattr(serve_cli, "_broker_factory", failing)
    monkeypatch.setattr(serve_cli, "lock_memory", no_lock)
    code = main(["--config", os.path.join(sockdir, "broker.toml"), "serve"])
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().split("\n")
    # JSON log lines first (startup, listening), then exactly one plain line: the fault.
    assert lines[-1] == "buzz-broker: token 'buzz-broker': not found in module"
    assert all(line.startswith("{") for line in lines[:-1])
    assert "Traceback" not in err


def test_the_start_line_names_no_pin_where_the_custodian_holds_the_keys(
    sockdir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `[custody] custodian_socket` the daemon reads no PIN, whatever `[pkcs11]` still
    says (the demo's config keeps a pin_file): its start line must say so, as check-config's
    `pin:` line does, not name a file it never opens."""
    write_config(sockdir, extra='[custody]\ncustodian_socket = "c.sock"\n'
                                 '[pkcs11]\npin_file = "pin"\n')

    @asynccontextmanager
    async def failing(config: Config) -> AsyncIterator[ReloadableApplication]:
        raise CliError("stop here")
        yield FakeApp()  # pragma: no cover

    monkeypatch.setattr(serve_cli, "_broker_factory", failing)
    monkeypatch.setattr(serve_cli, "lock_memory", no_lock)
    assert main(["--config", os.path.join(sockdir, "broker.toml"), "serve"]) == 1
    [starting] = [json.loads(line) for line in capsys.readouterr().err.splitlines()
                  if '"serve.starting"' in line]
    assert starting["pin"] == "none: the custodian holds the keys", starting


def test_regular_file_at_socket_is_one_line(
    sockdir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(sockdir)
    Path(config.server.socket).write_text("x")
    monkeypatch.setattr(serve_cli, "lock_memory", no_lock)
    assert main(["--config", os.path.join(sockdir, "broker.toml"), "serve"]) == 1
    err = capsys.readouterr().err.strip().split("\n")
    assert err[-1].startswith("buzz-broker: ") and "not a socket" in err[-1]


@pytest.mark.parametrize("limit_mib", [8, 256, 4096])
def test_lock_memory_refuses_any_finite_limit(
    monkeypatch: pytest.MonkeyPatch, limit_mib: int
) -> None:
    # 256 MiB is what the unit used to set: under it a burst of held request bodies ended
    # the daemon with MemoryError (issue 13). No finite limit is safe under MCL_FUTURE.
    import resource

    limit = limit_mib * 1024 * 1024
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (limit, limit))
    monkeypatch.setattr(serve_cli, "_has_cap_ipc_lock", lambda: False)
    result = serve_cli.lock_memory()
    assert not result.locked and "RLIMIT_MEMLOCK" in result.reason


# --------------------------------------------------------------------------- a real process

#: The wrapper a service manager would be: the listening socket moves to fd 3, LISTEN_PID
#: names this very process, then the daemon's real startup runs (with the fake app).
CHILD = """
import functools, os, sys
os.dup2(int(sys.argv[1]), 3)
os.close(int(sys.argv[1]))
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "1"
import trio
from daemon.config import load_config
from daemon.log import setup_logging
from daemon.cli.serve import run_server
from tests.test_serve import FakeApp, fake_factory, no_lock
config = load_config(sys.argv[2])
setup_logging(config.log.level)
sys.exit(trio.run(functools.partial(run_server, config, fake_factory(FakeApp()), memory_lock=no_lock)))
"""


async def test_socket_activated_child_ready_watchdog_stopping(sockdir: str) -> None:
    config = write_config(sockdir, socket_name="never-bound.sock")
    activated = os.path.join(sockdir, "activated.sock")
    listening = bind_unix_socket(activated)
    dgrams = Datagrams(os.path.join(sockdir, "notify"))
    await dgrams.bind()
    env = dict(os.environ, NOTIFY_SOCKET=dgrams.path, WATCHDOG_USEC="300000")
    env.pop("BUZZ_BROKER_CONFIG", None)
    with listening:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", CHILD, str(listening.fileno()), config.source or ""],
            pass_fds=(listening.fileno(),),
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
        )
    try:
        with trio.fail_after(20):
            await dgrams.until("READY=1", timeout=15)
            await dgrams.until("WATCHDOG=1", timeout=2)
            stream = await trio.open_unix_socket(activated)
            reader = Reader(stream)
            await stream.send_all(req(b"slow", headers=f"Authorization: {CREDENTIAL}\r\n"))
            await trio.sleep(0.15)  # the slow request is now with the application
            proc.send_signal(signal.SIGTERM)
            await dgrams.until("STOPPING=1", timeout=2)
            answer = await reader.next()
            assert answer is not None and answer[0] == 200 and answer[2] == b'{"echo":"slow"}'
            assert await proc.wait() == 0
        assert proc.stderr is not None
        log = (await proc.stderr.receive_some(1 << 20)).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not os.path.exists(config.server.socket), "activated: the configured path is not bound"
    events = [json.loads(line)["event"] for line in log.strip().split("\n")]
    assert events[:1] == ["serve.starting"]
    assert {"serve.listening", "serve.ready", "serve.stopping", "serve.stopped"} <= set(events)
    assert "tok-serve-secret" not in log


# --------------------------------------------------------------------------- the real broker

#: Socket activation by hand: fd 3, LISTEN_PID = this pid, then exec the real command.
EXEC_WRAPPER = """
import os, sys
os.dup2(int(sys.argv[1]), 3)
os.close(int(sys.argv[1]))
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "1"
os.execv(sys.executable, [sys.executable, "-m", "daemon.cli", "--config", sys.argv[2], "serve"])
"""


def _blocking_exchange(path: str, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(path)
        client.sendall(data)
        chunks: list[bytes] = []
        while True:
            chunk = client.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def test_real_broker_socket_activated(
    custody_state: tuple[TokenConfig, Path], sockdir: str
) -> None:
    from buzzwire.contract import build_request, encode_request, parse_response
    from tests.fixtures.relay import free_port

    token, state_dir = custody_state
    config_path = Path(sockdir) / "broker.toml"
    config_path.write_text(
        f'[server]\nsocket = "never-bound.sock"\nshutdown_grace = 5\n'
        f'[state]\ndir = "{state_dir}"\n'
        f'[pkcs11]\nmodule = "{token.module}"\ntoken_label = "{token.token_label}"\n'
        f'pin_file = "{token.pin_file}"\nkek_label = "{token.kek_label}"\n'
        f'[relay]\nurl = "ws://127.0.0.1:{free_port()}"\n'
        f'[metrics]\nsocket = "admin.sock"\n'
    )
    activated = os.path.join(sockdir, "activated.sock")
    listening = bind_unix_socket(activated)
    notify_path = os.path.join(sockdir, "notify")
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(notify_path)
    dgram.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="1000000")
    env.pop("BUZZ_BROKER_CONFIG", None)

    def until(wanted: str) -> None:
        while wanted not in dgram.recv(4096).decode().split("\n"):
            pass

    with listening, dgram:
        began = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-c", EXEC_WRAPPER, str(listening.fileno()), str(config_path)],
            pass_fds=(listening.fileno(),),
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            until("READY=1")
            ready_after = time.monotonic() - began
            until("WATCHDOG=1")
            request = encode_request(build_request("storage.address", {"slug": "core"}, request_id="r-1"))
            head = f"POST /v1/action HTTP/1.1\r\nHost: b\r\nConnection: close\r\nContent-Length: {len(request)}\r\n"
            answer = _blocking_exchange(
                activated, (head + f"Authorization: {CREDENTIAL}\r\n\r\n").encode() + request
            )
            assert answer.startswith(b"HTTP/1.1 200 ")
            response = parse_response(answer.split(b"\r\n\r\n", 1)[1])
            assert response.code is not None
            assert (response.status.value, response.code.value) == ("failed", "unauthenticated")
            garbage = b'{"requestId":'
            answer = _blocking_exchange(
                activated, (head.replace(str(len(request)), str(len(garbage))) + "\r\n").encode() + garbage
            )
            assert answer.startswith(b"HTTP/1.1 400 ") and answer.endswith(b"\r\n\r\n")
            # The admin socket serves the running daemon's figures, the two answers counted.
            metrics = _blocking_exchange(
                os.path.join(sockdir, "admin.sock"),
                b"GET /metrics HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n",
            )
            assert metrics.startswith(b"HTTP/1.1 200 ")
            assert (b'buzz_broker_requests_total{action="storage.address",status="failed",'
                    b'code="unauthenticated"} 1') in metrics
            assert b'buzz_broker_requests_total{action="",status="none",code=""} 1' in metrics
            proc.send_signal(signal.SIGTERM)
            until("STOPPING=1")
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.stderr is not None
        log = proc.stderr.read()
    print(f"process start to READY=1 with the real broker: {ready_after * 1000:.0f} ms")
    assert "tok-serve-secret" not in log
    assert not os.path.exists(os.path.join(sockdir, "never-bound.sock"))


@contextmanager
def _real_serve(config_path: Path, sockdir: str, **environ: str
                ) -> Iterator[tuple[subprocess.Popen[bytes], Callable[[], str], Path]]:
    """`buzz-broker serve` on `config_path` as systemd runs it (`NOTIFY_SOCKET`, and
    `environ` beside the test's own environment), its log in a file: yields the process,
    `ready()` (the STATUS= sent with the next READY=1) and the log's path, once it is
    serving; on leaving, SIGTERM and exit 0."""
    notify_path = os.path.join(sockdir, "notify")
    log_path = Path(sockdir) / "daemon.log"
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, **environ)
    env.pop("BUZZ_BROKER_CONFIG", None)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dgram, open(log_path, "wb") as log:
        dgram.bind(notify_path)
        dgram.settimeout(30)

        def ready() -> str:
            while True:
                lines = dgram.recv(4096).decode().split("\n")
                if "READY=1" in lines:
                    return next(line for line in lines if line.startswith("STATUS="))

        proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "--config", str(config_path), "serve"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            ready()
            yield proc, ready, log_path
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _log_lines(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log_path.read_text().splitlines()]


def _config_text(token: TokenConfig, state_dir: Path, *, pin_file: bool = True) -> str:
    pin = f'pin_file = "{token.pin_file}"\n' if pin_file else ""
    return (f'[server]\nsocket = "b.sock"\nshutdown_grace = 5\n'
            f'[state]\ndir = "{state_dir}"\n'
            f'[pkcs11]\nmodule = "{token.module}"\ntoken_label = "{token.token_label}"\n'
            f'{pin}kek_label = "{token.kek_label}"\n'
            f'[relay]\nurl = "ws://127.0.0.1:{free_port()}"\n')


def test_real_broker_reload_says_what_it_did_not_apply(
    custody_state: tuple[TokenConfig, Path], sockdir: str
) -> None:
    """`systemctl reload` then `journalctl -p warning` (docs/install.md step 9) is the
    operator's check: a file the reload rejected, and a setting only a restart applies, each
    show there, and in the STATUS= line `systemctl status` shows. Both used to be INFO lines
    (`reload.config_rejected` followed by `serve.reloaded`; `reload.done` with no word of
    `[relay] url`), and the status said "reloaded" either way."""
    token, state_dir = custody_state
    config_path = Path(sockdir) / "broker.toml"
    good = _config_text(token, state_dir)
    config_path.write_text(good)
    with _real_serve(config_path, sockdir) as (proc, ready, log_path):

        def warnings() -> list[dict[str, Any]]:
            return [line for line in _log_lines(log_path) if line["level"] in ("warning", "error")]

        def reload_with(text: str) -> str:
            config_path.write_text(text)
            proc.send_signal(signal.SIGHUP)
            return ready()

        assert warnings() == []
        # A file that no longer loads: a warning with its one line, and the status says so.
        status = reload_with(good + '[limits]\npublish = "banana"\n')
        assert status.endswith("; reload rejected the config file (still on the previous "
                               "one; see the journal)"), status
        [rejected] = warnings()
        assert rejected["event"] == "reload.config_rejected", rejected
        assert "[limits] publish" in rejected["detail"] and "\n" not in rejected["detail"]
        # A restart-only edit beside a policy one: the policy is applied, the relay named.
        edited = good.replace("[relay]\nurl = \"ws://127.0.0.1:", "[relay]\nurl = \"ws://[::1]:")
        status = reload_with(edited + '[policy]\ndisabled_actions = ["reaction.add"]\n')
        assert status.endswith("; reloaded; restart to apply [relay] url"), status
        [_, waiting] = warnings()
        assert (waiting["event"], waiting["setting"], waiting["detail"]) == (
            "reload.restart_needed", "[relay] url", "[relay] url changed: restart to apply")
        # The file as the daemon started with it: nothing to say.
        assert reload_with(good).endswith("; reloaded")
        assert len(warnings()) == 2
    reloads = [line for line in _log_lines(log_path) if line["event"] == "serve.reloaded"]
    assert [(r["config"], r["restart_needed"]) for r in reloads] == [
        ("rejected", []), ("applied", ["[relay] url"]), ("applied", [])]


def test_real_broker_reload_under_a_systemd_credential_restarts_nothing(
    custody_state: tuple[TokenConfig, Path], sockdir: str
) -> None:
    """Under systemd the PIN is the credential in `$CREDENTIALS_DIRECTORY` (`token-pin`,
    daemon/config.py `PIN_CREDENTIAL`) and the file names no `pin_file`. A reload re-reads
    the file in the daemon's own environment, so the PIN resolves as it did at the start:
    the status says "reloaded", and no setting waits for a restart. (Before: the reread
    passed no environment, every reload under systemd said "restart to apply [pkcs11]
    pin_file", and a warning went to the journal.)"""
    token, state_dir = custody_state
    credentials = Path(sockdir) / "credentials"
    credentials.mkdir(mode=0o700)
    assert token.pin_file is not None
    pin = credentials / PIN_CREDENTIAL
    pin.write_bytes(Path(token.pin_file).read_bytes())
    pin.chmod(0o400)  # as systemd's LoadCredential= hands it over
    config_path = Path(sockdir) / "broker.toml"
    good = _config_text(token, state_dir, pin_file=False)
    config_path.write_text(good)
    with _real_serve(config_path, sockdir, CREDENTIALS_DIRECTORY=str(credentials)) as (
            proc, ready, log_path):
        proc.send_signal(signal.SIGHUP)  # the file as the daemon started with it
        assert ready().endswith("; reloaded"), log_path.read_text()
        config_path.write_text(good + '[policy]\ndisabled_actions = ["reaction.add"]\n')
        proc.send_signal(signal.SIGHUP)  # a policy edit, applied
        assert ready().endswith("; reloaded"), log_path.read_text()
    lines = _log_lines(log_path)
    assert [line for line in lines if line["level"] in ("warning", "error")] == []
    assert [(r["config"], r["restart_needed"]) for r in lines
            if r["event"] == "serve.reloaded"] == [("applied", []), ("applied", [])]


# --------------------------------------------------------------------------- signals, a real process

#: `serve`'s startup as it runs, binding its own socket (so the file is the daemon's to
#: remove), with the fake application of `gated_start_factory(argv[2])`.
GATED_START_CHILD = """
import functools, sys
import trio
from daemon.config import load_config
from daemon.log import setup_logging
from daemon.cli.serve import run_server
from tests.test_serve import FakeApp, gated_start_factory, no_lock
config = load_config(sys.argv[1])
setup_logging(config.log.level)
factory = gated_start_factory(FakeApp(), sys.argv[2])
sys.exit(trio.run(functools.partial(run_server, config, factory, memory_lock=no_lock)))
"""


async def until_logged(log_path: Path, proc: trio.Process | subprocess.Popen[bytes],
                       event: str) -> None:
    """Until the daemon logged `event` (its stderr is in `log_path`); fails at once if the
    process exited first."""
    with trio.fail_after(20):
        while f'"event":"{event}"' not in log_path.read_text():
            assert proc.poll() is None, (f"exited {proc.returncode} before logging {event}: "
                                         f"{log_path.read_text()[-1500:]}")
            await trio.sleep(0.01)


class Child:
    """A daemon child process, its stderr (the JSON log) in a file."""

    def __init__(self, proc: trio.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    def events(self) -> list[str]:
        return [json.loads(line)["event"] for line in self.log_path.read_text().splitlines()
                if line.startswith("{")]


@asynccontextmanager
async def gated_start_child(sockdir: str, dgrams: Datagrams) -> AsyncIterator[Child]:
    config = write_config(sockdir)
    log_path = Path(sockdir) / "child.log"
    env = dict(os.environ, NOTIFY_SOCKET=dgrams.path)
    env.pop("BUZZ_BROKER_CONFIG", None)
    with open(log_path, "wb") as log:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", GATED_START_CHILD, config.source or "",
             os.path.join(sockdir, "gate")],
            cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        yield Child(proc, log_path)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_while_starting_abandons_the_start(sockdir: str, stop: signal.Signals
                                                        ) -> None:
    """SIGTERM or SIGINT before READY=1 (a slow token login): the start is cancelled, the
    socket file removed, exit 0. It used to kill the process (no receiver was open yet:
    -15, the socket file left) or raise KeyboardInterrupt out of the start."""
    dgrams = Datagrams(os.path.join(sockdir, "notify"))
    await dgrams.bind()
    async with gated_start_child(sockdir, dgrams) as child:
        # Sent once the socket is bound, as the application's start begins.
        await dgrams.until("STATUS=opening the token, the stores and the relay pool", timeout=15)
        socket_path = os.path.join(sockdir, "b.sock")
        assert os.path.exists(socket_path)
        child.proc.send_signal(stop)
        with trio.fail_after(15):
            code = await child.proc.wait()
        assert code == EXIT_STOPPED == 0, child.log_path.read_text()[-1500:]
        assert not os.path.exists(socket_path), "the socket file it bound is removed"
        events = child.events()
    await dgrams.until("STOPPING=1")  # sent before it exited: waiting in our socket
    assert "serve.ready" not in events
    assert [e for e in events if e.startswith(("serve.start_abandoned", "test.", "serve.stopped"))
            ] == ["serve.start_abandoned", "test.start_cancelled", "serve.stopped"]
    assert not any("READY=1" in m.split("\n") for m in dgrams.seen)


async def test_a_reload_asked_while_starting_runs_once_serving(sockdir: str) -> None:
    """SIGHUP before READY=1 is kept: the reload runs right after READY=1. It used to end
    the process (SIGHUP's default action, no receiver open yet)."""
    dgrams = Datagrams(os.path.join(sockdir, "notify"))
    await dgrams.bind()
    async with gated_start_child(sockdir, dgrams) as child:
        await dgrams.until("STATUS=opening the token, the stores and the relay pool", timeout=15)
        child.proc.send_signal(signal.SIGHUP)
        child.proc.send_signal(signal.SIGHUP)
        await until_logged(child.log_path, child.proc, "serve.reload_deferred")
        Path(sockdir, "gate").touch()  # the start completes
        ready = (await dgrams.until("READY=1"))[-1].split("\n")
        assert ready[1].startswith("STATUS=serving on ")
        await dgrams.until("RELOADING=1")
        reloaded = (await dgrams.until("READY=1"))[-1].split("\n")
        assert reloaded[1].endswith("; reloaded")
        child.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            code = await child.proc.wait()
        events = child.events()
    assert code == EXIT_STOPPED
    served = events[events.index("serve.ready"):]
    assert served.count("serve.reloaded") == 1  # two SIGHUPs, one reload: both were before it
    assert served.index("serve.reloaded") < served.index("serve.stopping")
    assert "serve.stopped" in events


class HoldingRelay(ScriptedRelay):
    """A scripted relay that keeps back its OK to the EVENT whose content is `HELD` until
    `release()`: a request held at the relay, as a slow relay holds one."""

    HELD = "held at the relay"

    def __init__(self) -> None:
        super().__init__(Script())
        #: Set once the held EVENT has arrived: its request is with the relay.
        self.holding = trio.Event()
        self._released = trio.Event()
        self._held_id: str | None = None

    def release(self) -> None:
        self._released.set()

    async def _handle(self, request: Any) -> None:
        relay = self

        class HoldingSocket:
            def __init__(self, ws: Any) -> None:
                self._ws = ws

            def __getattr__(self, name: str) -> Any:
                return getattr(self._ws, name)

            async def get_message(self) -> str:
                message: str = await self._ws.get_message()
                frame = json.loads(message)
                if frame[0] == "EVENT" and frame[1].get("content") == relay.HELD:
                    relay._held_id = frame[1]["id"]
                return message

            async def send_message(self, message: str) -> None:
                frame = json.loads(message)
                if frame[0] == "OK" and frame[1] == relay._held_id:
                    relay.holding.set()
                    await relay._released.wait()
                await self._ws.send_message(message)

        class HoldingRequest:
            async def accept(self) -> HoldingSocket:
                return HoldingSocket(await request.accept())

        await super()._handle(HoldingRequest())  # type: ignore[arg-type]


@pytest.mark.parametrize("first, second", [
    (signal.SIGTERM, signal.SIGTERM),
    (signal.SIGTERM, signal.SIGHUP),
    (signal.SIGINT, signal.SIGINT),
], ids=["term-term", "term-hup", "int-int"])
async def test_a_second_signal_during_the_drain_lets_the_stop_finish(
    custody_state: tuple[TokenConfig, Path], sockdir: str, nursery: trio.Nursery,
    first: signal.Signals, second: signal.Signals,
) -> None:
    """The real broker, a message.post held at the relay: SIGTERM (or SIGINT) starts the
    drain; a second signal meanwhile is logged and changes nothing; released, the request
    is answered and the stop finishes: the application's close writes the counted reads,
    the socket file is removed, `serve.stopped`, exit 0.

    It used to end the process when the drain ended (the signal left queued in a closed
    receiver got its default action: -15, -1), with none of the closes run; a second
    SIGINT raised KeyboardInterrupt there."""
    token, state_dir = custody_state
    relay = HoldingRelay()
    await nursery.start(relay.serve, free_port())
    channel = str(uuid.uuid4())
    agent = await setup_state(token, state_dir, [channel])
    sock = Path(sockdir) / "b.sock"
    # Neither the relay's timeouts nor the grace end the held request: only `release`.
    config = broker_config(Path(sockdir) / "broker.toml", token=token, state_dir=state_dir,
                           socket=sock, relay_url=relay.url, relay_timeout=60,
                           sections={"server": {"shutdown_grace": 60}})
    daemon = await DaemonProcess.start(config, sock)
    try:
        reads = 3  # counted in memory, written to the audit log by the application's close
        for _ in range(reads):
            read = request_body("storage.address", {"slug": "mem/x"})
            assert envelope(await post(sock, read, agent.credential))["status"] == "succeeded"
        answers: list[Any] = []

        async def held_post() -> None:
            body = request_body("message.post", {"channelId": channel, "content": relay.HELD})
            answers.append(await post(sock, body, agent.credential))

        async with trio.open_nursery() as requests:
            requests.start_soon(held_post)
            with trio.fail_after(20):
                await relay.holding.wait()
            os.kill(daemon.pid, first)
            await until_logged(daemon.log_path, daemon.proc, "serve.stopping")
            # Still held when the second signal is sent: it lands during the drain. (Not
            # waiting for its log line first: the old code logged nothing, it kept the
            # signal queued and died of it once the drain was over.)
            assert answers == []
            os.kill(daemon.pid, second)
            relay.release()
        code = await daemon.wait_exit(30)
        socket_left = sock.exists()  # before `kill`, which removes a dead daemon's socket
    finally:
        daemon.kill()
    assert code == EXIT_STOPPED, daemon.log()[-2000:]
    assert envelope(answers[0])["status"] == "succeeded"
    assert not socket_left
    events = daemon.log_events()
    [stopping] = [e for e in events if e.get("event") == "serve.stopping"]
    assert (stopping["signal"], stopping["in_flight"]) == (first.name, 1)
    [ignored] = [e for e in events if e.get("event") == "serve.signal_ignored"]
    assert ignored["signal"] == second.name
    assert events[-1]["event"] == "serve.stopped"
    counted = [json.loads(line) for _n, path in audit_files(state_dir / AUDIT_DIRNAME)
               for line in path.read_bytes().splitlines()
               if b'"phase":"reads"' in line and b'"storage.address"' in line]
    assert sum(line["count"] for line in counted) == reads


def test_every_signal_has_a_row_in_every_phase() -> None:
    assert set(serve_cli._ON_SIGNAL) == {(phase, ask) for phase in serve_cli._Phase
                                         for ask in serve_cli._Ask}
    assert set(serve_cli._ASKS) == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
