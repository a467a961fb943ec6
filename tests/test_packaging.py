"""What an operator sees of the package itself: `--version`, and builds with no warnings of
our own (`make run` showed about 45 lines of setuptools deprecation warnings)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pytest's own dependency
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent


def test_version_is_the_projects() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run([sys.executable, "-m", "daemon.cli", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"buzz-broker {version}\n")


def _clean_copy(dest: Path) -> Path:
    """The checkout as a clean clone holds it: no venv, no earlier build/ or egg-info (an
    egg-info's stale SOURCES.txt feeds the next sdist), no caches."""
    shutil.copytree(REPO, dest, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.egg-info", "build", "run", ".mypy_cache",
        ".pytest_cache", ".hypothesis", "node_modules"))
    return dest


#: Each distribution's folder -> files its wheel must hold, and files it must not: the
#: shared wire module (buzzwire/) is its own distribution, which the client depends on
#: instead of carrying a copy; the daemon's packs it, for itself and the custodian, and the
#: client, for `buzz-broker call` (so neither of the two belongs in the daemon's venv:
#: docs/install.md, step 1).
WHEELS = {
    ".": (("buzzwire/nostr.py", "buzz_broker_client/client.py", "custody/custodian/server.py",
           "daemon/cli/__init__.py"), ("buzzwire/pyproject.toml", "buzzwire/LICENSE")),
    "client": (("buzz_broker_client/client.py",), ("buzzwire/", "custody/", "daemon/")),
    "buzzwire": (("buzzwire/nostr.py", "buzzwire/kinds.py", "buzzwire/contract/_json.py"),
                 ("buzz_broker_client/", "custody/", "daemon/")),
}


@pytest.mark.parametrize("project", list(WHEELS), ids=["daemon", "client", "buzzwire"])
def test_a_build_prints_no_warning(project: str, tmp_path: Path) -> None:
    # From a clean copy: pip builds in the source tree, whose build/ keeps every file an
    # earlier build copied (and buzzwire/ is the package itself, so a build/ left there would
    # sit inside the package the checkout imports).
    source = _clean_copy(tmp_path / "src") / project
    wheels = tmp_path / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(source)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # (the temporary folder is named after this test, whose name says "warning")
    output = (done.stdout + done.stderr).replace(str(tmp_path), "<tmp>")
    assert "warning" not in output.lower(), output[-3000:]
    (wheel,) = wheels.glob("*.whl")
    listing = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)],
                             capture_output=True, text=True, check=True).stdout
    assert "licenses/LICENSE" in listing  # the Apache-2.0 text pyproject names ships
    files = [line.split()[0] for line in listing.splitlines()[1:] if line.strip()]
    present, absent = WHEELS[project]
    assert set(present) <= set(files), files
    assert not [f for f in files if f.startswith(absent)], files


def _lower_bounds() -> dict[str, dict[str, str]]:
    """Each dependency's lower bound, by distribution name, then by the pyproject.toml
    (relative to the repository) that names it: `>=`, `==`, `~=` or `>` gives it, none is
    "none"."""
    bounds: dict[str, dict[str, str]] = {}
    for path in sorted(REPO.glob("**/pyproject.toml")):
        if {".venv", "build", "node_modules"} & set(path.relative_to(REPO).parts):
            continue
        project = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
        named = [*project.get("dependencies", []),
                 *(r for extra in project.get("optional-dependencies", {}).values() for r in extra)]
        for line in named:
            req = Requirement(line)
            lower = [s.version for s in req.specifier if s.operator in (">=", "==", "~=", ">")]
            bounds.setdefault(canonicalize_name(req.name), {})[
                str(path.relative_to(REPO))] = ",".join(sorted(lower)) or "none"
    return bounds


def test_a_shared_dependency_has_one_lower_bound() -> None:
    """A dependency two distributions name has the same lower bound in each: the client
    accepted h11 0.14, whose bare ValueError on a 5,000-digit Content-Length the daemon's
    `h11>=0.16` was raised to keep out (its fix reached one pyproject.toml of three)."""
    bounds = _lower_bounds()
    assert len({p for named in bounds.values() for p in named}) == 3, bounds  # all found
    shared = {name: named for name, named in bounds.items() if len(named) > 1}
    assert {"h11", "anyio", "coincurve"} <= set(shared), shared
    assert {name: named for name, named in shared.items() if len(set(named.values())) > 1} == {}


INSTALL_MD = REPO / "docs" / "install.md"
#: Where install.md puts the source (a clone, or an unpacked release: the sdist).
SOURCE = "/opt/buzz-broker/src/"


def _taken_from_the_source(text: str) -> set[str]:
    """The paths install.md takes from the source folder: each file it names under it (not
    what it removes there), what each folder `pip install ./a ./b` builds reads, and the
    tree's own pyproject.toml (`pip install /opt/buzz-broker/src`)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("rm ")]
    named = set(re.findall(re.escape(SOURCE) + r"([\w./-]+)", "\n".join(lines)))
    folders = {f for args in re.findall(r"pip install ((?:\./\w+ ?)+)", text)
               for f in args.split()}
    return named | {"pyproject.toml"} | {f"{f[2:]}/{name}" for f in folders
                                         for name in _files_its_build_reads(REPO / f[2:])}


def _files_its_build_reads(folder: Path) -> list[str]:
    """A distribution folder's pyproject.toml and the files it names (readme, licence)."""
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    return ["pyproject.toml", *project.get("license-files", []),
            *([project["readme"]] if "readme" in project else [])]


def _sdist_files(tmp_path: Path) -> set[str]:
    """The daemon's sdist, built from a clean copy of the checkout by the setuptools its
    pyproject.toml's build-system requires (the venv's may be older)."""
    tree = _clean_copy(tmp_path / "tree")
    backend = tmp_path / "backend"
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(backend), *requires], check=True, capture_output=True, timeout=120)
    out = tmp_path / "sdist"
    done = subprocess.run(
        [sys.executable, "-c", "import sys, setuptools.build_meta as b; "
         "print(b.build_sdist(sys.argv[1]))", str(out)],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(backend)},
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    with tarfile.open(out / done.stdout.split()[-1]) as sdist:
        return {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}


def test_the_sdist_holds_what_install_md_takes_from_it(tmp_path: Path) -> None:
    """install.md installs units, wrappers and make-token from "an unpacked release": the
    sdist carries each of them. It carries no tests: they need the checkout's fixtures,
    tokens and relays, which a release leaves out, so a half could not run."""
    files = _sdist_files(tmp_path)
    taken = _taken_from_the_source(INSTALL_MD.read_text(encoding="utf-8"))
    assert {"systemd/buzz-broker.service", "softhsm/make-token", "client/pyproject.toml"} <= taken
    assert sorted(taken - files) == []
    assert sorted(f for f in files if f.startswith("tests/")) == []


@pytest.mark.parametrize("project", list(WHEELS), ids=["daemon", "client", "buzzwire"])
def test_each_distribution_has_a_readme(project: str) -> None:
    """Its sdist and index page carry a description (without one setuptools warns and the
    metadata says nothing); the file is the folder's own."""
    readme = tomllib.loads((REPO / project / "pyproject.toml").read_text())["project"].get("readme")
    assert readme is not None and (REPO / project / readme).is_file(), readme
