"""`make run`'s demo, as a new user would see it: token, relay, custodian, agent, credential,
daemon, and a first `curl` that answers succeeded (signed by the custodian) — in a fresh directory, then again in the same one; a
second demo beside a running one, its relay dying, `make stop`, and `run/env` in a fresh
shell. Then what a demo killed outright leaves (a stale socket, a child that outlived it)
and a half-made run directory: one line that says what to do, or a clean start.

Every demo runs in its own directory under pytest's tmp dirs (`--run-dir`), never the
checkout's run/. The tests from the first on share one run directory (`demo_dir`, made by
one demo run), in file order: each starts from what the last one left."""

from __future__ import annotations

import json
import re
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.units import BROKER_UNIT, CUSTODIAN_UNIT, unit_environment

REPO = Path(__file__).resolve().parent.parent
needs_curl = pytest.mark.skipif(not Path("/usr/bin/curl").exists(),
                                reason="make run needs curl (the Makefile installs it)")


#: What the units set: a shell running `make run` has none of it (the demo must add it).
UNITS = unit_environment(BROKER_UNIT) | unit_environment(CUSTODIAN_UNIT)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("SOFTHSM2_CONF", "BUZZ_BROKER_CONFIG", *UNITS)
            and not k.startswith("BUZZ_BROKER_")}


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def _demo(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.demo", "--run-dir", str(run_dir), *extra],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)


def _credentials(run_dir: Path) -> list[dict[str, object]]:
    listed = subprocess.run(
        ["bash", "-c", f"source {run_dir / 'env'} && buzz-broker credential list --json"],
        env=_env(), capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    return [json.loads(line) for line in listed.stdout.splitlines()]


def _alive(pid: int) -> bool:
    """`pid` runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    """A demo that failed: exit 1 and one line on stderr, no traceback."""
    assert done.returncode == 1, (done.stdout[-2000:], done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One demo run in a fresh directory (`--no-wait`), shared by the tests below in turn."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    return run_dir, _demo(run_dir, "--no-wait")


@needs_curl
def test_demo_posts_a_first_message_and_runs_again(
    demo_dir: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    run_dir, first = demo_dir
    for attempt in (1, 2):
        if attempt == 2:
            # A socket file nobody answers on, as a demo killed outright (kill -9 of its
            # process group) leaves: the next run waits for its own daemon to answer.
            (run_dir / "broker.sock").unlink(missing_ok=True)
            with socket.socket(socket.AF_UNIX) as stale:
                stale.bind(str(run_dir / "broker.sock"))
        done = first if attempt == 1 else _demo(run_dir, "--no-wait")
        assert done.returncode == 0, (attempt, done.stdout[-2000:], done.stderr[-2000:])
        assert '"status":"succeeded"' in done.stdout
        assert "curl -sS --unix-socket" in done.stdout
        # The printed curl reads its header from a 0600 file: no credential in argv.
        assert f"-H @{run_dir / 'auth-header'}" in done.stdout
    # The custodian signed it, and the demo says plainly that one uid separates nothing,
    # naming that uid, root included (it said "no root" to root).
    who = f"{pwd.getpwuid(os.getuid()).pw_name}, uid {os.getuid()}"
    assert (f"It and the daemon run under one uid, yours ({who}): NOTHING IS SEPARATED"
            in done.stdout), done.stdout
    assert "no root" not in done.stdout and "custodian" in done.stdout
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


def _start_demo(run_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.demo", "--run-dir", str(run_dir)],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _until_running(demo: subprocess.Popen[str]) -> list[str]:
    """The demo's lines until it says its processes are running."""
    assert demo.stdout is not None
    lines: list[str] = []
    while "are running" not in (line := demo.stdout.readline()):
        assert line, "the demo ended before it was running"
        lines.append(line)
    return lines


@needs_curl
def test_make_stop_ends_the_demo(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert "no demo runs" in _demo(run_dir, "--stop").stdout
    demo = _start_demo(run_dir)
    try:
        lines = _until_running(demo)
        # What it started: the relay and the custodian say their pids, the daemon's is in
        # its run lock. `make stop` must leave none of them behind.
        started = [int(pid) for line in lines for pid in re.findall(r"\(pid (\d+)\)", line)]
        started.append(int((run_dir / "state" / "serve.lock").read_text()))
        assert len(started) == 3, lines
        # The custodian and the daemon run with their units' environment (the allocator
        # that overwrites every free, docs/custodian.md), though the shell had none of it.
        _relay, custodian, daemon = started
        for pid, unit in ((custodian, CUSTODIAN_UNIT), (daemon, BROKER_UNIT)):
            assert unit_environment(unit).items() <= _environ(pid).items(), unit.name
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


@needs_curl
def test_a_killed_demo_takes_its_children_and_make_stop_ends_what_outlived_it(
    demo_dir: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    run_dir = demo_dir[0]
    demo = _start_demo(run_dir)
    started: list[int] = []
    try:
        lines = _until_running(demo)
        relay, custodian = [int(pid) for line in lines
                            for pid in re.findall(r"\(pid (\d+)\)", line)]
        daemon = int((run_dir / "state" / "serve.lock").read_text())
        started = [relay, custodian, daemon]
        # The daemon is frozen, so it cannot act on the signal its demo's death sends it:
        # it stands for any child that outlives the demo.
        os.kill(daemon, signal.SIGSTOP)
        demo.kill()  # SIGKILL: the demo's finally never runs
        demo.wait()
        deadline = time.monotonic() + 15
        while _alive(relay) or _alive(custodian):
            assert time.monotonic() < deadline, "the relay or custodian outlived its demo"
            time.sleep(0.1)

        # A new demo does not start beside what is left: it says so, and touches nothing.
        config_before = (run_dir / "broker.toml").read_bytes()
        said = _one_line(_demo(run_dir, "--no-wait"))
        assert f"daemon (pid {daemon})" in said and "make stop" in said
        assert (run_dir / "broker.toml").read_bytes() == config_before

        # `make stop` ends it, though no demo runs.
        stopped = _demo(run_dir, "--stop")
        assert stopped.returncode == 0 and f"daemon (pid {daemon})" in stopped.stdout
        assert not _alive(daemon)
        assert "no demo runs" in _demo(run_dir, "--stop").stdout
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in started:  # the demo's children, this test's to end if it failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@needs_curl
def test_a_half_made_run_dir_is_one_line_or_a_clean_start(
    demo_dir: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    # run/ is a file.
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for mode in ("--no-wait", "--stop"):
        assert "remove" in _one_line(_demo(not_a_dir, mode))
    # A user PIN file others can read: make-token's own remedy, on one line.
    fresh = tmp_path / "fresh"
    (fresh / "softhsm").mkdir(parents=True)
    (fresh / "softhsm" / "user-pin").write_text("0123456789\n")
    (fresh / "softhsm" / "user-pin").chmod(0o644)
    assert "chmod 600" in _one_line(_demo(fresh, "--no-wait"))

    run_dir = demo_dir[0]
    # The token gone, the keys sealed under it kept: said, and no new token made.
    tokens = run_dir / "softhsm" / "tokens"
    kept = tokens.rename(tmp_path / "tokens")
    try:
        said = _one_line(_demo(run_dir, "--no-wait"))
        assert f"remove {run_dir}" in said and not tokens.exists()
    finally:
        shutil.rmtree(tokens, ignore_errors=True)
        kept.rename(tokens)
    # The state gone, the agent file kept: a new agent and credential, a first request.
    agent_before = (run_dir / "agent.pub").read_text()
    shutil.rmtree(run_dir / "state")
    done = _demo(run_dir, "--no-wait")
    assert done.returncode == 0 and '"status":"succeeded"' in done.stdout, done.stderr[-2000:]
    assert (run_dir / "agent.pub").read_text() != agent_before


def _connect_refused(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return True
    return False
