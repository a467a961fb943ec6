"""The daemon out of file descriptors (EMFILE at accept): it waits and retries, serves
again once connections close, and says so once a minute, not ten times a second.

A real daemon process whose RLIMIT_NOFILE is lowered from outside (`prlimit` on its pid)
to a few more than it holds; clients then hold connections open until accept fails.
"""

from __future__ import annotations

import os
import resource
import socket as stdsocket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from custody import TokenConfig
from daemon.http import ACCEPT_RETRY_SLEEP
from tests.adversarial._daemon import (DaemonProcess, envelope, post, request_body,
                                       setup_state, write_config)

NO_RELAY = "ws://127.0.0.1:9"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="bb-fds-") as name:
        yield Path(name)


async def test_out_of_descriptors_the_daemon_waits_serves_again_and_logs_once(
        custody_state: tuple[TokenConfig, Path], short_dir: Path) -> None:
    token, state_dir = custody_state
    agent = await setup_state(token, state_dir, [str(uuid.uuid4())])
    socket = short_dir / "b.sock"
    config = write_config(short_dir / "broker.toml", token=token, state_dir=state_dir,
                          socket=socket, relay_url=NO_RELAY)
    daemon = await DaemonProcess.start(config, socket)
    address = request_body("storage.address", {"slug": "mem/x"})
    held: list[stdsocket.socket] = []
    try:
        assert envelope(await post(socket, address, agent.credential))["status"] == "succeeded"
        limit = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE,
                         (len(os.listdir(f"/proc/{daemon.pid}/fd")) + 2, limit[1]))
        for _ in range(12):  # more than the daemon can accept now
            client = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
            client.connect(str(socket))
            held.append(client)
        await trio.sleep(20 * ACCEPT_RETRY_SLEEP)  # twenty retries' worth
        for client in held:
            client.close()
        held.clear()
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, limit)
        with trio.fail_after(10):
            answer = envelope(await post(socket, address, agent.credential))
        assert answer["status"] == "succeeded"
        retries = [e for e in daemon.log_events() if e.get("event") == "accept_retry"]
        assert len(retries) == 1, retries
        assert await daemon.stop() == 0
    finally:
        for client in held:
            client.close()
        daemon.kill()
