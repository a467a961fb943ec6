"""softhsm/make-token run again on a DIR whose token it already made.

With its PIN files there, it logs in with both and prints the same lines, touching neither.
With a PIN file gone (docs/install.md step 3 moves user-pin to the custodian's PIN file and
shreds both) or one the token refuses, it exits 1 with one line on stderr and writes no PIN:
a new random PIN there would be one the token refuses, and install.md's next line would copy
it over the real PIN file. The PIN the token was made with still opens it.

Each test makes its own token in its own DIR (never the session's), and every login is made
by a separate process: SoftHSM reads SOFTHSM2_CONF once per process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.token import MAKE_TOKEN

#: Makes its own SoftHSM token, never the session's: the other-token runs deselect it.
pytestmark = pytest.mark.token_independent

LABEL = "make-token-rerun"
#: The lines make-token prints, in order (its docstring).
FACTS = ("SOFTHSM2_CONF", "module", "token_label", "pin_file")

#: Logs in to the token as argv[3] ("user_pin" or "so_pin") with the PIN in the file argv[4].
_LOGIN = """
import sys, pkcs11
from pkcs11 import exceptions
token = pkcs11.lib(sys.argv[1]).get_token(token_label=sys.argv[2])
pin = open(sys.argv[4], encoding="ascii").read().strip()
try:
    token.open(rw=True, **{sys.argv[3]: pin}).close()
except exceptions.PinIncorrect:
    print("refused")
else:
    print("opens")
"""


def _make_token(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(MAKE_TOKEN), str(directory), "--label", LABEL],
                          capture_output=True, text=True, timeout=120, check=False)


def _facts(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


def _login(facts: dict[str, str], role: str, pin_file: Path) -> str:
    env = dict(os.environ, SOFTHSM2_CONF=facts["SOFTHSM2_CONF"])
    done = subprocess.run([sys.executable, "-c", _LOGIN, facts["module"], LABEL, role,
                           str(pin_file)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _pin_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*-pin"))}


def _refused(done: subprocess.CompletedProcess[str], pins: list[bytes]) -> str:
    """A refusal: exit 1, nothing on stdout, one line on stderr naming no PIN."""
    assert (done.returncode, done.stdout) == (1, ""), (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("make-token: "), done.stderr
    assert not [pin for pin in pins if pin.strip().decode() in done.stderr]
    return lines[0]


def test_a_rerun_with_its_pin_files_checks_them_and_prints_the_same_lines(tmp_path: Path) -> None:
    directory = tmp_path / "softhsm"
    first = _make_token(directory)
    facts = _facts(first)
    assert list(facts) == list(FACTS)
    pins = _pin_files(directory)
    assert sorted(pins) == ["so-pin", "user-pin"]
    again = _make_token(directory)
    assert (again.returncode, again.stdout, again.stderr) == (0, first.stdout, "")
    assert _pin_files(directory) == pins
    assert _login(facts, "user_pin", directory / "user-pin") == "opens"
    assert _login(facts, "so_pin", directory / "so-pin") == "opens"


@pytest.mark.parametrize("gone", [("user-pin", "so-pin"), ("user-pin",), ("so-pin",)])
def test_a_rerun_after_its_pin_files_were_moved_writes_none_and_exits_1(
    tmp_path: Path, gone: tuple[str, ...]
) -> None:
    directory = tmp_path / "softhsm"
    facts = _facts(_make_token(directory))
    pins = _pin_files(directory)
    # As docs/install.md step 3: copied away (user-pin to the custodian's PIN file, so-pin
    # to a password safe), then removed.
    kept = tmp_path / "etc"
    kept.mkdir(mode=0o700)
    for name in gone:
        shutil.copy2(directory / name, kept / name)
        (directory / name).unlink()
    left = _pin_files(directory)

    line = _refused(_make_token(directory), list(pins.values()))
    assert all(name in line for name in gone), line
    assert _pin_files(directory) == left  # no new PIN file, the one left untouched
    # The token kept its PINs: the moved files still open it.
    for name, role in (("user-pin", "user_pin"), ("so-pin", "so_pin")):
        assert _login(facts, role, (kept if name in gone else directory) / name) == "opens"


@pytest.mark.parametrize("wrong", ["user-pin", "so-pin"])
def test_a_rerun_with_a_pin_file_the_token_refuses_exits_1_and_keeps_it(
    tmp_path: Path, wrong: str
) -> None:
    directory = tmp_path / "softhsm"
    facts = _facts(_make_token(directory))
    pins = _pin_files(directory)
    kept = tmp_path / wrong
    shutil.copy2(directory / wrong, kept)
    # A file the token never had as a PIN (another token's, a hand-made one), still 0600.
    (directory / wrong).write_text("0123456789abcdefABCDEF0123456789\n", encoding="ascii")
    left = _pin_files(directory)

    line = _refused(_make_token(directory), [*pins.values(), *left.values()])
    assert str(directory / wrong) in line, line
    assert _pin_files(directory) == left
    role = wrong.replace("-", "_")
    assert _login(facts, role, kept) == "opens"
    assert _login(facts, role, directory / wrong) == "refused"
