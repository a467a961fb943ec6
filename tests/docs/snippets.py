"""Code blocks out of the docs, by the label in their fence's info string.

A block opened with ```python agent-asyncio (language, then a label) is found by
`block(path, "agent-asyncio")`. Tests run such blocks as written; a label that is missing
or repeated is a test failure, so a doc edit cannot silently drop what a test runs.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

_FENCE = re.compile(r"^```(?P<lang>[\w-]+)(?: (?P<label>[\w.-]+))?\n(?P<body>.*?)^```$", re.M | re.S)


def blocks(path: Path) -> list[tuple[str, str | None, str]]:
    """Every fenced block: (language, label or None, body)."""
    text = path.read_text(encoding="utf-8")
    return [(m["lang"], m["label"], m["body"]) for m in _FENCE.finditer(text)]


def block(path: Path, label: str) -> str:
    found = [body for _, name, body in blocks(path) if name == label]
    assert len(found) == 1, f"{path.name}: expected one block labelled {label!r}, found {len(found)}"
    return found[0]


def passage(path: Path, pattern: str) -> str:
    """What `pattern`'s group captures in the one passage of `path` it matches (re.S, re.M):
    a doc's list, read out to be compared with the table it describes."""
    found = re.findall(pattern, path.read_text(encoding="utf-8"), re.S | re.M)
    assert len(found) == 1, f"expected one passage matching {pattern!r}, found {len(found)}"
    return str(found[0])
