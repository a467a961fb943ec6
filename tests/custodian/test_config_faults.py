"""A custodian FILE an operator got wrong is one line and exit 1, never a traceback or an
"internal error", and each is said at load, before the token is opened
(custody/custodian/config.py):

- a file that is not UTF-8 text, or not a regular file (a FIFO blocked the custodian for
  ever: it waited for a writer), or missing (one line, not Python's errno text);
- a `seal` that is none of "auto", "gcm", "etm";
- a NUL character in any string value (a path holding one cannot be opened or bound);
- a `socket` path longer than sockaddr_un holds (107 bytes and its NUL: the daemon's rule
  for its own socket, daemon/http.py `MAX_SOCKET_PATH_BYTES`);
- file mistakes (`FILE_MISTAKES`): a `log_dir` naming a regular file, a signed log that is
  a directory, a name longer than NAME_MAX, an integer past tomllib's 4,300 digits, arrays
  nested past the interpreter's recursion limit, a uid, a cache lifetime or a KEK label
  outside the daemon's rules, a socket path where a file that is no socket lies: each
  named, with the path and the system's reason where a file is at fault.

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
from collections.abc import Callable
from pathlib import Path

import pytest

from custody import CustodyError, TokenConfig
from custody.custodian.server import refuse_if_served
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


def _lines(custodian: str = "", pkcs11: str = "") -> Callable[[Path], None]:
    """Add TOML lines to [custodian] and [pkcs11] of a configuration naming no token."""
    def edit(config: Path) -> None:
        text = config.read_text().replace("[pkcs11]\n", f"{custodian}[pkcs11]\n")
        config.write_text(text + pkcs11)
    return edit


def _kek_label(label: str) -> Callable[[Path], None]:
    def edit(config: Path) -> None:
        text = config.read_text()
        config.write_text(text.replace('kek_label = "buzz-broker-kek"', f"kek_label = {label!r}"))
    return edit


def _signed_log_a_directory(config: Path) -> None:
    (config.parent / "custodian" / "signed.jsonl").mkdir(parents=True)


def _log_dir_a_file(config: Path) -> None:
    (config.parent / "afile").write_text("not a directory")
    _lines('log_dir = "afile"\n')(config)


def _socket_a_file(config: Path) -> None:
    (config.parent / "s").write_text("not a socket")


#: A mistake in FILE or what it names -> how it is made, and what the one line says. Each
#: was a traceback (`python -m custody.custodian`) or "internal error" (`buzz-broker
#: custodian`) before.
FILE_MISTAKES: dict[str, tuple[Callable[[Path], None], str]] = {
    "log_dir a regular file": (_log_dir_a_file, "Not a directory"),
    "the signed log a directory": (_signed_log_a_directory, "Is a directory"),
    "a log_dir name past NAME_MAX": (_lines(f'log_dir = "{"a" * 300}"\n'),
                                     "File name too long"),
    "an integer past 4,300 digits": (_lines(f"max_records = 1{'0' * 5000}\n"),
                                     "an integer too long to read"),
    "arrays nested 5,000 deep": (
        _lines(pkcs11=f"unsealed_cache_entries = {'[' * 5000}{']' * 5000}\n"),
        "nested too deeply"),
    "pipeline_uid -1": (_lines("pipeline_uid = -1\n"),
                        "[custodian] pipeline_uid must be 0 to 4294967294, not -1"),
    "pipeline_uid 10**20": (_lines(f"pipeline_uid = {10**20}\n"),
                            "[custodian] pipeline_uid must be 0 to 4294967294"),
    "unsealed_cache_seconds inf": (_lines(pkcs11="unsealed_cache_seconds = inf\n"),
                                   "[pkcs11] unsealed_cache_seconds must be above 0"),
    "unsealed_cache_seconds past a float": (
        _lines(pkcs11=f"unsealed_cache_seconds = 1{'0' * 400}\n"),
        "[pkcs11] unsealed_cache_seconds must be above 0"),
    "the socket path a regular file": (_socket_a_file, "exists and is not a socket"),
    "an empty kek_label": (_kek_label(""),
                           "[pkcs11] kek_label must be 1 to 255 printable ASCII"),
}


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_file_mistakes_are_one_line_naming_the_cause(tmp_path: Path, entry: str) -> None:
    wrong = []
    for case, (make, said) in FILE_MISTAKES.items():
        where = tmp_path / case.replace(" ", "-").replace(",", "")
        where.mkdir()
        config = write_custodian_config(where / "custodian.toml",
                                        token=TokenConfig("m", "t", None), state_dir=where,
                                        socket=where / "s", relay_url="ws://127.0.0.1:1")
        config.write_text(config.read_text().replace(f'"{where}/', '"'))  # relative paths
        make(config)
        done = _run(entry, config)
        try:
            _one_line(done, said)
        except AssertionError:
            wrong.append(f"{case}: {done.returncode} {done.stderr.strip()[-160:]!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.token_independent
@pytest.mark.parametrize("make", ["directory", "fifo", "file"])
def test_anything_at_the_socket_path_that_is_no_socket_is_refused_naming_it(
        tmp_path: Path, make: str) -> None:
    """server.py `refuse_if_served`: not only a regular file, but a directory or a FIFO at
    `[custodian] socket` is refused in one line before the token is opened (a bind there
    fails inside the nursery, unsaid)."""

    path = tmp_path / "s"
    {"directory": path.mkdir, "fifo": lambda: os.mkfifo(path),
     "file": lambda: path.write_text("x")}[make]()
    with pytest.raises(CustodyError, match="exists and is not a socket"):
        refuse_if_served(path)
