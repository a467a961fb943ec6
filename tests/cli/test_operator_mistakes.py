"""An operator's mistakes that are no configuration fault, each one clear line: the wrong
user on the state directory, a FIFO named as a file, `--config` after the command, an
empty `--new-kek-label`. Run as an operator runs them (`python -m daemon.cli`
subprocesses, with a timeout: a FIFO must be refused, not waited on); never a traceback,
never the internal error (70).

The configuration faults themselves, through `check-config --deep` and `serve`, are
tests/cli/test_misconfiguration.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from custody import TokenConfig
from tests.custody._secrets import PUB_2, SECRET_1
from tests.fixtures.broker import write_config

REPO = Path(__file__).resolve().parents[2]
#: EX_SOFTWARE: what `main` answers for an exception nothing named (daemon/cli/__init__.py).
EXIT_INTERNAL = 70


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("BUZZ_BROKER_CONFIG", "BUZZ_BROKER_CREDENTIAL",
                         "BUZZ_BROKER_CREDENTIAL_FILE", "CREDENTIALS_DIRECTORY")}


def _run(*argv: str, prefix: list[str] | None = None,
         stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [*(prefix or []), sys.executable, "-m", "daemon.cli", *argv]
    try:
        if stdin is not None:
            return subprocess.run(command, cwd=REPO, env=_env(), capture_output=True,
                                  text=True, input=stdin, timeout=60)
        return subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{' '.join(argv)} hung instead of refusing") from None


def _one_line(done: subprocess.CompletedProcess[str], code: int, *wanted: str) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("buzz-broker: "), done.stderr
    for part in wanted:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def _minimal_config(tmp_path: Path, state: Path) -> Path:
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = {json.dumps(str(state))}\n'
                      '[relay]\nurl = "ws://127.0.0.1:1"\n')
    return config


@pytest.mark.parametrize("command", [
    ["agent", "list"], ["credential", "list"], ["audit", "verify"], ["audit", "show"],
    ["keys", "init"],
], ids=" ".join)
def test_a_state_directory_this_user_cannot_read_is_one_line_naming_it(
    command: list[str], tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    config = _minimal_config(tmp_path, state)
    prefix: list[str] = []
    if os.geteuid() == 0:  # root reads anything: run it without the capabilities that allow it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) not installed")
        prefix = [setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search",
                  "--"]
    state.chmod(0o000)
    try:
        done = _run("--config", str(config), *command, prefix=prefix)
    finally:
        state.chmod(0o700)
    assert done.returncode != EXIT_INTERNAL, done.stderr
    _one_line(done, 1, f"cannot use {state}", "Permission denied", "daemon's user",
              f"buzz-broker-admin {command[0]} …")


def test_a_fifo_named_as_the_config_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "broker.toml"
    os.mkfifo(fifo)
    for argv in (["--config", str(fifo), "status"], ["--config", str(fifo), "agent", "list"],
                 ["check-config", str(fifo)]):
        _one_line(_run(*argv), 1, f"config {fifo}: not a regular file")


def test_a_fifo_named_as_the_credential_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "credential"
    os.mkfifo(fifo)
    done = _run("call", "message.post", "--args", "{}", "--socket", str(tmp_path / "b.sock"),
                "--credential-file", str(fifo))
    _one_line(done, 1, f"credential file {fifo} is not a regular file")


@pytest.mark.parametrize("config_word", [["--config", "broker.toml"], ["--config=broker.toml"]],
                         ids=["separate", "joined"])
def test_config_after_the_command_says_where_it_goes(config_word: list[str]) -> None:
    done = _run("status", *config_word)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.splitlines()[-1]
    assert "unrecognized arguments: --config" in last
    assert "--config goes before the command" in last


@pytest.mark.parametrize("words", [["rotate"], ["migrate", "--to-config", "SELF"]],
                         ids=["rotate", "migrate"])
def test_an_empty_new_kek_label_is_refused_before_anything_changes(
    words: list[str], tmp_path: Path, custody_state: tuple[TokenConfig, Path],
) -> None:
    token, state = custody_state
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "b.sock", relay_url="ws://127.0.0.1:1")
    words = [str(config) if word == "SELF" else word for word in words]
    done = _run("--config", str(config), "keys", *words, "--new-kek-label", "")
    _one_line(done, 2, "--new-kek-label is empty")
    assert not state.exists(), "the refused command made the state directory"


#: What a shell passes for `--name $'a\xffb'`: a byte that is not UTF-8, which Python's argv
#: decoding turns into a lone surrogate (U+DCFF) that SQLite cannot store.
NOT_UTF8 = os.fsdecode(b"a\xffb")


@pytest.mark.parametrize("words, stdin", [
    (["create", "--owner", PUB_2, "--name", NOT_UTF8], None),
    (["create", "--owner", PUB_2, "--name", os.fsdecode(b"\xff\xfe")], None),
    (["import", "--owner", PUB_2, "--name", os.fsdecode(b"\xff")], SECRET_1),
    (["create", "--owner", PUB_2, "--name", "Bob\x1b[2J"], None),
    (["import", "--owner", PUB_2, "--name", "Bob\u202e"], SECRET_1),
], ids=["create-not-utf8", "create-only-not-utf8", "import-not-utf8", "create-escape",
        "import-bidi-override"])
def test_a_name_that_cannot_be_kept_is_refused_before_a_key_is_made(
    words: list[str], stdin: str | None, tmp_path: Path,
    custody_state: tuple[TokenConfig, Path],
) -> None:
    # It was minted first, then the name's write raised UnicodeEncodeError: exit 70, the
    # pubkey never printed, and a retry minted a second key.
    token, state = custody_state
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "b.sock", relay_url="ws://127.0.0.1:1")
    done = _run("--config", str(config), "agent", *words, stdin=stdin)
    _one_line(done, 2, "--name: name must be")  # a malformed argument: usage
    assert done.stdout == ""
    listed = _run("--config", str(config), "agent", "list", "--all", "--json")
    assert (listed.returncode, listed.stdout) == (0, ""), listed.stderr  # no key made


def test_agent_name_refuses_a_name_that_cannot_be_kept(
    tmp_path: Path, custody_state: tuple[TokenConfig, Path],
) -> None:
    token, state = custody_state
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "b.sock", relay_url="ws://127.0.0.1:1")
    made = _run("--config", str(config), "agent", "create", "--owner", PUB_2, "--name", "x")
    assert made.returncode == 0, made.stderr
    pubkey = made.stdout.strip()
    for name in (os.fsdecode(b"\xff\xfe"), "x\ny"):
        _one_line(_run("--config", str(config), "agent", "name", pubkey, name), 2,
                  "NAME: name must be")
    listed = _run("--config", str(config), "agent", "list", "--json")
    assert json.loads(listed.stdout)["name"] == "x"  # unchanged


def test_ctrl_c_while_the_command_module_loads_is_exit_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # The kill point: SIGINT lands while `_parser` imports the command's module (~0.3 s of
    # `agent import`); it was outside main's handlers and printed a traceback.
    import importlib

    from daemon.cli import main

    def interrupted(name: str) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    try:
        code = main(["agent", "list"])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped main: Python prints its traceback")
    assert code == 130
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["create", "import"])
def test_ctrl_c_during_the_name_write_leaves_no_key_whose_pubkey_was_not_printed(
    tmp_path: Path, custody_state: tuple[TokenConfig, Path], command: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # The kill point: SIGINT after the key is minted (or sealed, for an import: its secret
    # on stdin, as an operator pipes it), during the name's write. The pubkey was printed
    # after that write, so the operator never saw the key left held.
    from daemon.cli import main
    from daemon.state.directory import AgentDirectory

    token, state = custody_state
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "b.sock", relay_url="ws://127.0.0.1:1")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    secret = tmp_path / "secret"
    secret.write_text(SECRET_1 + "\n")
    with secret.open() as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(AgentDirectory, "enroll", interrupted)
        code = main(["--config", str(config), "agent", command, "--owner", PUB_2,
                     "--name", "x"])
    assert code == 130
    printed = capsys.readouterr().out.split()
    monkeypatch.undo()
    listed = _run("--config", str(config), "agent", "list", "--json")
    held = [json.loads(line)["pubkey"] for line in listed.stdout.splitlines()]
    assert len(held) == 1 and printed == held


def test_a_names_file_past_its_bound_is_refused_not_read_in_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # `agent import-names` reads at most MAX_NAMES_BYTES + 1 bytes: a longer file is
    # refused whole, never cut at the bound and its first lines taken (here the cut falls
    # on a line's end, so what was read parses).
    from daemon.cli import agent, main

    header = json.dumps({"restore": {"file": "agents.age", "sha256": "0" * 64}}) + "\n"
    entry = json.dumps({"pubkey": PUB_2, "name": "x", "creator": PUB_2,
                        "restored": True}) + "\n"
    names = tmp_path / "names"
    names.write_text(header + entry + entry.replace('"x"', '"y"'))
    monkeypatch.setattr(agent, "MAX_NAMES_BYTES", len(header + entry) - 1)
    config = _minimal_config(tmp_path, tmp_path / "state")
    with names.open() as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        code = main(["--config", str(config), "agent", "import-names"])
    assert code == 1
    assert "the names file is larger than" in capsys.readouterr().err
    assert not (tmp_path / "state" / "key-events").exists()  # nothing recorded


def test_remove_reads_one_short_line_of_any_stdin(tmp_path: Path) -> None:
    # "One short line is all that is read: stdin may be anything" (agent.py `_confirmed`):
    # an endless stdin with no newline is refused at once, not read into memory (the run
    # is capped at 2 GB of address space so an unbounded read fails fast, not the host).
    config = _minimal_config(tmp_path, tmp_path / "state")
    with open("/dev/zero", "rb") as zeros:
        done = subprocess.run(
            ["prlimit", "--as=2000000000", "--", sys.executable, "-m", "daemon.cli",
             "--config", str(config), "agent", "remove", PUB_2],
            cwd=REPO, env=_env(), capture_output=True, text=True, stdin=zeros, timeout=60)
    assert done.returncode == 1 and "not confirmed; nothing removed" in done.stderr, (
        done.returncode, done.stderr[-300:])
