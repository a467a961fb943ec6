"""Helpers shared by the commands: the one error type, and reading secrets from files."""

from __future__ import annotations


class CliError(Exception):
    """A fault an operator must see: one line, no traceback, a non-zero exit."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
