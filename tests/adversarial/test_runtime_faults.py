"""Token and relay faults at runtime (issue 8 item 4).

The daemon runs as its own process on a PRIVATE SoftHSM2 token made for this module (so a
wrong PIN or a vanished token directory cannot disturb the session's shared token), with
relay timeouts of 1 s. Cases:

- the PIN file wrong (or missing) on restart -> one clear line in the log, a non-zero exit,
  no hang, the PIN never printed;
- the token's directory removed while the daemon runs -> requests get `failed` +
  `internal` at once (the fault comes before any side effect: signing precedes the pending
  record), with an operator log line naming the custody fault; back in place -> served
  again without a restart (custody logs in again and finds the KEK anew).
- the relay going away and coming back: during the outage publishes are `failed` +
  `action_failed` (nothing could be sent) and reads `failed` + `action_failed`, each within
  its timeout; once the relay is back on the same address the very next requests succeed
  without restarting the daemon.

Every request gets an envelope (none is lost), and every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from custody import TokenConfig
from daemon.state.sessions import SessionStore
from tests.adversarial._daemon import (
    ALL_ACTIONS,
    REPO,
    DaemonProcess,
    envelope,
    post,
    request_body,
    write_config,
)
from tests.fixtures.relay import free_port, start_devrelay
from tests.fixtures.token import make_token
from tests.json_lines import json_lines

TIMEOUT = 1.0
MARGIN = 2.0
#: A daemon that cannot start must say so and exit within this (token login is ~20 ms).
EXIT_SECONDS = 10.0
CHANNEL = "0b6f6a1e-0000-4000-8000-00000000000a"
OWNER = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"


@dataclass(frozen=True)
class Private:
    """A private token and a state directory with one agent and a credential for it."""

    root: Path
    token_dir: Path
    env: dict[str, str]
    token: TokenConfig
    state_dir: Path
    agent: str
    credential: str

    def config(self, relay_url: str, pin_file: str | None = None) -> tuple[Path, Path]:
        socket = self.root / "b.sock"
        token = self.token if pin_file is None else TokenConfig(
            module=self.token.module, token_label=self.token.token_label, pin_file=pin_file,
            kek_label=self.token.kek_label)
        path = write_config(self.root / f"b-{uuid.uuid4().hex[:6]}.toml", token=token,
                            state_dir=self.state_dir, socket=socket, relay_url=relay_url,
                            relay_timeout=TIMEOUT)
        return path, socket


def _cli(env: dict[str, str], config: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def private() -> Iterator[Private]:
    with tempfile.TemporaryDirectory(prefix="bb-rt-") as name:
        root = Path(name)
        facts = make_token(root / "token", label="bb-runtime-faults")
        env = {**os.environ, "SOFTHSM2_CONF": facts["SOFTHSM2_CONF"]}
        env.pop("BUZZ_BROKER_CONFIG", None)
        token = TokenConfig(module=facts["module"], token_label=facts["token_label"],
                            pin_file=facts["pin_file"], kek_label="bb-runtime-kek")
        state_dir = root / "state"
        config = write_config(root / "setup.toml", token=token, state_dir=state_dir,
                              socket=root / "b.sock", relay_url="ws://127.0.0.1:1")
        _cli(env, config, "keys", "init")
        _cli(env, config, "agent", "create", "--owner", OWNER, "--name", "runtime")
        agent = json_lines(_cli(env, config, "agent", "list", "--json"))[0]["pubkey"]
        store = SessionStore.open(state_dir)
        try:
            _, credential = store.issue(agent=agent, channels=frozenset({CHANNEL}),
                                        actions=frozenset(ALL_ACTIONS), ttl_seconds=None,
                                        uid=None, now=int(time.time()))
        finally:
            store.close()
        yield Private(root, root / "token" / "tokens", env, token, state_dir, agent,
                      credential)


def read_body() -> bytes:
    return request_body("channel.read", {"channelId": CHANNEL})


def _post_body() -> bytes:
    return request_body("message.post", {"channelId": CHANNEL, "content": str(uuid.uuid4())})


async def _call(socket: Path, body: bytes, credential: str) -> tuple[dict[str, Any], float]:
    began = time.monotonic()
    answer = envelope(await post(socket, body, credential, timeout=15.0))
    return answer, time.monotonic() - began


def _code(answer: dict[str, Any]) -> tuple[str, str | None]:
    return answer["status"], answer.get("error", {}).get("code")


@pytest.mark.parametrize("fault", ["wrong", "missing"])
async def test_pin_file_wrong_on_restart_is_one_line_and_nonzero(
    private: Private, fault: str,
) -> None:
    good, socket = private.config(f"ws://127.0.0.1:{free_port()}")
    first = await DaemonProcess.start(good, socket, env=private.env)
    assert await first.stop() == 0
    pin_file = private.root / f"pin-{fault}"
    if fault == "wrong":
        pin_file.write_text("0000-not-the-pin\n")
        pin_file.chmod(0o600)
    bad, socket = private.config(f"ws://127.0.0.1:{free_port()}", pin_file=str(pin_file))
    daemon = await DaemonProcess.start(bad, socket, env=private.env, wait=False)
    try:
        code = await daemon.wait_exit(EXIT_SECONDS)
    finally:
        daemon.kill()
    log = daemon.log()
    assert code is not None and code != 0, f"no exit within {EXIT_SECONDS} s: {log[-2000:]}"
    assert "Traceback" not in log
    fault_lines = [line for line in log.splitlines() if line.startswith("crashing_daemon:")]
    assert len(fault_lines) == 1, log
    print(f"PIN {fault}: exit {code}: {fault_lines[0]}")
    assert "PIN" in fault_lines[0] or "pin" in fault_lines[0], fault_lines
    real_pin = Path(private.token.pin_file or "").read_text().strip()
    assert real_pin not in log and "0000-not-the-pin" not in log


async def test_token_directory_removed_while_running(private: Private) -> None:
    config, socket = private.config(f"ws://127.0.0.1:{free_port()}")
    daemon = await DaemonProcess.start(config, socket, env=private.env)
    moved = private.root / "tokens-moved"
    try:
        shutil.move(str(private.token_dir), str(moved))
        try:
            for _ in range(3):
                answer, took = await _call(socket, _post_body(), private.credential)
                assert _code(answer) == ("failed", "internal")
                assert took < MARGIN  # refused before the relay is even tried
        finally:
            shutil.move(str(moved), str(private.token_dir))
        assert await daemon.stop() == 0
    finally:
        daemon.kill()
    faults = [e for e in daemon.log_events() if e.get("event") == "custody.fault"]
    # One line for the three (the same cause, within a minute: broker.REQUEST_LINES).
    assert len(faults) == 1 and faults[0]["level"] == "error", faults
    # Back in place, a restart serves again (the relay is down here: failed, not internal).
    again = await DaemonProcess.start(config, socket, env=private.env)
    try:
        answer, took = await _call(socket, _post_body(), private.credential)
        assert _code(answer) == ("failed", "action_failed")
        assert took < TIMEOUT + MARGIN
        assert await again.stop() == 0
    finally:
        again.kill()


async def test_token_directory_back_recovers_without_restart(private: Private) -> None:
    config, socket = private.config(f"ws://127.0.0.1:{free_port()}")
    daemon = await DaemonProcess.start(config, socket, env=private.env)
    moved = private.root / "tokens-moved"
    try:
        shutil.move(str(private.token_dir), str(moved))
        try:
            answer, _ = await _call(socket, _post_body(), private.credential)
            assert _code(answer) == ("failed", "internal")
        finally:
            shutil.move(str(moved), str(private.token_dir))
        answer, _ = await _call(socket, _post_body(), private.credential)
        assert _code(answer) == ("failed", "action_failed")  # signed; the relay is down
    finally:
        daemon.kill()


async def test_relay_away_and_back_without_restarting_the_daemon(private: Private) -> None:
    port = free_port()
    config, socket = private.config(f"ws://127.0.0.1:{port}")
    daemon = await DaemonProcess.start(config, socket, env=private.env)
    try:
        with start_devrelay(auth=True, port=port):
            before, _ = await _call(socket, _post_body(), private.credential)
            assert before["status"] == "succeeded", before
        # The relay is gone (killed with its connections).
        outage: list[dict[str, Any]] = []
        for body in (_post_body(), read_body(), _post_body(), read_body()):
            answer, took = await _call(socket, body, private.credential)
            outage.append(answer)
            assert took < TIMEOUT + MARGIN, (took, answer)
        assert [_code(a) for a in outage] == [("failed", "action_failed")] * 4
        with start_devrelay(auth=True, port=port):
            with trio.fail_after(10):  # backoff: the pool reconnects on demand
                while True:
                    after, _ = await _call(socket, _post_body(), private.credential)
                    if after["status"] == "succeeded":
                        break
                    assert _code(after) == ("failed", "action_failed"), after
                    await trio.sleep(0.2)
            read, _ = await _call(socket, read_body(), private.credential)
            assert read["status"] == "succeeded", read
            assert after["outcome"]["eventId"] in [m["id"] for m in read["outcome"]["messages"]]
        assert await daemon.stop() == 0
    finally:
        daemon.kill()
    assert "Traceback" not in daemon.log()
