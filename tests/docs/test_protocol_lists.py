"""docs/protocol.md's lists of actions are the contract's: each list a client acts on is
read out of the document and compared with `buzzwire.contract.ACTIONS`, so an action that
becomes best effort, or takes the shared publish outcome, cannot leave the prose behind.

- §5, the `unsupported` row: the best-effort actions (`ActionSpec.best_effort`), on which a
  client carries on.
- §4's opening: the actions whose outcome is the published event (`PublishOutcome`).
"""

from __future__ import annotations

import re

from buzzwire.contract import ACTIONS, PublishOutcome
from tests.docs.snippets import REPO, passage

PROTOCOL_MD = REPO / "docs" / "protocol.md"
_NAME = re.compile(r"`([a-z]+\.[a-z]+)`")


def _named(pattern: str) -> set[str]:
    """The action names in backticks inside the one passage `pattern` captures."""
    return set(_NAME.findall(passage(PROTOCOL_MD, pattern)))


def test_the_unsupported_row_lists_every_best_effort_action() -> None:
    listed = _named(r"^\| `unsupported` \|[^\n]*?on a best-effort action \(([^)]*)\)")
    assert listed == {name for name, spec in ACTIONS.items() if spec.best_effort}


def test_the_shared_publish_outcome_lists_every_action_that_has_it() -> None:
    listed = _named(r"The actions that publish one event of their own \((.*?)\) share one outcome")
    assert listed == {name for name, spec in ACTIONS.items()
                      if spec.outcome_type is PublishOutcome}
