"""Helpers shared by the commands: the one error type, and reading secrets from files."""

from __future__ import annotations


class CliError(Exception):
    """A fault an operator must see: one line, no traceback, a non-zero exit."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def config_from_args(args: object) -> "Config":
    """The configuration a command runs with: `--config`, else $BUZZ_BROKER_CONFIG, else defaults."""
    from daemon.config import ConfigError, load_config

    try:
        return load_config(getattr(args, "config", None))
    except ConfigError as exc:
        raise CliError(str(exc)) from None


from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.config import Config
