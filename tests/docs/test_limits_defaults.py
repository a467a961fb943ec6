"""The shipped `[limits]` figures the docs quote are the code's one table of them,
`daemon.state.ratelimit.LIMITS_TABLE_KEYS`: docs/configuration.md's `[limits]` rows and its
complete file, and docs/operations.md's "Defaults" table and `[limits]` example. When the
defaults change, every place an operator reads them changes with them, or this fails.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from daemon.state.ratelimit import CLASSES, LIMITS_TABLE_KEYS
from tests.docs.snippets import REPO, blocks

CONFIGURATION_MD = REPO / "docs" / "configuration.md"
OPERATIONS_MD = REPO / "docs" / "operations.md"


def _limits_tables(path: Path) -> list[dict[str, object]]:
    """The `[limits]` table of every TOML block of the page that has one."""
    found = []
    for lang, _label, body in blocks(path):
        if lang == "toml" and re.search(r"^\[limits\]$", body, re.M):
            found.append(tomllib.loads(body)["limits"])
    return found


def test_configuration_md_limits_rows_are_the_defaults() -> None:
    text = CONFIGURATION_MD.read_text(encoding="utf-8")
    section = text.split("## `[limits]`", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, re.M))
    assert set(rows) == set(LIMITS_TABLE_KEYS)
    for key, default in LIMITS_TABLE_KEYS.items():
        assert tomllib.loads(f"v = {rows[key]}")["v"] == default, key


def test_configuration_md_complete_file_has_the_defaults() -> None:
    (limits,) = _limits_tables(CONFIGURATION_MD)
    assert limits == dict(LIMITS_TABLE_KEYS)


def test_operations_md_limits_example_has_the_defaults() -> None:
    (limits,) = _limits_tables(OPERATIONS_MD)
    # The example shows per-action rules; every other key is the default.
    assert {k: v for k, v in limits.items() if k != "rules"} == {
        k: v for k, v in LIMITS_TABLE_KEYS.items() if k != "rules"}


@pytest.mark.parametrize("scope", sorted(CLASSES))
def test_operations_md_defaults_table_row(scope: str) -> None:
    text = OPERATIONS_MD.read_text(encoding="utf-8")
    section = text.split("### Defaults", 1)[1]
    (row,) = re.findall(rf"^\| `{scope}` \| ([^|]+) \| ([^|]+) \|$", section, re.M)
    assert row[0].strip() == LIMITS_TABLE_KEYS[scope]
    assert row[1].strip() == f"{LIMITS_TABLE_KEYS[f'{scope}_daily']:,}/day"
