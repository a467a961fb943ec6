"""The custodian's `token` row: does the token it is logged in to work now?
(custody/custodian/server.py `Custodian.token`, custody `Token.check`)

- `test_status_and_the_deep_check_fail_on_the_custodians_token_until_it_is_back`: a real
  custodian on a private SoftHSM token, the daemon serving through it. The token's
  directory moved away (what SoftHSM shows for token files gone or unreadable: the KEK's
  handle answers ObjectHandleInvalid, and logging in again finds no such token): `status`
  exits 1, its token line saying the custodian's token does not work and naming it,
  `check-config --deep` exits 1 saying the same; moved back, both pass again, nothing
  restarted. Before, both said "the custodian ... answers" and exited 0 while every
  signature failed (`_check_custodian` made no token call).
- `test_a_flood_of_token_asks_makes_one_hop_a_second`: however many ask at once or in a
  row, the row makes at most one token hop per TOKEN_CHECK_SECONDS (counted by custody's
  own hop observer); the asks between are given its answer.
- `test_a_flood_while_the_token_is_gone_waits_for_one_login_not_one_each`: each check with
  the token gone spends its login attempts (~0.3-0.6 s) on the one token worker; fifty asks
  at once are answered, every one the token's fault, in about one such check.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from custody import Custody, TokenConfig
from custody.custodian import messages, server
from custody.custodian.client import decode_reply
from custody.custodian.server import Custodian, Settings
from tests.custodian.test_refusals import ask
from tests.fixtures.custodian import CustodianProcess, write_custodian_config
from tests.fixtures.token import make_token

REPO = Path(__file__).resolve().parents[2]
LABEL = "bb-token-check"


@dataclass(frozen=True)
class Layout:
    """A private token, its custodian's config and socket, and the daemon's config."""

    root: Path
    token_dir: Path
    env: dict[str, str]
    token: TokenConfig
    custodian: Path
    socket: Path
    broker: Path
    broker_socket: Path

    @contextmanager
    def token_gone(self) -> Iterator[None]:
        moved = self.root / "tokens-moved"
        shutil.move(str(self.token_dir), str(moved))
        try:
            yield
        finally:
            shutil.move(str(moved), str(self.token_dir))


@pytest.fixture
def layout(local_relay: str) -> Iterator[Layout]:
    # Its own token, as tests/adversarial/test_runtime_faults.py: a token moved away must
    # not be the session's. A short directory: the sockets' paths must fit sun_path.
    with tempfile.TemporaryDirectory(prefix="bb-tc-") as name:
        root = Path(name)
        facts = make_token(root / "token", label=LABEL)
        env = {**os.environ, "SOFTHSM2_CONF": facts["SOFTHSM2_CONF"]}
        env.pop("BUZZ_BROKER_CONFIG", None)
        env.pop("CREDENTIALS_DIRECTORY", None)
        token = TokenConfig(module=facts["module"], token_label=facts["token_label"],
                            pin_file=facts["pin_file"], kek_label="bb-token-check-kek")
        state, socket = root / "state", root / "c.sock"
        custodian = write_custodian_config(root / "custodian.toml", token=token,
                                           state_dir=state, socket=socket,
                                           relay_url=local_relay)
        done = subprocess.run([sys.executable, "-m", "custody.custodian", str(custodian),
                               "keys", "init"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        broker = root / "broker.toml"
        broker.write_text(f'[server]\nsocket = "{root / "b.sock"}"\n[state]\ndir = "{state}"\n'
                          f'[custody]\ncustodian_socket = "{socket}"\n'
                          f'[relay]\nurl = "{local_relay}"\n')
        yield Layout(root, root / "token" / "tokens", env, token, custodian, socket, broker,
                     root / "b.sock")


@contextmanager
def _running(layout: Layout) -> Iterator[CustodianProcess]:
    custodian = CustodianProcess(layout.custodian, layout.socket,
                                 {"SOFTHSM2_CONF": layout.env["SOFTHSM2_CONF"]})
    custodian.start()
    try:
        yield custodian
    finally:
        custodian.stop()


@contextmanager
def _serving(layout: Layout) -> Iterator[None]:
    """`buzz-broker serve` through the custodian, once its socket is there."""
    daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--config",
                               str(layout.broker), "serve"], cwd=REPO, env=layout.env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not layout.broker_socket.exists():
            assert daemon.poll() is None and time.monotonic() < deadline, (
                daemon.stderr and daemon.stderr.read())
            time.sleep(0.05)
        yield
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        if daemon.stderr is not None:
            daemon.stderr.close()


def _cli(layout: Layout, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(layout.broker),
                           *argv], cwd=REPO, env=layout.env, capture_output=True, text=True,
                          timeout=60, check=False)


def _token_line(done: subprocess.CompletedProcess[str]) -> str:
    return next(line for line in done.stdout.splitlines() if line.startswith("token:"))


def _past_the_last_check() -> None:
    """Wait out the row's answer kept from the last check."""
    time.sleep(server.TOKEN_CHECK_SECONDS + 0.1)


