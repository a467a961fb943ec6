"""`buzz-broker check-config [PATH]`: validate a configuration file without starting anything.

Rules:
- Which file: PATH if given, else the global ``--config``, else ``$BUZZ_BROKER_CONFIG``,
  else the built-in defaults (which are checked like a file, so "ok" means the daemon
  would start with exactly this configuration as far as the file can tell).
- Prints ``ok`` on stdout and exits 0, or the one-line `ConfigError` on stderr and exits 1.
- It checks the file only: whether the token, the PIN file or the socket group exist on
  this host is for `serve` to find out (a config is often checked on another machine).

WARNING: the `ok` line and the exit codes are documented in docs/configuration.md and
docs/install.md (step 4).
"""

from __future__ import annotations

import argparse
import os

from daemon.cli._common import CliError
from daemon.config import ConfigError, load_config

HELP = "validate a configuration file; prints ok or the one-line error"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="the file to check (default: --config, $BUZZ_BROKER_CONFIG, built-in defaults)",
    )


def run(args: argparse.Namespace) -> int:
    path = getattr(args, "path", None) or getattr(args, "config", None)
    try:
        load_config(path, os.environ)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    print("ok")
    return 0
