"""A custodian answer holding a lone surrogate (JSON spells one, "\\ud800"; it has no UTF-8
form) is a broken table to the pipeline's client, said at once as CustodianUnavailable,
never a value handed on to fail later, as a UnicodeEncodeError when the daemon writes it
to an agent. The peer is a small server answering every request with one fixed body: a
custodian of this build never sends one (its encoder writes UTF-8)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from custody.custodian import messages
from custody.custodian.client import CustodianClient, CustodianUnavailable

PK = "ab" * 32
RECORD = ('{"pubkey":"%s","owner":"%s","auth_tag":null,"created_at":1,"deleted_at":null,'
          '"mint_ref":"ref@"}' % (PK, PK))


@contextmanager
def _peer(path: Path, body: bytes) -> Iterator[None]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                peer, _ = server.accept()
            except TimeoutError:
                continue
            with peer:
                peer.settimeout(5)
                header = peer.recv(messages.HEADER.size, socket.MSG_WAITALL)
                if len(header) == messages.HEADER.size:
                    peer.recv(messages.frame_length(header), socket.MSG_WAITALL)
                    peer.sendall(messages.HEADER.pack(len(body)) + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        server.close()


@pytest.fixture
def answering(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    path = tmp_path / "custodian.sock"
    with _peer(path, request.param):
        yield path


def _agents(escaped: str) -> bytes:
    return b'{"v":%d,"ok":[%s]}' % (messages.VERSION, RECORD.replace("@", escaped).encode())


@pytest.mark.parametrize("answering", [_agents("\\ud800"), _agents("\\udfff")],
                         indirect=True, ids=["high", "low"])
def test_a_lone_surrogate_in_an_answer_is_a_broken_table(answering: Path) -> None:
    client = CustodianClient(answering)
    try:
        with pytest.raises(CustodianUnavailable, match="broke the table"):
            client.lookup("agents", include_deleted=False)
    finally:
        client.close()


@pytest.mark.parametrize("answering", [_agents("\\ud83d\\ude00")], indirect=True, ids=["pair"])
def test_a_surrogate_pair_in_an_answer_is_text(answering: Path) -> None:
    client = CustodianClient(answering)
    try:
        (record,) = client.lookup("agents", include_deleted=False)  # type: ignore[misc]
    finally:
        client.close()
    assert record["mint_ref"] == "ref\U0001f600"