@pytest.mark.token_independent  # its own token
def test_status_and_the_deep_check_fail_on_the_custodians_token_until_it_is_back(
        layout: Layout) -> None:
    with _running(layout), _serving(layout):
        healthy = _cli(layout, "status")
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        assert f"its token works (KEK {layout.token.kek_label!r}" in _token_line(healthy)
        _past_the_last_check()
        with layout.token_gone():
            gone = _cli(layout, "status")
            deep = _cli(layout, "check-config", "--deep")
        assert gone.returncode == 1, gone.stdout + gone.stderr
        line = _token_line(gone)
        assert line.startswith(f"token:       FAILED: the custodian at {layout.socket} "
                               "answers, but its token does not work now: "), line
        assert repr(LABEL) in line  # custody's message names the token (no such token now)
        assert deep.returncode == 1, deep.stdout + deep.stderr
        assert deep.stderr.startswith("buzz-broker: check-config --deep: token: the custodian "
                                      f"at {layout.socket} answers, but its token does not "
                                      "work now: "), deep.stderr
        assert repr(LABEL) in deep.stderr
        _past_the_last_check()  # back: the next check logs in again, nothing restarted
        again = _cli(layout, "status")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "its token works" in _token_line(again)
        assert _cli(layout, "check-config", "--deep").returncode == 0
    pin = Path(layout.token.pin_file or "").read_text().strip()
    for done in (healthy, gone, deep, again):
        assert pin not in done.stdout + done.stderr


async def test_a_flood_of_token_asks_makes_one_hop_a_second(
        custody: Custody, custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    custodian = Custodian(custody, Settings(
        socket=tmp_path / "unused.sock", pipeline_uid=os.getuid(), relay_url="wss://r.example",
        log_path=tmp_path / "log" / "signed.jsonl"))
    hops: list[str] = []
    custody.observe_token_calls(lambda op, _seconds: hops.append(op))
    answers: list[tuple[bool, Any]] = []

    async def asked() -> None:
        frame = await custodian.answer(messages.Request("token", {}))
        answers.append(decode_reply(frame[messages.HEADER.size:]))

    async with trio.open_nursery() as nursery:  # 200 at once
        for _ in range(200):
            nursery.start_soon(asked)
    assert hops == ["check_token"]
    began = trio.current_time()
    while trio.current_time() - began < 2.5 * server.TOKEN_CHECK_SECONDS:  # in a row
        await asked()
        await trio.sleep(0.01)
    elapsed = trio.current_time() - began
    assert answers == [(True, {"kek": custody_state[0].kek_label})] * len(answers)
    assert len(answers) > 200 + 100
    assert 2 <= len(hops) <= 2 + elapsed / server.TOKEN_CHECK_SECONDS, hops
    custodian.log.close()


@pytest.mark.token_independent  # its own token
def test_a_flood_while_the_token_is_gone_waits_for_one_login_not_one_each(
        layout: Layout) -> None:
    with _running(layout) as custodian:
        assert ask(layout.socket, "token") == (True, {"kek": layout.token.kek_label})
        _past_the_last_check()
        with layout.token_gone():
            began = time.monotonic()
            with ThreadPoolExecutor(50) as pool:
                answers = list(pool.map(lambda _: ask(layout.socket, "token"), range(50)))
            took = time.monotonic() - began
        codes = {(ok, answer[0]) for ok, answer in answers}  # type: ignore[index]
        assert codes == {(False, "custody")}, answers
        assert all(repr(LABEL) in answer[1] for _, answer in answers)  # type: ignore[index]
        # One check gone costs its login attempts, 0.3 to 0.6 s (custody/_token.py); one
        # each would be 15 s or more.
        assert took < 8.0, took
        assert custodian.proc is not None and custodian.proc.poll() is None
