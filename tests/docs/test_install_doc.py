"""docs/install.md names what it uses (issue 25 item 4): a newcomer follows it without the source.

Two checks a reader cannot make for themselves: every `<placeholder>` in the blocks the
real-systemd test runs (the tested path) is in the doc's placeholder table, and the
shorthand `bb` (an alias some of the doc once used without defining) is gone: commands
are spelled `buzz-broker-admin`, the wrapper step 1 installs.
"""

from __future__ import annotations

import re

from tests.docs.snippets import REPO

INSTALL_MD = REPO / "docs" / "install.md"
_MARKED_BLOCK = re.compile(r"<!-- install-test [^>]*-->\n```\w*\n(?P<body>.*?)^```$", re.M | re.S)
_PLACEHOLDER = re.compile(r"<[a-z][a-z-]*>")
_TABLE_ROW = re.compile(r"^\| `(<[^`]+>)` \|", re.M)


def test_every_placeholder_of_the_tested_steps_is_defined() -> None:
    text = INSTALL_MD.read_text(encoding="utf-8")
    used = {p for m in _MARKED_BLOCK.finditer(text) for p in _PLACEHOLDER.findall(m["body"])}
    defined = set(_TABLE_ROW.findall(text))
    assert used, "no marked blocks found: the marker syntax changed"
    assert sorted(used - defined) == []


def test_no_undefined_shorthand_for_the_admin_wrapper() -> None:
    text = INSTALL_MD.read_text(encoding="utf-8")
    assert re.findall(r".{0,30}\bbb\b.{0,30}", text) == []
