"""Read what a `--json` command prints: JSON lines, one object per line (docs/operations.md,
"JSON output"). Strict: a line that is not one JSON object fails the test that reads it."""

from __future__ import annotations

import json
from typing import Any


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of `text` as a JSON object; an empty output is an empty list."""
    objects = []
    for line in text.splitlines():
        value = json.loads(line)
        assert isinstance(value, dict), f"not a JSON object: {line[:80]!r}"
        objects.append(value)
    return objects
