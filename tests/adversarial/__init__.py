"""Adversarial tests (issue 8): fuzzing, crash points, resource bounds, faults, secret scan.

Every test here is bounded so the folder fits in `make test`. Setting
``BUZZ_BROKER_LONG_TESTS=1`` turns on the long mode (more hypothesis examples, more
connections, longer drips); the figures in docs/reliability.md come from that mode.

``BUZZ_BROKER_TALLY=<file>`` makes the tests append what they exercised (inputs fuzzed,
connections held, faults injected) to that file as JSON lines, so the figures in the docs
are counted by the run itself rather than written by hand.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

__all__ = ["LONG", "scaled", "tally"]

#: The long mode: set by the environment, never by a test.
LONG: bool = os.environ.get("BUZZ_BROKER_LONG_TESTS", "") not in ("", "0")


def scaled(short: int, long: int) -> int:
    """`short` in `make test`, `long` under BUZZ_BROKER_LONG_TESTS=1."""
    return long if LONG else short


def tally(test: str, figures: Mapping[str, object]) -> None:
    """Append one line of figures for `test` to $BUZZ_BROKER_TALLY, if it is set."""
    path = os.environ.get("BUZZ_BROKER_TALLY")
    if not path:
        return
    line = json.dumps({"test": test, "long": LONG, **figures}, sort_keys=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")
