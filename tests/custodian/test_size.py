"""What the custodian process loads: counted, and held to what docs/custodian.md says.

Rule (printed by the test): every module of this repository in `sys.modules` after
`import custody.custodian.main` in a fresh interpreter (the custodian's whole import closure;
serving, it imports nothing later but custody/_cache.py, and that only when its
configuration turns the unsealed-key cache on: the test prints that module's count too),
counted as physical lines of its file (`wc -l`: docstrings, comments and blank lines
included, as issue 26 counted custody). `custodian FILE keys ...` and `custodian FILE
--recover PUBKEY` are other processes.

A second rule is printed beside it, for information only: the same modules' code lines
(a line holding a token that is not a comment, after `tokenize`, and not part of a module,
class or function docstring, as `ast` finds them). Nothing is held to that figure but that
it is a part of the first.
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "custodian.md"
#: The issue's target for the custodian's closure, and the ceiling this code holds to
#: now (docs/custodian.md, "Size": the target is not met yet).
TARGET_LINES = 3000
#: The closure's count today. It was worked down to 5,185 lines once the code only commands
#: and the in-process daemon run left; since then it has risen only with fixes, each named
#: in the commit that raised this number (`git log -- tests/custodian/test_size.py`).
CEILING_LINES = 6276
#: Parsers facing agents and the relay that must never load where the keys are.
NEVER = ("daemon", "h11", "wsproto", "buzz_broker_client", "buzzwire.contract")


def _closure() -> dict[str, str | None]:
    probe = ("import json, sys, custody.custodian.main; print(json.dumps("
             "{m: getattr(v, '__file__', None) for m, v in list(sys.modules.items())}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    loaded: dict[str, str | None] = json.loads(out)
    return loaded


#: Tokens that make no line code (a comment, or the layout tokenize adds).
_NOT_CODE = frozenset({tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                       tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER})


def _code_lines(text: str) -> int:
    """Lines of `text` holding code: not blank, not only a comment, not a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in _NOT_CODE:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def test_the_custodians_closure_is_counted_and_bounded() -> None:
    loaded = _closure()
    ours = {m: Path(f) for m, f in loaded.items()
            if f and REPO in Path(f).resolve().parents and ".venv" not in Path(f).parts}
    texts = {m: p.read_text(encoding="utf-8") for m, p in ours.items()}
    counts = {m: len(text.splitlines()) for m, text in texts.items()}
    code = {m: _code_lines(text) for m, text in texts.items()}
    total, code_total = sum(counts.values()), sum(code.values())
    print(f"\ncustodian import closure: {len(counts)} modules of this repository, {total} "
          f"physical lines (rule: modules in sys.modules after `import custody.custodian.main`, "
          f"wc -l of each); issue 26's target {TARGET_LINES}")
    print(f"for information, by a second rule: {code_total} code lines (no blank lines, "
          f"comments or docstrings; tokenize and ast)")
    print("  wc -l  code  module")
    for module in sorted(counts):
        print(f"  {counts[module]:5d} {code[module]:5d}  {module}")
    cache = len((REPO / "custody" / "_cache.py").read_text(encoding="utf-8").splitlines())
    print(f"  (+{cache} custody._cache, loaded only with [pkcs11] unsealed_cache_entries set)")
    assert "custody._cache" not in counts  # off by default, and then never imported
    assert total <= CEILING_LINES
    assert 0 < code_total < total and all(0 <= code[m] <= counts[m] for m in counts)
    # docs/custodian.md, "Size", gives both counts: a change of either is a change of it.
    size = DOC.read_text(encoding="utf-8").split("## Size", 1)[1]
    assert f"**{total:,} lines in {len(counts)} modules**" in size
    assert f"**{code_total:,}**" in size
    rows = [line.split("|")[3:5] for line in size.split("\n## ", 1)[0].splitlines()
            if line.startswith("| ") and line.split("|")[3].strip().isdigit()]
    assert [sum(int(row[i]) for row in rows) for i in (0, 1)] == [total, code_total]
    for name in NEVER:
        assert not any(m == name or m.startswith(name + ".") for m in loaded), name


def test_every_third_party_package_it_imports_is_listed_with_its_reason() -> None:
    loaded = _closure()
    third = {m.split(".")[0] for m, f in loaded.items()
             if f and "site-packages" in f and not m.startswith(("_", "__editable__"))}
    doc = (REPO / "docs" / "custodian.md").read_text(encoding="utf-8")
    listed = doc.split("## Third-party packages", 1)[1].split("\n## ", 1)[0]
    missing = {name for name in third if f"`{name}`" not in listed}
    assert not missing, f"imported by the custodian, not in docs/custodian.md: {missing}"
