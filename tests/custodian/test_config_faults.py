"""A custodian FILE an operator got wrong is one line and exit 1, never a traceback or an
"internal error", and each is said at load, before the token is opened
(custody/custodian/config.py):

- a file that is not UTF-8 text, or not a regular file (a FIFO blocked the custodian for
  ever: it waited for a writer), or missing (one line, not Python's errno text);
- a `seal` that is none of "auto", "gcm", "etm";
- a NUL character in any string value (a path holding one cannot be opened or bound);
- a `socket` path longer than sockaddr_un holds (107 bytes and its NUL: the daemon's rule
  for its own socket, daemon/http.py `MAX_SOCKET_PATH_BYTES`).

And a socket directory the custodian makes itself (no systemd socket unit) is 0750, as
buzz-custodian.socket's DirectoryMode= and the daemon's own socket directory: the
pipeline reaches the socket by group, nobody else lists the directory.

Both entry points are run: `buzz-broker custodian FILE` (the unit's ExecStart) and
`python -m custody.custodian FILE`.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from custody import TokenConfig
from tests.fixtures.custodian import CustodianProcess, write_custodian_config

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"buzz-broker custodian": ["daemon.cli", "custodian"],
                "python -m custody.custodian": ["custody.custodian"]}


def _run(entry: str, config: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
    return subprocess.run([sys.executable, "-m", *ENTRY_POINTS[entry], str(config)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)


def _one_line(done: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert done.returncode == 1, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def _config(custody_state: tuple[TokenConfig, Path], tmp_path: Path, socket: Path) -> Path:
    token, state_dir = custody_state
    return write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state_dir,
                                  socket=socket, relay_url="ws://127.0.0.1:1")


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path, entry: str) -> None:
    config = tmp_path / "custodian.toml"
    config.write_bytes(b'[custodian]\nsocket = "\xff\xfe"\n')
    _one_line(_run(entry, config), str(config), "not UTF-8 text")


#: A configuration path that is not a regular file -> how it is made, and what is said.
NOT_A_FILE = {"fifo": (os.mkfifo, "not a regular file"),
              "directory": (os.mkdir, "not a regular file"),
              "missing": (lambda path: None, "cannot read (No such file or directory)")}


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("kind", NOT_A_FILE)
def test_a_path_that_is_no_regular_file_is_one_line(tmp_path: Path, entry: str,
                                                    kind: str) -> None:
    make, said = NOT_A_FILE[kind]
    config = tmp_path / "custodian.toml"
    make(config)
    _one_line(_run(entry, config), str(config), said)


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_unknown_seal_is_one_line_naming_the_key(tmp_path: Path, entry: str) -> None:
    # It was said at the token's open, as "unknown seal", naming neither file nor key.
    config = write_custodian_config(tmp_path / "custodian.toml",
                                    token=TokenConfig("m", "t", None), state_dir=tmp_path,
                                    socket=tmp_path / "s", relay_url="wss://r")
    config.write_text(config.read_text().replace('seal = "auto"', 'seal = "bogus"'))
    _one_line(_run(entry, config), str(config), "[pkcs11] seal must be one of auto, gcm, etm")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_socket_path_longer_than_sockaddr_un_holds_is_one_line_before_the_token(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path, entry: str) -> None:
    socket = tmp_path / ("s" * 120 + ".sock")
    done = _run(entry, _config(custody_state, tmp_path, socket))
    _one_line(done, "[custodian] socket", "longer than 107 bytes")
    assert not socket.exists()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_nul_in_a_path_is_one_line_naming_the_key(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path, entry: str) -> None:
    config = _config(custody_state, tmp_path, tmp_path / "c.sock")
    config.write_text(config.read_text().replace("c.sock", "c\\u0000.sock"))
    _one_line(_run(entry, config), "[custodian] socket", "NUL")


def test_a_socket_path_of_107_bytes_still_serves(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    """The bound itself is a path bind() takes: the check refuses nothing that worked."""
    socket = tmp_path / "s"
    socket = tmp_path / ("s" * (107 - len(os.fsencode(socket)) + 1))
    assert len(os.fsencode(socket)) == 107
    process = CustodianProcess(_config(custody_state, tmp_path, socket), socket)
    process.start()
    try:
        assert socket.is_socket()
    finally:
        process.stop()


def test_a_socket_directory_it_makes_is_0750_whatever_the_umask(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    socket = tmp_path / "run" / "custodian" / "c.sock"
    process = CustodianProcess(_config(custody_state, tmp_path, socket), socket)
    old = os.umask(0o022)  # the child's: a login shell's usual one, which made it 0755
    try:
        process.start()
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(socket.parent.stat().st_mode) == 0o750
        assert socket.is_socket()
    finally:
        process.stop()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_socket_directory_it_cannot_make_is_one_line(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path, entry: str) -> None:
    (tmp_path / "file").write_text("not a directory")
    socket = tmp_path / "file" / "run" / "c.sock"
    _one_line(_run(entry, _config(custody_state, tmp_path, socket)),
              f"socket directory {socket.parent}")
