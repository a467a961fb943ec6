"""Helpers shared by the commands: the one error type and the configuration they run with.

Rules: a command reports every fault as one `CliError` line (never a traceback, never a
secret in the text); `config_from_args` is the only way a command reads its configuration,
so `--config`, `$BUZZ_BROKER_CONFIG` and the defaults mean the same everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing only: the configuration is imported when a command runs
    from daemon.config import Config


class CliError(Exception):
    """A fault an operator must see: one line, no traceback, a non-zero exit."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def config_from_args(args: object) -> Config:
    """The configuration a command runs with: `--config`, else $BUZZ_BROKER_CONFIG, else defaults."""
    from daemon.config import ConfigError, load_config

    try:
        return load_config(getattr(args, "config", None))
    except ConfigError as exc:
        raise CliError(str(exc)) from None

