"""Helpers for tests that run the daemon as a separate process and kill it.

- `DaemonProcess.start(config, step)`: ``python -m tests.adversarial.crashing_daemon``
  with stderr captured to a file; returns once it logged ``serve.ready`` (or
  raises `DaemonDied` with the tail of its log if the process exits first).
- `post(socket, body, credential)`: one POST /v1/action with exactly `body`; returns an
  `Answer` (HTTP status and body bytes) or `None` when the daemon closed the connection
  without answering - which is what a client sees when the daemon is killed mid-request.
- `KillingProxy`: a WebSocket proxy in front of a relay that kills the daemon at a relay-side
  `Moment` (EVENT not forwarded, relay stored it but OK withheld, OK delivered then kill).
- `pending_event_ids(state_dir, principal, request_id)`: the event ids a dead daemon had
  committed in its ledger's pending record.
- `setup_state(token, state_dir)`: an agent imported into custody and a credential for it,
  made in this process before the daemon starts (the daemon reads both from disk).

Every wait is bounded: a hung daemon fails the test with a clear message, never hangs it.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import coincurve
import h11
import trio
import trio_websocket

from buzzwire.contract import ACTIONS
from custody import Custody, TokenConfig
from daemon.state.sessions import SessionStore
from daemon.state.directory import AgentDirectory
from tests.fixtures.broker import write_config as broker_config

__all__ = [
    "Answer",
    "DaemonDied",
    "DaemonProcess",
    "post",
    "envelope",
    "setup_state",
    "AgentState",
    "request_body",
    "pending_event_ids",
    "KillingProxy",
    "Moment",
    "write_config",
    "START_SECONDS",
    "ALL_ACTIONS",
]

REPO = Path(__file__).resolve().parents[2]
#: The daemon is ready in ~0.3 s here (token login included); this only catches a broken start.
START_SECONDS = 20.0
#: Every action the contract offers, so each adversarial suite covers actions as they land.
ALL_ACTIONS = tuple(ACTIONS)


def write_config(path: Path, *, token: TokenConfig, state_dir: Path, socket: Path,
                 relay_url: str, relay_timeout: float = 1.0) -> Path:
    """A daemon config whose relay timeouts are all `relay_timeout` (short: fault tests wait them)."""
    return broker_config(path, token=token, state_dir=state_dir, socket=socket,
                         relay_url=relay_url, relay_timeout=relay_timeout)


class DaemonDied(Exception):
    """The daemon process exited when the test expected it to serve."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes


class DaemonProcess:
    """One run of the daemon; a test restarts by starting another on the same config."""

    def __init__(self, proc: subprocess.Popen[bytes], socket: Path, log_path: Path) -> None:
        self.proc = proc
        self.socket = socket
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, config_path: Path, socket: Path, *, step: str = "none",
                    log_path: Path | None = None, wait: bool = True,
                    env: Mapping[str, str] | None = None) -> DaemonProcess:
        log_path = log_path or config_path.with_name(f"daemon-{uuid.uuid4().hex[:8]}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.adversarial.crashing_daemon", str(config_path), step],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env={k: v for k, v in (env or os.environ).items() if k != "BUZZ_BROKER_CONFIG"},
            )
        daemon = cls(proc, socket, log_path)
        if wait:
            await daemon.wait_ready()
        return daemon

    async def wait_ready(self, seconds: float = START_SECONDS) -> None:
        """Until the daemon logged ``serve.ready``: the socket is bound *before* the token
        is opened, so a connectable socket is not yet a serving daemon (nor one whose
        SIGTERM handler is installed)."""
        with trio.move_on_after(seconds):
            while True:
                if self.proc.poll() is not None:
                    raise DaemonDied(f"exit {self.proc.returncode}: {self.log()[-2000:]}")
                if '"event":"serve.ready"' in self.log():
                    return
                await trio.sleep(0.02)
        self.kill()
        raise DaemonDied(f"not serving after {seconds} s: {self.log()[-2000:]}")

    async def wait_exit(self, seconds: float) -> int | None:
        """The exit status, or None if the process is still running after `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                return code
            await trio.sleep(0.02)
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._unlink_stale_socket()

    async def stop(self) -> int:
        """SIGTERM and wait for the drain; SIGKILL if it takes more than 15 s (a bug)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = await self.wait_exit(15.0)
        if code is None:
            self.kill()
            raise AssertionError(f"daemon ignored SIGTERM for 15 s: {self.log()[-2000:]}")
        return code

    def _unlink_stale_socket(self) -> None:
        # A SIGKILLed daemon leaves its socket file; the next start binds the same path.
        try:
            self.socket.unlink()
        except FileNotFoundError:
            pass

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_events(self) -> list[dict[str, Any]]:
        """The structured JSON lines of the log (non-JSON lines are skipped)."""
        out = []
        for line in self.log().splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out


