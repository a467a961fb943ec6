"""The socket file the custodian binds is removed when it stops, and only that one.

A custodian that binds its own socket (no systemd socket unit) left the file behind at a
clean stop: harmless to the next start (which removes a stale socket), but an operator
listing the runtime directory saw a socket nobody served. A socket systemd passed is the
unit's, and stays (tests/custodian/test_activation.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

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


async def test_the_socket_is_never_more_open_than_0600_before_its_mode_is_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between bind and chmod the socket file has the mode the umask gave it: bound under
    umask 0177 it is 0600 (the custodian's uid alone) until chmod sets `socket_mode`,
    whatever the process's own umask. In-process: serve() with a custodian that is never
    asked anything, os.chmod watched."""
    import os
    import stat

    import trio

    from custody.custodian.server import Custodian, Settings, serve

    path = tmp_path / "c.sock"
    custodian = Custodian(object(), Settings(  # type: ignore[arg-type]
        socket=path, pipeline_uid=os.getuid(), relay_url="wss://r.example",
        log_path=tmp_path / "log" / "signed.jsonl"))
    before_chmod: list[int] = []
    chmod = os.chmod

    def watched(target: object, mode: int, *args: object, **kwargs: object) -> None:
        if Path(str(target)) == path:
            before_chmod.append(stat.S_IMODE(os.stat(path).st_mode))
        chmod(target, mode, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "chmod", watched)
    umask = os.umask(0)  # the process's own: as open as it gets
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, custodian)
            assert stat.S_IMODE(path.stat().st_mode) == custodian.settings.socket_mode
            nursery.cancel_scope.cancel()
    finally:
        os.umask(umask)
    assert before_chmod == [0o600]

