"""docs/operations.md "Exit codes: every command" against the commands' own constants.

Every `EXIT_*` a command module defines has its row (under the command's name; the entry
point's under "every command"), and every row names a code a constant defines, or one the
entry point returns by rule (1 for a CliError, 130 for Ctrl-C)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from daemon import cli

REPO = Path(__file__).resolve().parent.parent
EVERY = "every command"
#: Codes the entry point gives by rule rather than by a named constant.
BY_RULE = {(EVERY, 0), (EVERY, 1), (EVERY, 130)}


def _table() -> set[tuple[str, int]]:
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## Exit codes: every command", 1)[1].split("\n## ", 1)[0]
    return {(m.group(1), int(m.group(2)))
            for m in re.finditer(r"^\| ([a-z -]+) \| (\d+) \|", section, re.M)}


def _constants() -> set[tuple[str, int]]:
    found = {(EVERY, value) for name, value in vars(cli).items()
             if name.startswith("EXIT_") and isinstance(value, int)}
    for command, (module_name, _help) in cli.COMMANDS.items():
        module = importlib.import_module(f"daemon.cli.{module_name}")
        found |= {(command, value) for name, value in vars(module).items()
                  if name.startswith("EXIT_") and isinstance(value, int)}
    return found


def test_every_exit_code_a_command_defines_is_in_the_table_and_no_other() -> None:
    table, constants = _table(), _constants()
    assert constants - table == set(), "codes with no row in docs/operations.md"
    assert table - constants - BY_RULE == set(), "rows that no command returns"
