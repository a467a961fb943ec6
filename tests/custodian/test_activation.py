"""Socket activation of the custodian (buzz-custodian.socket): a listener holds the socket,
the first connection starts the custodian with the socket passed as fd 3 (sd_listen_fds(3)),
and the request that connected is answered by it.

`systemd-socket-activate` (shipped with systemd) plays PID 1's part: it binds the socket,
waits for the first connection and then execs the custodian with LISTEN_FDS=1 and
LISTEN_PID set, exactly the contract of a `.socket` unit with Accept=no. The real
systemd run of both units is tests/nspawn/ (docs/custodian.md says what it covers).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from custody import TokenConfig
from custody.custodian import messages
from custody.custodian.client import request
from tests.custodian.test_refusals import ask
from tests.fixtures.custodian import write_custodian_config
from tests.fixtures.stop import terminate_then_kill

ACTIVATE = shutil.which("systemd-socket-activate")
_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(ACTIVATE is None, reason="systemd-socket-activate not installed")


def _listener(config: Path, socket_path: Path, log: Path) -> subprocess.Popen[bytes]:
    assert ACTIVATE is not None
    env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
    # It starts the program with only the variables named by -E (as PID 1 starts a unit
    # with only its Environment=): pass ours on.
    keep = [f"-E{name}" for name in env if name.isidentifier()]
    with log.open("ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [ACTIVATE, "-l", str(socket_path), *keep, "--", sys.executable, "-m",
             "custody.custodian", str(config)], cwd=_ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not socket_path.is_socket():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    return proc


def test_the_first_request_starts_the_custodian_on_the_passed_socket(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    token, state_dir = custody_state
    socket_path = tmp_path / "custodian.sock"
    config = write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state_dir,
                                    socket=socket_path, relay_url=local_relay)
    log = tmp_path / "custodian.log"
    proc = _listener(config, socket_path, log)
    try:
        # Nothing has started yet: only the listener holds the socket.
        assert "listening" not in log.read_text()
        inode = socket_path.stat().st_ino
        ok, value = ask(socket_path, "records_version")  # waits in the backlog meanwhile
        assert ok and isinstance(value, int), value
        assert "custodian: listening" in log.read_text()
        # The same process (exec'd in place) serves the same socket file: never re-bound.
        assert socket_path.stat().st_ino == inode and proc.poll() is None
        ok, value = ask(socket_path, "agent", pubkey="00" * 32, include_deleted=False)
        assert ok and value is None
    finally:
        terminate_then_kill(proc, 10)
    assert socket_path.is_socket()  # the unit's socket: a stopping custodian leaves it


def test_a_passed_socket_that_is_not_the_configured_one_is_one_line_and_exit_1(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    token, state_dir = custody_state
    config = write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state_dir,
                                    socket=tmp_path / "configured.sock", relay_url=local_relay)
    socket_path = tmp_path / "unit.sock"
    log = tmp_path / "custodian.log"
    proc = _listener(config, socket_path, log)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(socket_path))
            sock.sendall(request("records_version"))
            try:  # closed unanswered: the custodian refused to serve it
                assert sock.recv(16) == b""
            except ConnectionResetError:
                pass
        assert proc.wait(timeout=20) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [l for l in log.read_text().strip().splitlines() if l.startswith("custodian:")]
    assert lines == [f"custodian: systemd passed {str(socket_path)!r}, the configuration names "
                     f"{str(tmp_path / 'configured.sock')!r} ([custodian] socket must equal "
                     "ListenStream=)"], lines
