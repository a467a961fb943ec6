"""The import row's secret (messages.TAILS) is raw bytes after its frame, read into one
bytearray (`server._read_exactly`): the server zeroes it once the request is answered,
whatever the answer, and when the peer stops short or the read fails, so no copy of a
secret outlives its request in the custodian's heap.

In-process, no token: `server._exchange` reads from a fake peer that keeps every buffer it
was asked to fill, and answers with a real `server.Custodian` over a fake custody that
never zeroes what it is handed (the real one does: the server's wipe is the one checked).
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from pathlib import Path

import pytest
import trio

from custody import CustodyError, KeyRecord
from custody.custodian import messages, server
from custody.custodian.client import decode_reply, request

OWNER, HELD_OWNER = "cd" * 32, "ef" * 32
SECRET = b"ab" * 32  # 64 hex digits, the import's secret text


def _import(owner: str) -> bytes:
    return request("import", secret_bytes=len(SECRET), owner=owner, auth_tag=None)


class Peer:
    """The far end of one connection as `_exchange` uses it: `data` handed out through
    recv_into, then `end` (None: EOF, else raised); every buffer filled, and what was sent."""

    def __init__(self, data: bytes, end: OSError | None = None) -> None:
        self.socket = self  # `_read_exactly` reads stream.socket.recv_into
        self._data, self._end = data, end
        self.buffers: list[bytearray] = []
        self.sent = b""

    async def recv_into(self, view: memoryview) -> int:
        await trio.lowlevel.checkpoint()
        if not any(buf is view.obj for buf in self.buffers):
            self.buffers.append(view.obj)  # type: ignore[arg-type]
        if not self._data:
            if self._end is not None:
                raise self._end
            return 0
        n = min(len(view), len(self._data))
        view[:n], self._data = self._data[:n], self._data[n:]
        return n

    async def send_all(self, data: bytes) -> None:
        self.sent += data


class Custody:
    """What `Custodian.import_` asks of custody: HELD_OWNER is an agent held here; an
    import either returns a record or fails (`fails`). Notes whether it saw the secret."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.saw_secret = False

    def agent(self, pubkey: str, include_deleted: bool = False) -> KeyRecord | None:
        if pubkey != HELD_OWNER:
            return None
        return KeyRecord(pubkey=pubkey, owner=OWNER, auth_tag=None, created_at=1, deleted_at=None)

    def room(self) -> None:
        """The record bound (`Custody.room`): none held here, so room for one more."""

    async def import_agent(self, secret: bytearray, **_: object) -> KeyRecord:
        self.saw_secret = secret == SECRET
        if self.fails:
            raise CustodyError("the token is gone")
        return KeyRecord(pubkey="12" * 32, owner=OWNER, auth_tag=None, created_at=1,
                         deleted_at=None)


def _custodian(custody: Custody, tmp_path: Path) -> server.Custodian:
    return server.Custodian(custody, server.Settings(  # type: ignore[arg-type]
        socket=tmp_path / "unused.sock", pipeline_uid=0, relay_url="wss://r.example",
        log_path=tmp_path / "log" / "signed.jsonl"))


async def _exchange(custodian: server.Custodian, peer: Peer) -> bool:
    header = await server._read_exactly(peer, messages.HEADER.size)  # type: ignore[arg-type]
    assert header is not None
    return await server._exchange(custodian, peer, header)  # type: ignore[arg-type]


#: owner, custody fails, whether custody is handed the secret, the answer's code (None: ok)
ANSWERS: Mapping[str, tuple[str, bool, bool, str | None]] = {
    "imported": (OWNER, False, True, None),
    "custody's fault": (OWNER, True, True, "custody"),
    "refused before custody": (HELD_OWNER, False, False, "refused"),
}


@pytest.mark.parametrize("case", ANSWERS)
async def test_the_tail_is_zeroed_once_answered_whatever_the_answer(
        case: str, tmp_path: Path) -> None:
    owner, fails, handed, code = ANSWERS[case]
    custody = Custody(fails)
    custodian = _custodian(custody, tmp_path)
    peer = Peer(_import(owner) + SECRET)
    assert await _exchange(custodian, peer) is True
    custodian.log.close()
    ok, value = decode_reply(peer.sent[messages.HEADER.size:])
    assert (None if ok else value[0]) == code, value  # type: ignore[index]
    assert custody.saw_secret is handed
    tail = peer.buffers[-1]
    assert len(tail) == len(SECRET) and tail == bytes(len(SECRET))


#: how the read of the tail ends before its last byte: EOF, or an error raised to the caller
CUT_SHORT: Mapping[str, OSError | None] = {
    "the peer stops short": None,
    "the read fails": ConnectionResetError(errno.ECONNRESET, "reset"),
}


@pytest.mark.parametrize("case", CUT_SHORT)
async def test_a_tail_cut_short_is_zeroed_and_never_answered(case: str, tmp_path: Path) -> None:
    end = CUT_SHORT[case]
    custody = Custody(fails=False)
    custodian = _custodian(custody, tmp_path)
    peer = Peer(_import(OWNER) + SECRET[:40], end)
    if end is None:
        assert await _exchange(custodian, peer) is False
    else:
        with pytest.raises(OSError):
            await _exchange(custodian, peer)
    custodian.log.close()
    assert peer.sent == b"" and not custody.saw_secret
    tail = peer.buffers[-1]
    assert len(tail) == len(SECRET) and tail == bytes(len(SECRET))
