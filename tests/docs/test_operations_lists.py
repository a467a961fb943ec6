"""docs/operations.md's lists of actions are the code's: each list an operator sizes limits
or grants by is read out of the document and compared with the table it describes, so an
action that joins a class or a preset cannot leave the prose behind.

- "The rules": the `publish`, `read` and `live` scopes, and the `[limits]` example's
  comments on the `read` and `live` buckets (`daemon.state.ratelimit.CLASSES`).
- "Granting more to a live credential": the `buzz-runtime` preset
  (`daemon.cli.credential.PRESETS`), and how many actions `--all-actions` stores
  (`buzzwire.contract.ACTIONS`).
"""

from __future__ import annotations

import re

import pytest

from buzzwire.contract import ACTIONS
from daemon.cli.credential import PRESETS
from daemon.state.ratelimit import CLASSES
from tests.docs.snippets import REPO

OPERATIONS_MD = REPO / "docs" / "operations.md"
_NAME = re.compile(r"\b([a-z]+\.[a-z]+)\b")

#: The action count as the page spells it. A build with another count fails the test
#: below with a KeyError: spell the new count here and on the page.
_SPELT = {15: "fifteen"}


def _passage(pattern: str) -> str:
    """The one passage of the page that `pattern` captures."""
    text = OPERATIONS_MD.read_text(encoding="utf-8")
    found = re.findall(pattern, text, re.S | re.M)
    assert len(found) == 1, f"expected one passage matching {pattern!r}, found {len(found)}"
    return str(found[0])


def _named(pattern: str) -> set[str]:
    return set(_NAME.findall(_passage(pattern)))


@pytest.mark.parametrize("scope", sorted(CLASSES))
def test_each_class_scope_lists_its_actions(scope: str) -> None:
    assert _named(rf"^- `{scope}`: (.*?)(?:;|\.)\n(?:- |\n)") == CLASSES[scope]


@pytest.mark.parametrize("scope", ["read", "live"])
def test_the_limits_example_comments_name_each_class_whole(scope: str) -> None:
    assert _named(rf'^{scope} = "[^"]*" +# bucket for ([^\n]*)$') == CLASSES[scope]


def test_the_buzz_runtime_preset_is_the_code_s() -> None:
    listed = _named(r"is what Buzz's 15-action agent runtime calls: (.*?)\. Names of")
    assert listed == set(PRESETS["buzz-runtime"])


def test_all_actions_counts_what_this_build_offers() -> None:
    said = _passage(r"`--all-actions` stores the actions the issuing build offers as an\s+"
                    r"explicit list \((.*?)\)")
    assert said.startswith(f"all {_SPELT[len(ACTIONS)]} "), said
