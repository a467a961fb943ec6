"""Every test the documentation names as a proof exists.

README, CHANGELOG and docs/ prove their promises by naming tests (`tests/x.py::test_y`, `::test_y`
after a file, or a backticked `test_y`). A renamed or deleted test would leave a promise
that names nothing; this fails first. A name ending in `_*` names a family by its prefix.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
_DEFINED = re.compile(r"^\s*(?:async\s+)?def\s+(test_\w+)", re.M)
#: A test file's path, or a test's name after `::` or in backticks (a `_*` family allowed).
_PATH = re.compile(r"\btests/[\w/.-]+\.py\b")
_NAME = re.compile(r"(?:::|`)(test_\w+?)(_\*)?(?=[`\[\s,;:)]|\.(?!py\b)|$)")


def _defined() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(_DEFINED.findall(path.read_text(encoding="utf-8")))
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_a_document_names_exists(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    defined = _defined()
    missing_files = sorted({p for p in _PATH.findall(text) if not (ROOT / p).exists()})
    missing_tests = sorted({
        name + (family or "") for name, family in _NAME.findall(text)
        if not (any(d.startswith(name + "_") for d in defined) if family else name in defined)})
    assert not missing_files and not missing_tests, (missing_files, missing_tests)
