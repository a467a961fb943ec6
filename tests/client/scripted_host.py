"""A scripted broker host for the client tests: anyio + h11 on a Unix socket (or loopback TCP).

It runs on whichever event loop the test runs on (asyncio or trio), beside the client.

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

import anyio
import anyio.abc
import coincurve
import h11


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

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_unix_listener(self.path)
        task_status.started()
        await listener.serve(self._handle)

    async def serve_tcp(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """The same host on 127.0.0.1; started() reports the port."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
        await listener.serve(self._handle)

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER)
            head: h11.Request | None = None
            chunks: list[bytes] = []
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = await stream.receive(65536)
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
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
                await anyio.sleep_forever()
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
            try:
                if answer.dribble:
                    for i in range(len(out)):
                        await stream.send(out[i : i + 1])
                else:
                    await stream.send(out)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the client gave up on this attempt (a timeout): not the host's fault


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
