"""Frames a compromised pipeline writes itself, sent straight over the custodian's socket
(a real custodian, its own process): what the table refuses at parse is `bad_message`, with
nothing signed, stored, logged or spent.

- A string holding a lone surrogate: JSON can spell one (`"\\ud800"`), but it is no text and
  has no UTF-8 form, so the event id, the signed log and every answer would fail on it
  later. The pipeline's own client cannot send one: its encoder refuses it first, as
  in-process custody does (ValueError).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from custody import TokenConfig
from custody.custodian import messages
from custody.custodian.client import CustodianClient
from tests.custodian.test_refusals import _answer, held, human, intent
from tests.fixtures.custodian import CustodianProcess, running_custodian

PER_MINUTE = 2
LONE = "\ud800"


@pytest.fixture
def bounded(custody_state: tuple[TokenConfig, Path], local_relay: str,
            tmp_path: Path) -> Iterator[CustodianProcess]:
    with running_custodian(custody_state, local_relay, tmp_path,
                           signatures_per_minute=PER_MINUTE) as process:
        yield process


def send_raw(path: Path, body: bytes) -> tuple[bool, object]:
    """One frame of `body` as it is (a pipeline writing its own bytes), its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(messages.HEADER.pack(len(body)) + body)
        return _answer(sock)


def spelled(op: str, args: dict[str, object]) -> bytes:
    # json.dumps writes a lone surrogate as its escape, "\ud800": ASCII, valid JSON
    return json.dumps({"v": messages.VERSION, "op": op, "args": args}).encode("ascii")


async def test_a_lone_surrogate_in_any_string_is_bad_message_and_changes_nothing(
        bounded: CustodianProcess, local_relay: str) -> None:
    client = await CustodianClient.open(bounded.socket)
    owner = human()
    agent = await held(client, owner)
    log = bounded.config.parent / "state" / "custodian" / "signed.jsonl"
    lines, version = log.read_text(), client.records_version()
    asks = {
        "sign content": ("sign", {"events": [intent(agent, 9, [["h", "c"]], "hi" + LONE)]}),
        "sign tag": ("sign", {"events": [intent(agent, 9, [["h", LONE]], "hi")]}),
        "sign tag name": ("sign", {"events": [intent(agent, 9, [[LONE, "x"]], "hi")]}),
        "profile": ("sign", {"events": [intent(agent, 0, [], '{"name":"' + LONE + '"}')]}),
        "mint_ref": ("mint", {"owner": owner, "mint_ref": "ref" + LONE}),
        "challenge": ("sign_auth", {"agent": agent, "relay_url": local_relay,
                                    "challenge": LONE, "created_at": 1_700_000_000}),
        "slug": ("memory_address", {"agent": agent, "slug": "mem/" + LONE}),
        "payload": ("decrypt", {"agent": agent, "peer": owner, "payloads": [LONE]}),
        "auth tag": ("attach_auth", {"pubkey": agent, "tag": ["auth", owner, LONE, "00"]}),
        "name": ("backup", {"names": [{"pubkey": agent, "name": LONE, "creator": None}]}),
    }
    for what, (op, args) in asks.items():
        ok, value = send_raw(bounded.socket, spelled(op, args))
        assert not ok and isinstance(value, tuple) and value[0] == "bad_message", (what, value)
        assert "surrogate" in value[1], what
    # nothing signed, stored or logged; the agent's bucket unspent (2 a minute: both sign),
    # and a pair of surrogate escapes (one astral character) is text, and signs
    assert log.read_text() == lines
    assert client.records_version() == version
    ok, signed = send_raw(bounded.socket, spelled("sign", {"events": [
        intent(agent, 9, [["h", "c"]], "one"), intent(agent, 9, [["h", "c"]], "\U0001f600")]}))
    assert ok and isinstance(signed, list) and signed[1]["content"] == "\U0001f600"
    await client.aclose()


async def test_the_pipelines_own_client_cannot_send_a_lone_surrogate(
        bounded: CustodianProcess, local_relay: str) -> None:
    client = await CustodianClient.open(bounded.socket)
    agent = await held(client, human())
    log = bounded.config.parent / "state" / "custodian" / "signed.jsonl"
    lines = log.read_text()
    with pytest.raises(ValueError):
        await client.sign_auth(agent, local_relay, LONE, 1_700_000_000)
    assert log.read_text() == lines
    event = await client.sign_auth(agent, local_relay, "\U0001f600", 1_700_000_000)
    assert event.kind == 22242
    await client.aclose()
