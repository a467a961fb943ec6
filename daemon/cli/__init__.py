"""The `buzz-broker` command line: one entry point, one module per command.

Rules:
- Each command lives in `daemon/cli/<name>.py` and exposes `HELP: str`,
  `add_arguments(parser)` and `run(args) -> int`. `COMMANDS` below is the only list of them.
- A command reports a fault by raising `CliError` with one clear line; `main` prints it
  on stderr and exits non-zero: 1, or `EXIT_USAGE` for a malformed argument
  (`_common.UsageError`, the code argparse gives its own refusals). No traceback reaches
  an operator: anything else that escapes is reported as an internal error with its type
  name only (the text of an unexpected exception could carry a secret). A PermissionError is not unexpected (the
  wrong user, most often on the state directory): one line naming the file, exit 1
  (`_common.permission_denied`).
- Secrets (PINs, credentials, secret keys) never come from argv: files, stdin, or the
  environment variables each command documents.
- A command in `STATE_COMMANDS` opens files under ``[state] dir``. Run as root on a state
  directory another user owns (the daemon's), it is refused before it starts: it would
  leave root-owned files the daemon cannot open (`_common.refuse_foreign_state`). One that
  exists and is not a directory is refused too, by every user (`_common.refuse_unusable_state`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from collections.abc import Sequence
from typing import NoReturn

from buzzwire.contract import printable
from custody import harden_process
from daemon.cli._common import (
    EXIT_USAGE,
    CliError,
    config_from_args,
    permission_denied,
    refuse_foreign_state,
    refuse_unusable_state,
)

__all__ = ["main", "CliError", "COMMANDS", "STATE_COMMANDS", "EXIT_USAGE"]

#: command name -> (module under daemon.cli, one-line help). A command's module is imported
#: only when that command runs, so one command's dependencies never slow down or break another.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "run the daemon in the foreground (as systemd does)"),
    "check-config": ("check_config", "validate a configuration file"),
    "keys": ("keys", "manage the token's key-encryption key; back up and restore agents"),
    "agent": ("agent", "import, create, list and remove agent keys"),
    "credential": ("credential", "issue, list and revoke agent credentials"),
    "call": ("call", "send one request to the broker as an agent"),
    "audit": ("audit", "verify and read the audit log"),
    "status": ("status", "is the daemon running; token, relay, agents, credentials, audit"),
    "custodian": ("custodian", "run the custodian, the process that holds the keys (its own config)"),
}

#: Commands that create or open files under [state] dir (SQLite opens create -wal/-shm
#: files even to read). `call` and `check-config` do not.
STATE_COMMANDS = frozenset({"serve", "keys", "agent", "credential", "audit", "status"})

EXIT_INTERNAL = 70  # EX_SOFTWARE
#: 128 + SIGPIPE: what a shell reports for a command whose reader went away (`| head`).
EXIT_CLOSED_PIPE = 141


def _selected(argv: Sequence[str]) -> str | None:
    """The command named on the command line, if any (skipping `--config PATH`)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--config":
            skip = True
        elif arg in COMMANDS:
            return arg
        elif not arg.startswith("-"):
            return None
    return None


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or say it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("buzz-broker")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


class _ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments" line says where `--config` goes
    when it is the word not recognized (`buzz-broker status --config FILE`)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:") and any(
                word == "--config" or word.startswith("--config=") for word in message.split()):
            message += " (--config goes before the command: buzz-broker --config PATH COMMAND …)"
        super().error(message)


def _parser(selected: str | None) -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="buzz-broker",
        description="Key-custody daemon for keyless Buzz agents.",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="TOML configuration file (default: $BUZZ_BROKER_CONFIG, else "
        "/etc/buzz-broker/broker.toml if it exists, else built-in defaults)",
    )
    parser.add_argument("--version", action="version", version=f"buzz-broker {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            module = importlib.import_module(f"daemon.cli.{module_name}")
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def _stdout_reader_gone() -> bool:
    """Is standard output a pipe (or socket) whose reading end has closed?

    Asked of the descriptor itself (poll reports POLLERR on a pipe with no reader), so a
    broken pipe elsewhere, such as the broker's socket under `call`, is not mistaken for
    `buzz-broker audit show | head` having read enough.
    """
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _quiet_closed_pipe() -> int:
    """End as a pipeline expects when its reader left: nothing on stderr, exit 141.

    Standard output is pointed at /dev/null first, so the interpreter's own flush at exit
    does not raise (and print) a second BrokenPipeError.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_CLOSED_PIPE


def _run_command(args: argparse.Namespace) -> int:
    """Run the parsed command. A PermissionError (EACCES, EPERM) is the operator's fault,
    most often the wrong user on the state directory: one CliError line naming the file and
    the remedy (`permission_denied`), whichever command met it, never an internal error."""
    state_dir = None
    try:
        if args.command in STATE_COMMANDS:
            config = config_from_args(args)
            state_dir = config.state.dir
            refuse_unusable_state(config)
            refuse_foreign_state(config)
        code: int = args._run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside main's handlers
        return code
    except PermissionError as exc:
        raise permission_denied(exc, args.command, state_dir) from None


def main(argv: Sequence[str] | None = None) -> int:
    # Every command may hold a secret: serve holds agents' credentials and the plaintexts it
    # answers (with a custodian it never opens custody, which hardened it before), agent
    # import a key read from stdin, credential issue the new credential. No core file, no
    # same-uid ptrace or /proc/PID/mem, freed glibc chunks overwritten (M_PERTURB): before
    # anything is read. M_PERTURB alone leaves CPython's small objects and glibc's tcache
    # unfilled, where request bodies and parsed strings live; every free is overwritten
    # only under the systemd unit's PYTHONMALLOC=malloc and tcache_count=0
    # (tests/security/test_plaintext_lifetime.py; docs/custodian.md, "What stays in the
    # custodian's memory"). Without them a plaintext outlives its request in freed memory.
    harden_process()
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        # Inside the handlers: building the parser imports the command's module, which takes
        # long enough for a Ctrl-C to land there (it printed a traceback).
        args = _parser(_selected(arguments)).parse_args(arguments)
        return _run_command(args)
    # A reader that went away (`| head`) ends the output quietly, whatever the command was
    # doing with the write that found it: some commands wrap their reads and writes in one
    # OSError handler, so the fault can arrive as a CliError as well as a BrokenPipeError.
    except CliError as exc:
        if _stdout_reader_gone():
            return _quiet_closed_pipe()
        # A fault line may quote a name or a relay's words: escaped like every output of them.
        print(f"buzz-broker: {printable(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        if _stdout_reader_gone():
            return _quiet_closed_pipe()
        # Only the type name: the text of an unexpected exception may carry secret material.
        print(
            f"buzz-broker: internal error ({type(exc).__name__}); see the daemon log",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
