"""The `buzz-broker` command line: one entry point, one module per command.

Rules:
- Each command lives in `daemon/cli/<name>.py` and exposes `HELP: str`,
  `add_arguments(parser)` and `run(args) -> int`. `COMMANDS` below is the only list of them.
- A command reports a fault by raising `CliError` with one clear line; `main` prints it
  on stderr and exits non-zero. No traceback reaches an operator: anything else that
  escapes is reported as an internal error with its type name only (the text of an
  unexpected exception could carry a secret).
- Secrets (PINs, credentials, secret keys) never come from argv: files, stdin, or the
  environment variables each command documents.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from daemon.cli._common import CliError

__all__ = ["main", "CliError", "COMMANDS"]

#: command name -> module under daemon.cli (imported only when that command runs, so a
#: command's dependencies never slow down or break another command).
COMMANDS: dict[str, str] = {
    "serve": "serve",
    "check-config": "check_config",
    "keys": "keys",
    "agent": "agent",
    "credential": "credential",
    "call": "call",
    "audit": "audit",
}

EXIT_USAGE = 2
EXIT_INTERNAL = 70  # EX_SOFTWARE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="buzz-broker",
        description="Key-custody daemon for keyless Buzz agents.",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="TOML configuration file (default: $BUZZ_BROKER_CONFIG, else built-in defaults)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"daemon.cli.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args._run(args)
        return code
    except CliError as exc:
        print(f"buzz-broker: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        # Only the type name: the text of an unexpected exception may carry secret material.
        print(
            f"buzz-broker: internal error ({type(exc).__name__}); see the daemon log",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
