"""The socket file the custodian binds is removed when it stops, and only that one.

A custodian that binds its own socket (no systemd socket unit) left the file behind at a
clean stop: harmless to the next start (which removes a stale socket), but an operator
listing the runtime directory saw a socket nobody served. A socket systemd passed is the
unit's, and stays (tests/custodian/test_activation.py).
"""

from __future__ import annotations

from pathlib import Path

from custody import TokenConfig
from tests.fixtures.custodian import running_custodian


def test_a_stopped_custodian_removes_the_socket_it_bound(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    with running_custodian(custody_state, local_relay, tmp_path) as process:
        assert process.socket.is_socket()
        process.stop()
        assert not process.socket.exists(), process.stderr.read_text()[-2000:]


def test_a_socket_file_that_is_no_longer_its_own_is_left(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    # Whoever bound the path since (a newer custodian) owns it now.
    with running_custodian(custody_state, local_relay, tmp_path) as process:
        process.socket.unlink()
        process.socket.write_text("not the custodian's")
        process.stop()
        assert process.socket.read_text() == "not the custodian's"


def test_a_second_custodian_on_a_served_socket_refuses_and_takes_nothing(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    """A socket file at the path is a killed custodian's (removed, bound anew) only if
    nobody answers on it: a second custodian started by hand beside a running one used to
    unlink the running one's socket and serve in its place, leaving it unreachable."""
    import os
    import subprocess
    import sys

    from tests.custodian.test_refusals import ask

    with running_custodian(custody_state, local_relay, tmp_path) as process:
        inode = process.socket.stat().st_ino
        env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
        second = subprocess.run([sys.executable, "-m", "custody.custodian", str(process.config)],
                                cwd=Path(__file__).resolve().parents[2], env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stderr
        assert "another custodian is listening on" in second.stderr
        assert "Traceback" not in second.stderr
        assert process.socket.stat().st_ino == inode, "the running one's socket is untouched"
        assert ask(process.socket, "records_version")[0], "and it still answers"
