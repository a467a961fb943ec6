"""What the docs' tests share: a venv holding only the agent-side client, made once."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.docs.snippets import REPO


@pytest.fixture(scope="session")
def client_only_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("client-venv")
    # docs/agents.md's `pip install ./buzzwire ./client`, from copies of the two folders
    # (a build writes into its source): the client's distribution and the shared wire one
    # it depends on, nothing else of the checkout.
    for folder in ("buzzwire", "client"):
        shutil.copytree(REPO / folder, root / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # This venv's pip installs into the fresh one (`--python`): no pip inside it, no
    # bootstrap cost; pip's own cache serves the dependency wheels after the first run.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q",
         "./buzzwire", "./client"], cwd=root,
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return python
