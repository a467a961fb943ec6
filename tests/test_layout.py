"""The layout shows the architecture, and stays true (issue 16 item 5).

Rules it holds:
- Every module of daemon/ imports as if first (a fresh interpreter, our modules dropped
  between two), and the runtime import graph of all four packages (typing-only and
  in-function imports aside) has no circle: a circle that happens to work today breaks
  when the next import is reordered.
- Folders import in one direction (`FORBIDDEN` below, a table): the relay knows nothing of
  state, pipeline or operations; state knows nothing of the relay or operations and of the
  pipeline only the `Refusal` value its rate limiter answers with; custody and the client
  side know nothing of the daemon; operations and the relay import nothing of custody,
  not even for typing; only `daemon/cli/` imports `daemon.wiring`.
- pyproject.toml lists every package (a folder missing there is absent from the wheel,
  though an editable install hides it); README's layout table names every folder and
  top-level module of daemon/ and only paths that exist; docs/internals.md names no
  daemon path that does not exist.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: package root (import name) -> folder
ROOTS = {"daemon": REPO / "daemon", "custody": REPO / "custody",
         "buzzwire": REPO / "buzzwire",
         "buzz_broker_client": REPO / "client" / "buzz_broker_client"}

#: (importer prefix, imported prefix, allowed exceptions as (importer, imported) modules)
FORBIDDEN: tuple[tuple[str, str, frozenset[tuple[str, str]]], ...] = (
    ("daemon.relay", "daemon.state", frozenset()),
    ("daemon.relay", "daemon.pipeline", frozenset()),
    ("daemon.relay", "daemon.operations", frozenset()),
    ("daemon.relay", "daemon.wiring", frozenset()),
    ("daemon.state", "daemon.relay", frozenset()),
    ("daemon.state", "daemon.operations", frozenset()),
    ("daemon.state", "daemon.wiring", frozenset()),
    ("daemon.state", "daemon.pipeline",
     frozenset({("daemon.state.ratelimit", "daemon.pipeline.policy")})),
    ("daemon.pipeline", "daemon.wiring", frozenset()),
    ("daemon.operations", "daemon.wiring", frozenset()),
    # Issue 16: operations and the relay reach custody only through what they are handed
    # (`operations._base.Custodian`, the signer, the AUTH callback), never by import.
    ("daemon.operations", "custody", frozenset()),
    ("daemon.relay", "custody", frozenset()),
    ("custody", "daemon", frozenset()),
    # Issue 26: the custodian (custody/custodian/) is custody's process: the rest of custody
    # knows nothing of it, and it, as all of custody, never imports the daemon (it never
    # parses agents' HTTP or relay frames). The daemon reaches it only through its client.
    ("custody", "custody.custodian", frozenset()),
    ("buzzwire", "daemon", frozenset()),
    ("buzzwire", "custody", frozenset()),
    ("buzz_broker_client", "daemon", frozenset()),
    ("buzz_broker_client", "custody", frozenset()),
)


def _modules() -> dict[str, Path]:
    found = {}
    for name, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "build" in parts or any(p.endswith(".egg-info") for p in parts):
                continue  # pip's in-tree build of buzzwire/ (its own pyproject.toml)
            if parts[-1] == "__main__":
                continue  # runs a command when imported
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _runtime_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of ours that `path` imports when it is imported: module level only, and not
    under `if TYPE_CHECKING:` (those never run)."""
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If):
                test = node.test
                if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                    visit(node.orelse)
                    continue
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module in known:
                    out.add(node.module)
                    out.update(f"{node.module}.{a.name}" for a in node.names
                               if f"{node.module}.{a.name}" in known)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return out


def _all_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ours named in an import anywhere in `path` (typing-only too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return {m for m in out if m.split(".")[0] in ROOTS}


#: Run in a fresh interpreter: imports each module named on stdin as if first, by dropping
#: every module of ours from `sys.modules` before it (third-party ones stay: a circle of
#: ours does not depend on them), and prints each failure.
_IMPORT_EACH_ALONE = """
import importlib, sys, traceback
OURS = %r
for name in sys.stdin.read().split():
    for loaded in [m for m in sys.modules if m.split(".")[0] in OURS]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        print("FAILED", name, traceback.format_exc(limit=-3))
"""


def test_every_module_imports_on_its_own() -> None:
    modules = sorted(m for m in _modules() if m.startswith("daemon"))
    assert "daemon.pipeline.broker" in modules and "daemon.state.ledger" in modules
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE % (tuple(ROOTS),)],
                          input="\n".join(modules), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout + done.stderr


def test_runtime_imports_have_no_circle() -> None:
    known = _modules()
    # A package's __init__ importing its own submodules is no circle.
    graph = {m: _runtime_imports(p, known) - {m} for m, p in known.items()}
    done: set[str] = set()
    path: list[str] = []

    def walk(m: str) -> None:
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            walk(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        walk(m)


def test_folders_import_in_one_direction() -> None:
    known = _modules()
    wrong = []
    for module, path in known.items():
        for imported in _all_imports(path, known):
            for importer_prefix, imported_prefix, allowed in FORBIDDEN:
                if (_under(module, importer_prefix) and _under(imported, imported_prefix)
                        and not _under(module, imported_prefix)  # a package imports itself
                        and (module, imported) not in allowed):
                    wrong.append(f"{module} imports {imported}")
            # The composition root is imported only by the commands that start things.
            if imported == "daemon.wiring" and not _under(module, "daemon.cli"):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, wrong


def test_pyproject_lists_every_package() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    on_disk = {m for m, p in _modules().items() if p.name == "__init__.py"}
    assert listed == on_disk


def _layout_paths() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    paths = []
    for row in re.findall(r"^\| (.+?) \|", table, flags=re.MULTILINE):
        names = re.findall(r"`([^`]+)`", row)
        if not names:
            continue
        folder = names[0] if names[0].endswith("/") else names[0].rsplit("/", 1)[0] + "/"
        paths.append(names[0])
        # `a/b.py`, `c.py`: a bare file name lives beside the first path of its row;
        # `tests/`, `benchmarks/`: a bare folder is at the top.
        paths += [n if "/" in n.rstrip("/") or n.endswith("/") else folder + n
                  for n in names[1:]]
    return paths


def test_readme_layout_names_every_part_of_the_daemon() -> None:
    paths = _layout_paths()
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, missing
    daemon = REPO / "daemon"
    parts = {f"daemon/{p.name}/" for p in daemon.iterdir() if (p / "__init__.py").exists()}
    parts |= {f"daemon/{p.name}" for p in daemon.glob("*.py") if p.name != "__init__.py"}
    unnamed = parts - set(paths)
    assert not unnamed, sorted(unnamed)


def test_internals_names_only_daemon_paths_that_exist() -> None:
    stale = []
    for doc in ("docs/internals.md", "README.md"):
        text = (REPO / doc).read_text(encoding="utf-8")
        for name in set(re.findall(r"\bdaemon/[a-z_/]+(?:\.py)?", text)):
            bare = name.rstrip("/")
            if not any((REPO / c).exists() for c in (bare, bare + ".py")):
                stale.append(f"{doc}: {name}")
    assert not stale, sorted(stale)
