"""The audit log cannot be quietly edited under the real daemon (issue 13 item 4).

Each case runs the daemon as its own process (`tests/adversarial/_daemon.py`) on a real
SoftHSM2 token and edits the audit files the way an attacker with the daemon's file access
would:
- rename the live file away, delete it, hard-link it, or replace it (another file put at
  its path over it, or beside it after a rename: then only the inode tells them apart):
  the next request that must be audited is answered `failed` + `internal`, the operator
  log says `audit.unavailable`, and nothing was written into the moved file nor into the
  one now at its path;
- cut records off the tail while the daemon is stopped: `serve` refuses to start,
  `audit verify` exits non-zero (the log no longer reaches the head anchored in the state
  database), and `audit reanchor --yes` (for a restore from backup) is the way on: it
  writes a `reanchor` record naming the anchor given up, and the daemon starts again
  (tests/guardrails/test_audit.py proves a re-anchor cannot write while a daemon holds
  the log);
- delete the whole log while stopped: the same refusal at start and from `verify`.

`storage.address` is the request: audited like a read (no audit, no answer) and needing no
relay, so every answer here depends on the audit log alone.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from custody import TokenConfig
from daemon.state.audit import AUDIT_DIRNAME, audit_files, read_records
from daemon.cli.audit import EXIT_BROKEN
from tests.adversarial._daemon import (
    DaemonDied,
    DaemonProcess,
    envelope,
    post,
    request_body,
    setup_state,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]
#: Nothing listens here: these requests never need the relay.
NO_RELAY = "ws://127.0.0.1:9"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="bb-audit-") as name:
        yield Path(name)


def buzz(config: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config), *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def address() -> bytes:
    return request_body("storage.address", {"slug": "mem/" + uuid.uuid4().hex[:8]})


def refused() -> bytes:
    """A request refused by authorization (a channel not the credential's): within the
    burst its verdict line is written at once (a read that ran is only counted)."""
    return request_body("message.post", {"channelId": str(uuid.uuid4()), "content": "x"})


class Scene:
    def __init__(self, token: TokenConfig, state_dir: Path, short_dir: Path) -> None:
        self.token = token
        self.state_dir = state_dir
        self.audit = state_dir / AUDIT_DIRNAME
        self.socket = short_dir / "b.sock"
        self.config = write_config(short_dir / "broker.toml", token=token, state_dir=state_dir,
                                   socket=self.socket, relay_url=NO_RELAY)

    async def start(self) -> DaemonProcess:
        return await DaemonProcess.start(self.config, self.socket)

    async def serve_once(self, credential: str, count: int) -> None:
        """Start, answer `count` requests, stop cleanly."""
        daemon = await self.start()
        try:
            await _served(daemon, credential, count)
            assert await daemon.stop() == 0
        finally:
            daemon.kill()


@pytest.fixture
async def scene(custody_state: tuple[TokenConfig, Path], short_dir: Path) -> Scene:
    token, state_dir = custody_state
    return Scene(token, state_dir, short_dir)


async def _served(daemon: DaemonProcess, credential: str, count: int) -> None:
    for _ in range(count):
        answer = envelope(await post(daemon.socket, address(), credential))
        assert answer["status"] == "succeeded", (answer, daemon.log()[-2000:])


@pytest.mark.parametrize("how", ["rename", "delete", "hard_link", "replace",
                                 "rename_aside_then_create"])
async def test_a_moved_or_deleted_live_file_fails_closed(scene: Scene, how: str) -> None:
    agent = await setup_state(scene.token, scene.state_dir, [str(uuid.uuid4())])
    daemon = await scene.start()
    try:
        await _served(daemon, agent.credential, 3)
        [(_n, live)] = audit_files(scene.audit)
        size = live.stat().st_size
        aside = scene.state_dir / "elsewhere.jsonl"
        if how == "rename":
            live.rename(aside)
        elif how == "delete":
            live.unlink()
        elif how == "hard_link":
            os.link(live, aside)  # a second name someone could later swap in
        elif how == "replace":
            # The same name, another file: a copy whose tail the editor controls.
            copy = scene.state_dir / "copy.jsonl"
            shutil.copy(live, copy)
            os.replace(copy, live)
        else:
            # The open file keeps its one link under another name and a copy takes the
            # path: only the (device, inode) comparison tells the two apart.
            live.rename(aside)
            shutil.copy(aside, live)
        answer = envelope(await post(daemon.socket, refused(), agent.credential))
        assert (answer["status"], answer["error"]["code"]) == ("failed", "internal")
        # The log failed its last write: a read is no longer counted, it needs a line of
        # its own, which cannot be written either (no audit, no answer).
        answer = envelope(await post(daemon.socket, address(), agent.credential))
        assert (answer["status"], answer["error"]["code"]) == ("failed", "internal")
        # Every request fails the same way until it is mended: the log says so once a
        # minute per cause (the writer's line, and the pipeline's), not once a request.
        for _ in range(10):
            answer = envelope(await post(daemon.socket, refused(), agent.credential))
            assert (answer["status"], answer["error"]["code"]) == ("failed", "internal")
        events = [e for e in daemon.log_events() if e.get("event") == "audit.unavailable"]
        assert events and "replaced" in json.dumps(events), daemon.log()[-2000:]
        by_logger = collections.Counter(e.get("logger") for e in events)
        assert set(by_logger.values()) == {1}, events
        if how in ("rename", "hard_link", "rename_aside_then_create"):
            assert aside.stat().st_size == size  # nothing reached the moved file
        if how in ("replace", "rename_aside_then_create"):
            assert live.stat().st_size == size  # nor the file that took its path
        if how == "rename":
            # Put back where it belongs, the same chain goes on.
            aside.rename(live)
            await _served(daemon, agent.credential, 1)
        assert await daemon.stop() == 0
    finally:
        daemon.kill()


async def test_a_cut_tail_stops_serve_until_reanchored(scene: Scene) -> None:
    agent = await setup_state(scene.token, scene.state_dir, [str(uuid.uuid4())])
    await scene.serve_once(agent.credential, 5)
    assert buzz(scene.config, "audit", "verify").returncode == 0
    [(_n, live)] = audit_files(scene.audit)
    lines = live.read_bytes().splitlines(keepends=True)
    live.write_bytes(b"".join(lines[:-2]))  # a valid, shorter chain

    checked = buzz(scene.config, "audit", "verify")
    assert checked.returncode == EXIT_BROKEN, checked.stdout + checked.stderr
    assert "anchored head" in checked.stdout
    with pytest.raises(DaemonDied) as died:
        await scene.start()
    assert "anchored head" in str(died.value)

    # Without a terminal and without --yes, nothing is changed.
    asked = buzz(scene.config, "audit", "reanchor")
    assert asked.returncode != 0 and "--yes" in asked.stderr
    assert buzz(scene.config, "audit", "verify").returncode == EXIT_BROKEN
    done = buzz(scene.config, "audit", "reanchor", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert buzz(scene.config, "audit", "verify").returncode == 0
    last = [line.record for line in read_records(scene.audit)][-1]
    assert last is not None and last.phase.value == "reanchor"

    await scene.serve_once(agent.credential, 1)
    assert buzz(scene.config, "audit", "verify").returncode == 0


async def test_a_deleted_log_stops_serve(scene: Scene) -> None:
    agent = await setup_state(scene.token, scene.state_dir, [str(uuid.uuid4())])
    await scene.serve_once(agent.credential, 2)
    shutil.rmtree(scene.audit)
    checked = buzz(scene.config, "audit", "verify")
    assert checked.returncode == EXIT_BROKEN, checked.stdout + checked.stderr
    with pytest.raises(DaemonDied):
        await scene.start()
    # The daemon made a fresh empty directory on its failed start; verify still refuses.
    assert buzz(scene.config, "audit", "verify").returncode == EXIT_BROKEN