async def post(socket: Path, body: bytes, credential: str | None,
               *, timeout: float = 30.0) -> Answer | None:
    """POST /v1/action; None when the connection ended without a response (daemon died).

    Raises trio.TooSlowError after `timeout`: an answer that never comes is a hang.
    """
    with trio.fail_after(timeout):
        try:
            stream = await trio.open_unix_socket(str(socket))
        except OSError:
            return None
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            headers = [("Host", "broker"), ("Content-Type", "application/json"),
                       ("Content-Length", str(len(body)))]
            if credential is not None:
                headers.append(("Authorization", f"Bearer {credential}"))
            try:
                await stream.send_all(conn.send(h11.Request(method="POST", target="/v1/action",
                                                            headers=headers)))
                await stream.send_all(conn.send(h11.Data(data=body)))
                await stream.send_all(conn.send(h11.EndOfMessage()))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            status = 0
            chunks: list[bytes] = []
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError:
                    return None  # the peer closed mid-response
                if event is h11.NEED_DATA:
                    try:
                        data = await stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return None
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return Answer(status, b"".join(chunks))
                elif isinstance(event, h11.ConnectionClosed):
                    return None


def envelope(answer: Answer | None) -> dict[str, Any]:
    """The parsed response of an answered request (HTTP 200 with a body)."""
    assert answer is not None, "the daemon gave no answer"
    assert answer.status == 200, answer
    parsed: dict[str, Any] = json.loads(answer.body)
    return parsed


def request_body(action: str, args: Mapping[str, Any], *, request_id: str | None = None) -> bytes:
    """A well-formed request envelope, compact, as a client would freeze it."""
    return json.dumps(
        {"type": "broker_request", "protocolVersion": 1,
         "requestId": request_id or str(uuid.uuid4()), "actionVersion": 1,
         "action": action, "args": dict(args)},
        ensure_ascii=False, separators=(",", ":"),
    ).encode("utf-8")


@dataclass(frozen=True, slots=True)
class AgentState:
    """An agent imported into a state directory, with a bearer credential for it."""

    agent: str
    owner: str
    credential: str


async def setup_state(token: TokenConfig, state_dir: Path, channels: Sequence[str],
                      *, name: str = "agent") -> AgentState:
    """Import a fresh human-owned agent and issue it a credential (before the daemon runs)."""
    custody = await Custody.open(token, state_dir)
    try:
        owner = coincurve.PrivateKey().public_key_xonly.format().hex()
        secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
        record = await custody.import_agent(secret, owner=owner)
    finally:
        await custody.aclose()
    directory = AgentDirectory.open(state_dir)
    try:
        directory.enroll(record.pubkey, name)
    finally:
        directory.close()
    store = SessionStore.open(state_dir)
    try:
        _, credential = store.issue(agent=record.pubkey, channels=frozenset(channels),
                                    actions=frozenset(ALL_ACTIONS), ttl_seconds=None, uid=None,
                                    now=int(time.time()))
    finally:
        store.close()
    return AgentState(agent=record.pubkey, owner=owner, credential=credential)


