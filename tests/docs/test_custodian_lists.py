"""docs/custodian.md's lists of the custodian's rows are the message table's: each list an
operator relies on is read out of the document and compared with the set in
custody/custodian/messages.py it describes, so a row that joins a set cannot leave the
prose behind.

- "A line that cannot be written": the rows still answered while a log line is owed,
  `messages.LOOKUPS` (server.py answers exactly those then).
"""

from __future__ import annotations

import re

from custody.custodian.messages import LOOKUPS, OPS
from tests.docs.snippets import REPO, passage

CUSTODIAN_MD = REPO / "docs" / "custodian.md"
_ROW = re.compile(r"`([a-z_]+)`")


def _rows(pattern: str) -> set[str]:
    """The row names in backticks inside the one passage `pattern` captures."""
    return {name for name in _ROW.findall(passage(CUSTODIAN_MD, pattern)) if name in OPS}


def test_the_rows_answered_while_a_line_is_owed_are_the_lookups() -> None:
    listed = _rows(r"Until it is, every row but the lookups, which write no line \((.*?)\), is "
                   r"refused")
    assert listed == LOOKUPS
