"""What the custodian process loads: counted, and held to what docs/custodian.md says.

Rule (printed by the test): every module of this repository in `sys.modules` after
`import custody.custodian.main` in a fresh interpreter (the custodian's whole import closure;
serving, it imports nothing later but custody/_cache.py, and that only when its
configuration turns the unsealed-key cache on: the test prints that module's count too),
counted as physical lines of its file (`wc -l`: docstrings, comments and blank lines
included, as issue 26 counted custody). `custodian FILE keys ...` is another process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The issue's target for the custodian's closure, and the ceiling this code holds to
#: now (docs/custodian.md, "Size": the target is not met yet).
TARGET_LINES = 3000
#: 5,233 when the backup row (custody/_backup.py's export half and custody/custodian/backup.py)
#: and socket activation joined the table; 5,345 when the row's disk bound did (max_files,
#: min_interval_seconds: a fix of the row, not a part): room for a fix, not for another part.
CEILING_LINES = 5400
#: Parsers facing agents and the relay that must never load where the keys are.
NEVER = ("daemon", "h11", "wsproto", "buzz_broker_client", "buzzwire.contract")


def _closure() -> dict[str, str | None]:
    probe = ("import json, sys, custody.custodian.main; print(json.dumps("
             "{m: getattr(v, '__file__', None) for m, v in list(sys.modules.items())}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    loaded: dict[str, str | None] = json.loads(out)
    return loaded


def test_the_custodians_closure_is_counted_and_bounded() -> None:
    loaded = _closure()
    ours = {m: Path(f) for m, f in loaded.items()
            if f and REPO in Path(f).resolve().parents and ".venv" not in Path(f).parts}
    counts = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in ours.items()}
    total = sum(counts.values())
    print(f"\ncustodian import closure: {len(counts)} modules of this repository, {total} "
          f"physical lines (rule: modules in sys.modules after `import custody.custodian.main`, "
          f"wc -l of each); issue 26's target {TARGET_LINES}")
    for module in sorted(counts):
        print(f"  {counts[module]:5d} {module}")
    cache = len((REPO / "custody" / "_cache.py").read_text(encoding="utf-8").splitlines())
    print(f"  (+{cache} custody._cache, loaded only with [pkcs11] unsealed_cache_entries set)")
    assert "custody._cache" not in counts  # off by default, and then never imported
    assert total <= CEILING_LINES
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
