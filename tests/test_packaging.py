"""What an operator sees of the package itself: `--version`, and builds with no warnings of
our own (`make run` showed about 45 lines of setuptools deprecation warnings)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_version_is_the_projects() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run([sys.executable, "-m", "daemon.cli", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"buzz-broker {version}\n")


@pytest.mark.parametrize("project", [".", "client"], ids=["daemon", "client"])
def test_a_build_prints_no_warning(project: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path),
         str(REPO / project)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "warning" not in output.lower(), output[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    listing = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)],
                             capture_output=True, text=True, check=True).stdout
    assert "licenses/LICENSE" in listing  # the Apache-2.0 text pyproject names ships
