"""docs/protocol.md's lists of actions are the contract's: each list a client acts on is
read out of the document and compared with `buzzwire.contract.ACTIONS`, so an action that
becomes best effort, or takes the shared publish outcome, cannot leave the prose behind.

- §5, the `unsupported` row: the best-effort actions (`ActionSpec.best_effort`), on which a
  client carries on.
- §4's opening: the actions whose outcome is the published event (`PublishOutcome`).
- §5 "What a `message` says": the `invalid_request` refusals decided outside the contract's
  rules (policy's undeclared choices, channel.read's bad cursor) are each quoted, and the
  rate-limit format is the limiter's own two templates.
- §4 agents.update: the refusals of a target quoted are policy's own (`REFUSALS`).
- §1: the answers without an envelope are every status the transport writes besides 200
  (`daemon.http`'s reason table), and the 403 lines quoted are the listener's own
  (`daemon.loopback_tcp.Refusal`).
"""

from __future__ import annotations

import re

from buzzwire.contract import ACTIONS, ErrorCode, PublishOutcome
from daemon import http
from daemon.operations import channel_read
from daemon.pipeline.policy import REFUSALS
from daemon.state import ratelimit
from daemon.loopback_tcp import Refusal
from tests.docs.snippets import REPO, block, passage

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


def test_the_no_envelope_table_has_every_status_the_transport_writes() -> None:
    table = passage(PROTOCOL_MD, r"^\| status \(no envelope\) \|.*?\n\|---[^\n]*\n(.*?)\n\n")
    # A row opening with a status is the broker's; "anything else" (a proxy's) is not.
    cells = [row.split("|")[1].strip() for row in table.splitlines()]
    listed = {int(code) for cell in cells if cell.startswith("`")
              for code in re.findall(r"`(\d{3})`", cell)}
    assert listed == set(http._REASONS) - {200}


def test_the_403_lines_are_the_listeners_own() -> None:
    quoted = block(PROTOCOL_MD, "tcp-refusals").encode().splitlines(keepends=True)
    assert quoted == [refusal.value for refusal in Refusal]


def test_the_message_section_quotes_every_invalid_request_outside_the_rules() -> None:
    section = passage(PROTOCOL_MD, r"^### What a `message` says\n(.*?)^### ")
    outside = {r.message for r in REFUSALS.values() if r.code is ErrorCode.INVALID_REQUEST}
    outside.add(channel_read._BAD_CURSOR)
    assert len(outside) == 5
    assert [m for m in sorted(outside) if f"`{m}`" not in section] == []


def test_the_message_section_gives_the_limiters_own_format() -> None:
    section = passage(PROTOCOL_MD, r"^### What a `message` says\n(.*?)^### ")
    flat = " ".join(section.split())
    shown = {"scope": "<scope>", "seconds": "<N>"}
    assert f"`{ratelimit._BUCKET_TEMPLATE.format(rule='<count>/<window>', **shown)}`" in flat
    assert f"`{ratelimit._DAILY_TEMPLATE.format(rule='<count>/day', **shown)}`" in flat


def test_the_target_refusals_quoted_are_policys_own() -> None:
    table = passage(PROTOCOL_MD, r"^\| `target` \| answer \|\n(.*?)\n\n")
    for reason in ("not_owned", "no_such_name", "ambiguous"):
        refusal = REFUSALS[reason]
        assert f"`{refusal.code.value}`, \"{refusal.message}\"" in table, reason
