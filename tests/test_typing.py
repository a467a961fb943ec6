"""The house rule that the code is typed throughout (style.md #4): mypy --strict over the
shipped packages is part of the suite, so a change that breaks it does not land."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_daemon_and_custody_pass_mypy_strict() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "daemon", "custody", "buzzwire",
         "client/buzz_broker_client"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
