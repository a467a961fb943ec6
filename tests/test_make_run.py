"""`make run`'s demo, as a new user would see it: token, relay, custodian, agent, credential,
daemon, and a first `curl` that answers succeeded (signed by the custodian) — in a fresh directory, then again in the same one; a
second demo beside a running one, its relay dying, `make stop`, and `run/env` in a fresh
shell."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
needs_curl = pytest.mark.skipif(not Path("/usr/bin/curl").exists(),
                                reason="make run needs curl (the Makefile installs it)")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("SOFTHSM2_CONF", "BUZZ_BROKER_CONFIG") and not k.startswith("BUZZ_BROKER_")}


def _demo(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.demo", "--run-dir", str(run_dir), *extra],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)


def _credentials(run_dir: Path) -> list[dict[str, object]]:
    listed = subprocess.run(
        ["bash", "-c", f"source {run_dir / 'env'} && buzz-broker credential list --json"],
        env=_env(), capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    return [json.loads(line) for line in listed.stdout.splitlines()]


@needs_curl
def test_demo_posts_a_first_message_and_runs_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for attempt in (1, 2):
        done = _demo(run_dir, "--no-wait")
        assert done.returncode == 0, (attempt, done.stdout[-2000:], done.stderr[-2000:])
        assert '"status":"succeeded"' in done.stdout
        assert "curl -sS --unix-socket" in done.stdout
        # The printed curl reads its header from a 0600 file: no credential in argv.
        assert f"-H @{run_dir / 'auth-header'}" in done.stdout
    # The custodian signed it, and the demo says plainly that one uid separates nothing.
    assert "NOTHING IS SEPARATED" in done.stdout and "custodian" in done.stdout
    signed = (run_dir / "state" / "custodian" / "signed.jsonl").read_text()
    assert '"op":"sign"' in signed.replace(" ", "")
    credential = (run_dir / "credential").read_text().strip()
    daemon_log = (run_dir / "broker.log").read_text()
    assert '"event":"verdict"' in daemon_log  # the first request is in the daemon's log
    env_text = (run_dir / "env").read_text()
    for text in (done.stdout, done.stderr, daemon_log, env_text):
        assert credential not in text
    for name in ("credential", "auth-header", "env"):
        assert (run_dir / name).stat().st_mode & 0o077 == 0, name
    for pin in ("user-pin", "so-pin"):
        secret = (run_dir / "softhsm" / pin).read_text().strip()
        for text in (done.stdout, done.stderr, daemon_log, env_text):
            assert secret not in text
    # One credential per demo agent, reused: the second run issued none.
    live = [c for c in _credentials(run_dir) if c["state"] == "active"]
    assert [c["id"] for c in live] == [(run_dir / "credential.id").read_text().strip()]


@needs_curl
def test_a_second_demo_refuses_a_dead_relay_is_said_and_env_reaches_the_demo(
    tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    demo = subprocess.Popen([sys.executable, "-m", "tests.demo", "--run-dir", str(run_dir)],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert demo.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while not any("are running" in line for line in lines):
            assert time.monotonic() < deadline and demo.poll() is None, lines
            lines.append(demo.stdout.readline())
        relay_pid = int(lines[0].rsplit("(pid ", 1)[1].rstrip(")\n"))
        config_before = (run_dir / "broker.toml").read_bytes()

        # A second demo in the same directory refuses, and touches nothing of the first.
        second = _demo(run_dir, "--no-wait")
        assert second.returncode == 1
        assert "a demo already runs in" in second.stderr and "make stop" in second.stderr
        assert "are running" not in second.stdout
        assert (run_dir / "broker.toml").read_bytes() == config_before

        # run/env, sourced in a fresh shell, reaches the demo: status exits 0.
        status = subprocess.run(["bash", "-c", f"source {run_dir / 'env'} && buzz-broker status"],
                                env=_env(), capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr

        # The relay dies: the demo says so, stops its daemon and exits non-zero.
        os.kill(relay_pid, signal.SIGKILL)
        _out, err = demo.communicate(timeout=60)
        assert demo.returncode == 1
        assert "the development relay exited" in err
        assert not (run_dir / "broker.sock").exists() or _connect_refused(run_dir / "broker.sock")
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


@needs_curl
def test_make_stop_ends_the_demo(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert "no demo runs" in _demo(run_dir, "--stop").stdout
    demo = subprocess.Popen([sys.executable, "-m", "tests.demo", "--run-dir", str(run_dir)],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert demo.stdout is not None
        lines: list[str] = []
        while "are running" not in (line := demo.stdout.readline()):
            assert line, "the demo ended before it was running"
            lines.append(line)
        # What it started: the relay and the custodian say their pids, the daemon's is in
        # its run lock. `make stop` must leave none of them behind.
        started = [int(pid) for line in lines for pid in re.findall(r"\(pid (\d+)\)", line)]
        started.append(int((run_dir / "state" / "serve.lock").read_text()))
        assert len(started) == 3, lines
        stopped = _demo(run_dir, "--stop")
        assert stopped.returncode == 0 and "stopped the demo" in stopped.stdout
        assert demo.wait(timeout=30) == 0
        for pid in started:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def _connect_refused(path: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return True
    return False
