"""`make run`'s demo, as a new user would see it: token, relay, agent, credential, daemon, and
a first `curl` that answers succeeded — in a fresh directory, then again in the same one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not Path("/usr/bin/curl").exists(), reason="make run needs curl (the Makefile installs it)")
def test_demo_posts_a_first_message_and_runs_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("SOFTHSM2_CONF", "BUZZ_BROKER_CONFIG")}
    for attempt in (1, 2):
        done = subprocess.run([sys.executable, "-m", "tests.demo", "--run-dir", str(run_dir),
                               "--no-wait"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (attempt, done.stdout[-2000:], done.stderr[-2000:])
        assert '"status":"succeeded"' in done.stdout
        assert "curl -sS --unix-socket" in done.stdout
    credential = (run_dir / "credential").read_text().strip()
    daemon_log = (run_dir / "broker.log").read_text()
    assert '"event":"verdict"' in daemon_log  # the first request is in the daemon's log
    for text in (done.stdout, done.stderr, daemon_log):
        assert credential not in text
    assert (run_dir / "credential").stat().st_mode & 0o077 == 0
    for pin in ("user-pin", "so-pin"):
        secret = (run_dir / "softhsm" / pin).read_text().strip()
        for text in (done.stdout, done.stderr, daemon_log):
            assert secret not in text
