"""The custodian's command line: words none of its forms take are a usage error, exit 2
(docs/operations.md, "Exit codes: every command"), its usage line on stderr, said before
FILE is read, from both entry points (`buzz-broker custodian` and `python -m
custody.custodian`). Before, a mistake inside `keys` (a misspelt option, a missing
subcommand or BACKUP) exited 1, as a fault does, and only once FILE had been read.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from custody.custodian.keys import USAGE as KEYS_USAGE
from custody.custodian.main import EXIT_USAGE, USAGE

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"buzz-broker custodian": ["daemon.cli", "custodian"],
                "python -m custody.custodian": ["custody.custodian"]}
#: Words after FILE -> the usage line said.
MISTAKES: dict[tuple[str, ...], str] = {
    ("--bogus",): USAGE,
    ("--verify-log", "extra"): USAGE,
    ("--recover", "a" * 64, "extra"): USAGE,
    ("serve",): USAGE,
    ("keys",): f"usage: buzz-broker custodian FILE {KEYS_USAGE}",
    ("keys", "spin"): f"usage: buzz-broker custodian FILE {KEYS_USAGE}",
    ("keys", "rotate", "--new-kek-labl", "foo"): f"usage: buzz-broker custodian FILE {KEYS_USAGE}",
    ("keys", "init", "--yes"): f"usage: buzz-broker custodian FILE {KEYS_USAGE}",
    ("keys", "migrate"): f"usage: buzz-broker custodian FILE {KEYS_USAGE}",
    ("keys", "restore", "--identity", "id"): f"usage: buzz-broker custodian FILE {KEYS_USAGE}",
}


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("words", MISTAKES, ids=" ".join)
def test_a_mistake_is_its_usage_line_and_exit_2_before_file_is_read(
        tmp_path: Path, entry: str, words: tuple[str, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
    missing = tmp_path / "no-such-custodian.toml"  # never read: the words are wrong first
    done = subprocess.run([sys.executable, "-m", *ENTRY_POINTS[entry], str(missing), *words],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (EXIT_USAGE, ""), (done.returncode, done.stderr)
    assert done.stderr == f"{MISTAKES[words]}\n", done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.token_independent
def test_no_file_is_argparse_line_naming_file_alone() -> None:
    """`buzz-broker custodian` with nothing after it: FILE is what is missing, not the
    words after it (which `custodian FILE` does without: it serves)."""
    done = subprocess.run([sys.executable, "-m", "daemon.cli", "custodian"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "buzz-broker custodian: error: the following arguments are required: FILE")


#: Words asking for help, FILE among them or not -> exit 0, the usage on stdout.
HELP_WORDS = [("--help",), ("-h",), ("--", "--help"), ("--", "-h"), ("FILE", "--help"),
              ("FILE", "keys", "-h"), ("FILE", "--recover", "--help")]


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("words", HELP_WORDS, ids=" ".join)
def test_help_where_file_goes_is_the_usage_and_exit_0(
        tmp_path: Path, entry: str, words: tuple[str, ...]) -> None:
    """Before, `python -m custody.custodian --help` (and `buzz-broker custodian -- --help`)
    read `--help` as FILE: a file error, exit 1. Asking reads nothing, opens no token.
    (`buzz-broker custodian --help` before FILE is argparse's, tests/cli/test_help.py.)"""
    missing = str(tmp_path / "no-such-custodian.toml")
    argv = [missing if w == "FILE" else w for w in words]
    done = subprocess.run([sys.executable, "-m", *ENTRY_POINTS[entry], *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, ""), (done.returncode, done.stderr)
    assert done.stdout.startswith("usage: buzz-broker custodian "), done.stdout
    assert "FILE" in done.stdout, done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("words", [("--bogus",), ("--", "--bogus"), ("-x", "--verify-log"),
                                   ("--", "-", "--recover", "a" * 64)], ids=" ".join)
def test_a_flag_where_file_goes_is_a_usage_line_not_a_file_error(
        entry: str, words: tuple[str, ...]) -> None:
    """A flag-like FILE that is not a help flag: the usage line, exit 2, not a file error."""
    if entry == "buzz-broker custodian" and words[0] != "--":
        pytest.skip("argparse's own: an option it does not take before FILE")
    done = subprocess.run([sys.executable, "-m", *ENTRY_POINTS[entry], *words], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (EXIT_USAGE, ""), (done.returncode, done.stderr)
    assert done.stderr == f"{USAGE}\n", done.stderr


#: A PUBKEY not 64 lowercase hex -> what its line says (the words themselves never echoed:
#: a secret key pasted by mistake is hex too).
MALFORMED_PUBKEYS: dict[tuple[str, ...], str] = {
    ("--recover", "nsec1" + "q" * 58): "custodian: the key named is not a pubkey",
    ("--recover", "A" * 64): "custodian: the key named is not a pubkey",
    ("--forget-destroyed", "a" * 64, "../" + "b" * 61): "custodian: key 2 named is not a pubkey",
}


@pytest.mark.token_independent
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("words", MALFORMED_PUBKEYS, ids=lambda w: w[0])
def test_a_malformed_pubkey_is_a_usage_line_before_file_is_read(
        tmp_path: Path, entry: str, words: tuple[str, ...]) -> None:
    """Before, `--recover`/`--forget-destroyed` with a malformed PUBKEY exited 1, a fault's
    code, and only once FILE had been read; a malformed argument is a usage error."""
    missing = tmp_path / "no-such-custodian.toml"  # never read: the words are wrong first
    done = subprocess.run([sys.executable, "-m", *ENTRY_POINTS[entry], str(missing), *words],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (EXIT_USAGE, ""), (done.returncode, done.stderr)
    [line] = done.stderr.splitlines()
    assert line.startswith(MALFORMED_PUBKEYS[words]), line
    assert not any(word in line for word in words[1:]), line
    assert list(tmp_path.iterdir()) == []
