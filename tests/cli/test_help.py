"""`--help` of every command and subcommand answers on stdout, exits 0, and says nothing on
stderr: the `buzz-broker` parser's whole tree as argparse holds it (so a command added
later is asked too), and the custodian's own words after its FILE, which argparse does not
parse (`buzz-broker custodian FILE keys ...` is custody/custodian/keys.py's).
"""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from custody.custodian.keys import _OPTIONS as CUSTODIAN_KEYS
from daemon import cli


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _paths() -> list[list[str]]:
    paths: list[list[str]] = [[]]
    for name in cli.COMMANDS:
        command = _subcommands(cli._parser(name))[name]
        paths.append([name])
        paths.extend([name, sub] for sub in _subcommands(command))
    return paths


def _help(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("path", _paths(), ids=lambda p: " ".join(p) or "buzz-broker")
def test_every_command_and_subcommand_answers_help(path: list[str]) -> None:
    code, out, err = _help([*path, "--help"])
    assert (code, err) == (0, ""), (path, code, err)
    assert out.startswith(f"usage: buzz-broker {' '.join(path)}".rstrip()), out


@pytest.mark.parametrize("words", [["--help"], ["-h"], ["keys", "--help"]] + [
    ["keys", sub, "--help"] for sub in CUSTODIAN_KEYS], ids=" ".join)
def test_the_custodians_own_words_answer_help(words: list[str]) -> None:
    """FILE need not exist: asking for help reads nothing, opens no token."""
    code, out, err = _help(["custodian", "/nonexistent/custodian.toml", *words])
    assert (code, err) == (0, ""), (words, code, err)
    assert out.startswith("usage: buzz-broker custodian FILE"), out
    for sub in CUSTODIAN_KEYS:
        assert f"keys {sub}" in out, (sub, out)


def test_the_custodian_commands_help_names_every_keys_subcommand() -> None:
    code, out, _ = _help(["custodian", "--help"])
    assert code == 0
    assert "keys --help" in " ".join(out.split()), out
