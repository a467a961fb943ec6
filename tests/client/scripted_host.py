"""A scripted broker host for the client tests: trio + h11 on a Unix socket.

It records every request it receives (method, target, headers, body bytes, exactly as
they arrived) and answers each one with the next step of its script, or with its
default step once the script is spent. A step is a function of the received body that
returns an `HttpAnswer`, `DROP` (close the connection without answering) or `STALL`
(never answer). This is how the tests make a host answer each wrong thing the spec
names — another requestId, a forbidden status/code pair, a proxy's 401 — and then
assert on the bytes each retry actually put on the wire.

Helpers build envelopes as raw JSON on purpose: a wrong envelope must be expressible,
and the contract's own encoder would refuse to write one. Events are signed here with
coincurve directly (NIP-01 id, BIP-340), independently of the code under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import coincurve
import h11
import trio


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes
    #: send the response one byte per write (the client must reassemble it)
    dribble: bool = False
    #: frame the body with chunked transfer-encoding instead of Content-Length
    chunked: bool = False


@dataclass(frozen=True)
class Received:
    method: bytes
    target: bytes
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> dict[str, Any]:
        value = json.loads(self.body)
        assert isinstance(value, dict)
        return value


DROP = object()
STALL = object()

Step = Callable[[Received], object]


@dataclass
class ScriptedHost:
    path: str
    script: list[Step] = field(default_factory=list)
    default: Step | None = None
    received: list[Received] = field(default_factory=list)
    answered: list[bytes] = field(default_factory=list)

    @property
    def bodies(self) -> list[bytes]:
        return [r.body for r in self.received]

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(self.path)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self._handle, [listener])

    async def serve_tcp(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """The same host on 127.0.0.1; started() reports the port."""
        [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listener.socket.getsockname()[1])
        await trio.serve_listeners(self._handle, [listener])

    async def _handle(self, stream: trio.abc.Stream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER)
            head: h11.Request | None = None
            chunks: list[bytes] = []
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(bytes(data))
                elif isinstance(event, h11.Request):
                    head = event
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return
            assert head is not None
            got = Received(
                method=head.method,
                target=head.target,
                headers={bytes(k).lower(): bytes(v) for k, v in head.headers},
                body=b"".join(chunks),
            )
            self.received.append(got)
            step = self.script.pop(0) if self.script else self.default
            assert step is not None, "the scripted host ran out of script"
            answer = step(got)
            if answer is DROP:
                return
            if answer is STALL:
                await trio.sleep_forever()
            assert isinstance(answer, HttpAnswer)
            self.answered.append(answer.body)
            framing = (("Transfer-Encoding", "chunked") if answer.chunked
                       else ("Content-Length", str(len(answer.body))))
            out = conn.send(
                h11.Response(
                    status_code=answer.status,
                    headers=[("Content-Type", "application/json"), framing, ("Connection", "close")],
                )
            ) or b""
            if answer.chunked:
                half = len(answer.body) // 2
                for piece in (answer.body[:half], answer.body[half:]):
                    out += conn.send(h11.Data(data=piece)) or b""
            else:
                out += conn.send(h11.Data(data=answer.body)) or b""
            out += conn.send(h11.EndOfMessage()) or b""
            if answer.dribble:
                for i in range(len(out)):
                    await stream.send_all(out[i : i + 1])
            else:
                await stream.send_all(out)


def socket_dir() -> str:
    # Not pytest's tmp_path: AF_UNIX paths are limited to 108 bytes and test names are long.
    return tempfile.mkdtemp(prefix="bbc-", dir="/tmp")


# ----------------------------------------------------------------- envelope builders


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def succeeded(action: str | None, outcome: object, *, replayed: bool = False,
              status: int = 200, **extra: object) -> Step:
    """A succeeded envelope echoing the received requestId (and action unless given)."""

    def step(got: Received) -> HttpAnswer:
        req = got.json()
        env: dict[str, object] = {
            "type": "broker_result", "protocolVersion": 1, "requestId": req["requestId"],
            "status": "succeeded", "action": action if action is not None else req["action"],
            "outcome": outcome,
        }
        if replayed:
            env["replayed"] = True
        env.update(extra)
        return HttpAnswer(status, dumps(env))

    return step


def errored(status_word: str, code: str, message: str = "scripted", *, status: int = 200,
            request_id: str | None = None, **extra: object) -> Step:
    def step(got: Received) -> HttpAnswer:
        env: dict[str, object] = {
            "type": "broker_result", "protocolVersion": 1,
            "requestId": request_id if request_id is not None else got.json()["requestId"],
            "status": status_word, "error": {"code": code, "message": message},
        }
        env.update(extra)
        return HttpAnswer(status, dumps(env))

    return step


def raw(status: int, body: bytes) -> Step:
    return lambda got: HttpAnswer(status, body)


def drop() -> Step:
    return lambda got: DROP


def stall() -> Step:
    return lambda got: STALL


# ----------------------------------------------------------------- signed events


class Signer:
    """A throwaway key for building valid events (tests only)."""

    def __init__(self) -> None:
        self._key = coincurve.PrivateKey(secrets.token_bytes(32))
        self.pubkey = self._key.public_key_xonly.format().hex()

    def event(self, *, content: str, tags: Sequence[Sequence[str]], kind: int = 9,
              created_at: int = 1_787_675_388) -> dict[str, object]:
        tag_list = [list(t) for t in tags]
        serial = json.dumps([0, self.pubkey, created_at, kind, tag_list, content],
                            separators=(",", ":"), ensure_ascii=False)
        event_id = hashlib.sha256(serial.encode("utf-8")).digest()
        sig = self._key.sign_schnorr(event_id, os.urandom(32))
        return {"id": event_id.hex(), "pubkey": self.pubkey, "created_at": created_at,
                "kind": kind, "tags": tag_list, "content": content, "sig": sig.hex()}


def publish_outcome(kind: int = 9) -> dict[str, object]:
    return {"eventId": secrets.token_hex(32), "kind": kind, "createdAt": 1_787_675_471}
