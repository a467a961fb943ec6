"""The blocking record lookup (a command's `agent list`, `status`, `keys backup`, `agent
create`, the probe) has one deadline per request, not a timeout per `recv`.

- `test_a_custodian_trickling_its_answer_is_cut_off_at_the_deadline`: a scripted custodian
  that answers `records_version` one byte at a time, each byte well inside the timeout,
  the whole answer well past it: the lookup raises CustodianUnavailable at the deadline
  (it is not retried: a custodian that does not answer in time would make the retry wait
  as long again), and the lock it held is free for the next lookup.

A fake custodian, not the real one: the real one never trickles (it is what a wedged or
hostile peer on the socket does). LOOKUP_TIMEOUT is shortened so the test takes a second.
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from buzzwire.nostr import UnsignedEvent

from custody.custodian import client as client_module
from custody.custodian import messages
from custody.custodian.client import CustodianClient, CustodianUnavailable

#: The shortened LOOKUP_TIMEOUT, and the pause before each byte of the answer (inside it).
DEADLINE = 0.5
PAUSE = 0.2
BODY = b'{"v":3,"ok":7}'


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory short enough for a unix socket path (pytest's tmp_path may not be)."""
    path = Path(tempfile.mkdtemp(prefix="bb-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _trickle(server: socket.socket, answered: list[int]) -> None:
    """Accept connections, read one request from each, answer it a byte per PAUSE."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return  # the test closed the listening socket
        with conn:
            try:
                length = struct.unpack(">I", conn.recv(4))[0]
                conn.recv(length)
                for byte in struct.pack(">I", len(BODY)) + BODY:
                    time.sleep(PAUSE)
                    conn.sendall(bytes([byte]))
                answered.append(1)
            except OSError:
                pass  # the client gave up and closed


def test_a_custodian_trickling_its_answer_is_cut_off_at_the_deadline(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "LOOKUP_TIMEOUT", DEADLINE)
    path = short_dir / "c.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    answered: list[int] = []
    thread = threading.Thread(target=_trickle, args=(server, answered), daemon=True)
    thread.start()
    client = CustodianClient(path)
    try:
        started = time.monotonic()
        with pytest.raises(CustodianUnavailable, match="in time"):
            client.ask_version()
        took = time.monotonic() - started
        # The whole answer would take 18 * PAUSE = 3.6 s; a retry would double the wait.
        assert DEADLINE <= took < DEADLINE + 2 * PAUSE, took
        assert client.connections == 1  # not retried
        assert answered == []
        # The lock is free: the next lookup is bounded the same way, not queued behind.
        started = time.monotonic()
        with pytest.raises(CustodianUnavailable):
            client.ask_version()
        assert time.monotonic() - started < DEADLINE + 2 * PAUSE
    finally:
        client.close()
        server.close()


def _drop_the_first(server: socket.socket, asked: list[str]) -> None:
    """Read one request per connection; close the first with no answer (a custodian that
    died after the request reached it), answer the others `"wss://r"`."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            try:
                header = conn.recv(4, socket.MSG_WAITALL)
                body = conn.recv(struct.unpack(">I", header)[0], socket.MSG_WAITALL)
                asked.append(json.loads(body)["op"])
                if len(asked) > 1:
                    conn.sendall(messages.reply_ok("wss://r"))
            except OSError:
                pass


def _serve(path: Path, asked: list[str]) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    threading.Thread(target=_drop_the_first, args=(server, asked), daemon=True).start()
    return server


async def test_a_lookup_row_whose_connection_breaks_after_delivery_is_asked_again(
        short_dir: Path) -> None:  # noqa: F811
    """`relay` (a LOOKUPS row, asked at the daemon's start) reached a custodian that died
    before answering: asked again on a fresh connection, since it changes nothing."""
    asked: list[str] = []
    server = _serve(short_dir / "c.sock", asked)
    client = CustodianClient(short_dir / "c.sock")
    try:
        await client.require_relay("wss://r")
    finally:
        server.close()
        await client.aclose()
    assert asked == ["relay", "relay"]


async def test_a_sign_whose_connection_breaks_after_delivery_is_not_asked_again(
        short_dir: Path) -> None:  # noqa: F811
    """A `sign` that reached the custodian may have been signed and logged: never sent a
    second time (a second signature, a second line, the bucket spent twice); the caller
    is told the custodian is not answering."""
    asked: list[str] = []
    server = _serve(short_dir / "c.sock", asked)
    client = CustodianClient(short_dir / "c.sock")
    agent = "a" * 64
    try:
        with pytest.raises(CustodianUnavailable):
            await client.sign_event(agent, UnsignedEvent(
                pubkey=agent, created_at=1_700_000_000, kind=9, tags=[("h", "c")],
                content="x"))
    finally:
        server.close()
        await client.aclose()
    assert asked == ["sign"]