def pending_event_ids(state_dir: Path, principal: str, request_id: str) -> list[str] | None:
    """The ids of the events in the ledger's pending record, read after the daemon died.

    None: no pending record was committed. The daemon is dead, so reading its WAL database
    from here is safe (one process owns a ledger file at a time).
    """
    from daemon.state.ledger import read_record

    row = read_record(state_dir / "ledger.db", principal, request_id)
    if row is None or row[1] is None:
        return None
    return [str(e["id"]) for e in json.loads(row[1])["events"]]


class Moment(enum.Enum):
    """Where, on the relay side, `KillingProxy` kills the daemon (for the armed EVENT)."""

    #: the daemon sent EVENT; the proxy kills it and never forwards the frame
    EVENT_UNSENT = "event_unsent"
    #: the relay stored the event and answered OK; the daemon is killed before it sees OK
    EVENT_STORED = "event_stored"
    #: the OK is delivered into the daemon's socket while it is stopped (SIGSTOP), then
    #: SIGKILL: the relay answered, the daemon never got to record the verdict
    OK_DELIVERED = "ok_delivered"


class KillingProxy:
    """A WebSocket proxy in front of a real relay that SIGKILLs the daemon at a `Moment`.

    It forwards every frame unchanged. Put it in front of a relay without NIP-42: the daemon
    signs AUTH for the URL it is configured with (the proxy's), and LocalRelay refuses an
    AUTH whose ``relay`` tag is not its own URL. `arm(pid, moment, index)` picks the index-th EVENT frame
    the daemon sends after arming; `fired` is set once the kill was sent. Deterministic:
    the kill happens at a frame boundary the proxy controls, never on a timer.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.url = ""
        self.fired = trio.Event()
        self._pid: int | None = None
        self._moment: Moment | None = None
        self._index = 0
        self._seen = 0
        self._target: str | None = None

    def arm(self, pid: int, moment: Moment, index: int = 0) -> None:
        self._pid, self._moment, self._index, self._seen = pid, moment, index, 0
        self._target = None
        self.fired = trio.Event()

    def _kill(self, sig: int = signal.SIGKILL) -> None:
        assert self._pid is not None
        try:
            os.kill(self._pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            self._moment = None
            self.fired.set()

    async def serve(self, port: int, *, task_status: trio.TaskStatus[Any]
                    = trio.TASK_STATUS_IGNORED) -> None:
        self.url = f"ws://127.0.0.1:{port}"
        await trio_websocket.serve_websocket(self._handle, "127.0.0.1", port, None,
                                             task_status=task_status)

    async def _handle(self, request: trio_websocket.WebSocketRequest) -> None:
        client = await request.accept()
        try:
            async with trio_websocket.open_websocket_url(self.upstream) as up:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump_up, client, up, nursery.cancel_scope)
                    nursery.start_soon(self._pump_down, up, client, nursery.cancel_scope)
        except (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed):
            pass
        finally:
            await trio.aclose_forcefully(client._stream)  # the daemon side ends with us

    async def _pump_up(self, client: Any, up: Any, scope: trio.CancelScope) -> None:
        try:
            while True:
                text = await client.get_message()
                frame = json.loads(text)
                if self._moment is not None and frame[0] == "EVENT":
                    if self._seen == self._index:
                        self._seen += 1
                        if self._moment is Moment.EVENT_UNSENT:
                            self._kill()
                            continue
                        self._target = str(frame[1]["id"])
                    else:
                        self._seen += 1
                await up.send_message(text)
        except trio_websocket.ConnectionClosed:
            scope.cancel()

    async def _pump_down(self, up: Any, client: Any, scope: trio.CancelScope) -> None:
        try:
            while True:
                text = await up.get_message()
                frame = json.loads(text)
                if (self._target is not None and frame[0] == "OK"
                        and frame[1] == self._target):
                    self._target = None
                    if self._moment is Moment.EVENT_STORED:
                        self._kill()
                        continue
                    if self._moment is Moment.OK_DELIVERED:
                        self._kill(signal.SIGSTOP)
                        await client.send_message(text)
                        self._kill()
                        continue
                await client.send_message(text)
        except trio_websocket.ConnectionClosed:
            scope.cancel()
