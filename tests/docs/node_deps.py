"""The npm packages docs/protocol.md's TypeScript example needs, installed reproducibly.

Rules:
- What is installed is exactly docs/examples/node/package-lock.json (versions and
  integrity hashes), by `npm ci`: the same bytes on every machine, or npm refuses.
- It is installed OUTSIDE the checkout, in a cache keyed by a hash of the lockfile:
  ``$BUZZ_BROKER_TEST_CACHE/npm`` if set, else /var/cache/buzz-broker-tests/npm as root (as
  CI runs), else ``$XDG_CACHE_HOME`` (or ~/.cache) /buzz-broker-tests/npm. A half-made
  install is never used: it is made in a scratch directory and renamed into place.
- A registry that cannot be reached is a test failure that says so, never a skip: the
  example's signature check is a promise of the doc.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.docs.snippets import REPO

__all__ = ["NODE_PROJECT", "MIN_NODE", "cache_root", "node_modules", "node_version"]

NODE_PROJECT = REPO / "docs" / "examples" / "node"
#: @noble/curves 2.x declares `"engines": {"node": ">= 20.19.0"}`.
MIN_NODE = (20, 19, 0)
_FILES = ("package.json", "package-lock.json")


def cache_root() -> Path:
    explicit = os.environ.get("BUZZ_BROKER_TEST_CACHE")
    if explicit:
        return Path(explicit) / "npm"
    if os.geteuid() == 0:
        return Path("/var/cache/buzz-broker-tests/npm")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "buzz-broker-tests" / "npm"


def node_version(node: str) -> tuple[int, ...]:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout
    return tuple(int(part) for part in out.strip().lstrip("v").split("."))


def node_modules() -> Path:
    """The `node_modules` directory the lockfile describes, installed once per lockfile."""
    digest = hashlib.sha256(b"".join((NODE_PROJECT / f).read_bytes() for f in _FILES)).hexdigest()
    home = cache_root()
    done = home / digest[:16]
    if (done / "node_modules").is_dir():
        return done / "node_modules"
    npm = shutil.which("npm")
    assert npm is not None, "npm is missing: `make deps` installs nodejs and npm"
    home.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="install-", dir=home))
    try:
        for name in _FILES:
            shutil.copy2(NODE_PROJECT / name, scratch / name)
        ran = subprocess.run(
            [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error",
             "--cache", str(home / "_cacache")],
            cwd=scratch, capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "npm_config_update_notifier": "false"},
        )
        assert ran.returncode == 0, (
            "`npm ci` for docs/examples/node failed; is npm's registry reachable from here? "
            f"(the lockfile pins every package and its hash)\n{ran.stderr[-2000:]}")
        try:
            scratch.rename(done)
        except OSError:
            if not (done / "node_modules").is_dir():  # not a concurrent run that won the race
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return done / "node_modules"
