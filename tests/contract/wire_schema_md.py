"""Read ../shared/spec/wire-schema.md, the member sets Buzz's own wire-schema test pins.

The file lives beside the project (the shared spec directory), not in it. `load()` answers
None when it is absent; each test that reads it then skips with a message naming the path,
so a missing spec is visible in the run, never silently passed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WIRE_SCHEMA", "WireSchema", "load", "skip_reason"]

#: tests/contract -> tests -> the worktree -> its parent, which holds shared/spec.
WIRE_SCHEMA = Path(__file__).resolve().parents[3] / "shared" / "spec" / "wire-schema.md"

_ROW = re.compile(r"^\|\s*([a-z]+\.[a-z]+)\s*\|([^|]*)\|([^|]*)\|\s*$")
_STATUS_ROW = re.compile(r"^\|\s*([a-z, ]+?)\s*\|([^|]*)\|\s*$")


@dataclass(frozen=True)
class WireSchema:
    #: action -> (every argument member, every outcome member), optional ones included
    actions: dict[str, tuple[frozenset[str], frozenset[str]]]
    #: "succeeded" / "failed" / "indeterminate" / "error object" -> members (no `replayed`)
    responses: dict[str, frozenset[str]]


def _names(cell: str) -> frozenset[str]:
    cell = re.sub(r"\(.*?\)", "", cell)  # "(+ `replayed` only when true)"
    return frozenset(n.strip(" *`") for n in cell.split(",") if n.strip(" *`"))


def load(path: Path = WIRE_SCHEMA) -> WireSchema | None:
    if not path.is_file():
        return None
    actions: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
    responses: dict[str, frozenset[str]] = {}
    section = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip().lower()
            continue
        if section.startswith("the eighteen"):
            match = _ROW.match(line)
            if match:
                actions[match.group(1)] = (_names(match.group(2)), _names(match.group(3)))
        elif section == "responses":
            match = _STATUS_ROW.match(line)
            if match and match.group(1) != "status" and not set(match.group(1)) <= {"-"}:
                for status in match.group(1).split(","):
                    responses[status.strip()] = _names(match.group(2))
    if len(actions) != 9 or not responses:
        raise AssertionError(f"{path}: the tables could not be read (found {sorted(actions)})")
    return WireSchema(actions=actions, responses=responses)


def skip_reason() -> str:
    return f"SKIPPED LOUDLY: {WIRE_SCHEMA} is absent, so the contract cannot be checked against it"
