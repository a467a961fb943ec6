"""observer.emit killed by SIGKILL at its crash points, then the identical retry.

The daemon runs as its own process (`tests.adversarial.crashing_daemon`) on the open
LocalRelay; the owner watches kind 24200 live (tests/fixtures/observer.py).

    before_verdict  the frames are encrypted, signed and held in the queue; the verdict
                    is not recorded. Held frames are never handed to the relay, so the
                    kill leaves nothing published; the retry runs afresh (not a replay)
                    and the owner sees each frame exactly once.
    after_verdict   the verdict is recorded (the frames released to the pacer), the answer
                    not written. The retry is a replay with the same count and enqueues
                    nothing: each frame reaches the owner at most once (whether the pacer
                    sent it before the kill is a race NIP-BA allows: "drops after intake").

After the retry, a sentinel frame is sent on a fresh requestId; the queue is first in,
first out per credential, so once the sentinel arrives every earlier frame that was going
to arrive has.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from custody import TokenConfig
from tests.adversarial._daemon import DaemonProcess, envelope, post, request_body, setup_state
from tests.fixtures.broker import write_config
from tests.fixtures.observer import OwnerWatch, decrypt
from tests.fixtures.relay import TestKey

SIGKILLED = -9
_FRAMES = 3


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="bb-obs-") as name:
        yield Path(name)


def _emit(payloads: list[str], request_id: str) -> bytes:
    return request_body("observer.emit", {"frames": [{"kind": "k", "payload": p} for p in payloads]},
                        request_id=request_id)


@pytest.mark.parametrize("point", ["before_verdict", "after_verdict"])
async def test_sigkill_then_identical_retry_publishes_each_frame_at_most_once(
    point: str, custody_state: tuple[TokenConfig, Path], local_relay_open: str, short_dir: Path,
) -> None:
    token, state_dir = custody_state
    owner = TestKey()
    channel = str(uuid.uuid4())
    requester = await setup_state(token, state_dir, [channel], owner=owner.pubkey,
                                  actions=["observer.emit"])
    socket = short_dir / "b.sock"
    config = write_config(short_dir / "broker.toml", token=token, state_dir=state_dir,
                          socket=socket, relay_url=local_relay_open)
    payloads = [f"crash {point} {i}" for i in range(_FRAMES)]
    body = _emit(payloads, f"obs-crash-{uuid.uuid4()}")

    async with OwnerWatch(local_relay_open, owner, want=0, until="sentinel") as watch:
        first = await DaemonProcess.start(config, socket, step=point)
        try:
            assert await post(socket, body, requester.credential) is None
            assert await first.wait_exit(10.0) == SIGKILLED, first.log()[-2000:]
        finally:
            first.kill()
        second = await DaemonProcess.start(config, socket)
        try:
            retried = envelope(await post(socket, body, requester.credential))
            assert retried["status"] == "succeeded", (retried, second.log()[-3000:])
            assert retried["outcome"] == {"accepted": _FRAMES}
            assert retried.get("replayed", False) is (point == "after_verdict")
            sentinel = envelope(await post(socket, _emit(["sentinel"], f"obs-s-{uuid.uuid4()}"),
                                           requester.credential))
            assert sentinel["outcome"] == {"accepted": 1}
            events = await watch.collected()
            assert await second.stop() == 0
        finally:
            second.kill()

    seen: list[Any] = [decrypt(owner, e)["payload"] for e in events]
    assert len(seen) == len(set(seen)), seen  # nothing twice
    if point == "before_verdict":
        assert sorted(seen) == sorted(payloads)
    else:
        assert set(seen) <= set(payloads)
    opened = [decrypt(owner, e) for e in events]
    # seq never repeats across the restart (daemon/state/observer_seq.py).
    assert len({o["seq"] for o in opened}) == len(opened)
