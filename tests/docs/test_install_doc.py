"""docs/install.md names what it uses (issue 25 item 4): a newcomer follows it without the source.

Checks a reader cannot make for themselves: every `<placeholder>` in the blocks the
real-systemd test runs (the tested path) is in the doc's placeholder table; the
shorthand `bb` (an alias some of the doc once used without defining) is gone: commands
are spelled `buzz-broker-admin`, the wrapper step 1 installs; and every upgrade from a
source folder (install.md's, docs/agents.md's) first removes the folder's `build/` and
`*.egg-info`: pip builds in the folder, and setuptools' build/ keeps every module it
ever copied, so a module deleted upstream would stay installed.
"""

from __future__ import annotations

import re

from tests.docs.snippets import REPO

UPGRADING_DOCS = (REPO / "docs" / "install.md", REPO / "docs" / "agents.md", REPO / "README.md")
_UPGRADE = re.compile(r"pip install --upgrade (?P<args>[^`\n]+)")

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


def test_every_upgrade_from_a_folder_cleans_its_build_first() -> None:
    """Each folder a `pip install --upgrade` names has its `build/` and `*.egg-info`
    removed on that line or the one before."""
    unclean, seen = [], set()
    for doc in UPGRADING_DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in _UPGRADE.finditer(text):
            seen.add(doc.name)
            before = "\n".join(text[: m.start()].splitlines()[-2:])
            folders = [a for a in m["args"].split() if a.startswith(("/", "./"))]
            assert folders, m[0]
            unclean += [f"{doc.name}: {folder}" for folder in folders
                        if f"{folder}/build" not in before or f"{folder}/*.egg-info" not in before]
    assert seen >= {"install.md", "agents.md"}, seen  # both say how to upgrade
    assert unclean == []
