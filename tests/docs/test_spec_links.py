"""The specifications are linked where they live upstream, pinned to a commit (issue 25 item 4).

The agent-broker specification, NIP-BA and its companions are not in this repository, so
a path like `spec/agent-broker.md` sends a reader nowhere. Every doc and every source
comment names them by file name, and README.md's "The specifications, upstream" links
each one at the commit this host was built against; a link to a moving branch would say
something else tomorrow.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.snippets import REPO

#: What the README must link, each at its pinned commit.
PINNED = (
    "https://github.com/block/buzz/pull/6790",
    "https://github.com/block/buzz/blob/8b28ef0f0f2846ce3c063ecaa2c5e17254f7b87d/docs/agent-broker.md",
    "https://github.com/block/buzz/blob/a7beb1988b668020967719c2a0552a95fead5416/docs/nips/NIP-BA.md",
    "https://github.com/block/buzz/blob/a7beb1988b668020967719c2a0552a95fead5416/docs/nips/NIP-AE.md",
    "https://github.com/block/buzz/blob/a7beb1988b668020967719c2a0552a95fead5416/docs/nips/NIP-AO.md",
    "https://github.com/block/buzz/blob/a7beb1988b668020967719c2a0552a95fead5416/docs/nips/NIP-OA.md",
    "https://github.com/nostr-protocol/nips/blob/822b70a565678222706dd6284eb7abcaadfc5115/44.md",
)

_MISSING_PATH = re.compile(r"(?<![\w./])spec/(agent-broker|buzz-on-the-relay)\.md")
_BLOB = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/(?:blob|tree)/([^/\s)]+)/")


def _texts() -> list[Path]:
    roots = ("docs", "buzzwire", "client", "daemon", "custody", "scripts", "tests")
    files = [REPO / "README.md", REPO / "CHANGELOG.md"]
    for root in roots:
        files += [p for p in (REPO / root).rglob("*")
                  if p.suffix in {".md", ".py", ".json"} and p.is_file()
                  # pip's in-tree build/ copies of the sources are not the repository's
                  and not {"__pycache__", "build"} & set(p.parts)
                  and not any(part.endswith(".egg-info") for part in p.parts)
                  and p.name != Path(__file__).name]
    return files


def test_no_doc_or_comment_cites_a_spec_path_that_is_not_in_the_repository() -> None:
    found = [f"{p.relative_to(REPO)}:{n}" for p in _texts()
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if _MISSING_PATH.search(line)]
    assert found == []


def test_readme_links_every_specification_at_its_commit() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [url for url in PINNED if url not in readme] == []


def test_every_github_file_link_in_the_docs_is_pinned_to_a_commit() -> None:
    loose = [f"{p.relative_to(REPO)}: {m.group(0)}"
             for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
             for m in _BLOB.finditer(p.read_text(encoding="utf-8"))
             if not re.fullmatch(r"[0-9a-f]{40}", m.group(1))]
    assert loose == []
