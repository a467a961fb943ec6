"""daemon/notify: sd_notify datagrams, LISTEN_FDS hand-over, WATCHDOG_USEC."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon import notify

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sockdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="bbn", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def listener(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


@pytest.mark.parametrize(
    "lines",
    [(notify.READY,), (notify.WATCHDOG,), (notify.STOPPING,), (notify.READY, notify.status("serving"))],
)
def test_notify_path_socket(sockdir: str, lines: tuple[str, ...]) -> None:
    path = os.path.join(sockdir, "notify")
    with listener(path) as sock:
        assert notify.notify(*lines, environ={"NOTIFY_SOCKET": path}) is True
        assert sock.recv(4096) == "\n".join(lines).encode()


def test_notify_abstract_socket() -> None:
    name = f"bb-notify-test-{os.getpid()}"
    with listener(b"\0" + name.encode()) as sock:
        assert notify.notify(notify.READY, environ={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"READY=1"


def test_notify_without_socket_is_a_no_op() -> None:
    assert notify.notify(notify.READY, environ={}) is False
    assert notify.notify(notify.READY, environ={"NOTIFY_SOCKET": ""}) is False


def test_notify_to_a_missing_socket_raises_oserror(sockdir: str) -> None:
    with pytest.raises(OSError):
        notify.notify(notify.READY, environ={"NOTIFY_SOCKET": os.path.join(sockdir, "gone")})


def test_status_cannot_start_a_new_assignment() -> None:
    assert notify.status("a\nREADY=1\r") == "STATUS=a READY=1 "


def test_listen_fds_absent() -> None:
    assert notify.listen_fds({}) == []


def test_listen_fds_for_another_process_left_alone() -> None:
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x"}
    assert notify.listen_fds(env) == []
    assert env == {}, "the claim is removed so children never inherit it"


@pytest.mark.parametrize(
    "env",
    [{"LISTEN_PID": "abc", "LISTEN_FDS": "1"}, {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "x"}],
)
def test_listen_fds_malformed(env: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        notify.listen_fds(env)


def test_listen_fds_in_a_child_with_fd_3(sockdir: str) -> None:
    # The wrapper a service manager would be: put the socket at fd 3, name our pid, exec.
    path = os.path.join(sockdir, "act.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    script = (
        "import os, sys, socket\n"
        "os.dup2(int(sys.argv[1]), 3)\n"
        "os.environ['LISTEN_PID'] = str(os.getpid()); os.environ['LISTEN_FDS'] = '1'\n"
        "from daemon.notify import listen_fds\n"
        "fds = listen_fds()\n"
        "s = socket.socket(fileno=fds[0])\n"
        "print(fds, s.getsockname(), os.get_inheritable(3), 'LISTEN_PID' in os.environ)\n"
    )
    with server:
        out = subprocess.run(
            [sys.executable, "-c", script, str(server.fileno())],
            pass_fds=(server.fileno(),),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    assert out.strip() == f"[3] {path} False False"


def test_watchdog_interval() -> None:
    assert notify.watchdog_interval({}) is None
    assert notify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    mine = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert notify.watchdog_interval(mine) == 2.0
    other = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert notify.watchdog_interval(other) is None
    for bad in ("0", "-5", "soon"):
        with pytest.raises(ValueError):
            notify.watchdog_interval({"WATCHDOG_USEC": bad})
