"""Frames a compromised pipeline writes itself, sent straight over the custodian's socket
(a real custodian, its own process): what the table refuses at parse is `bad_message`, with
nothing signed, stored, logged or spent.

- A string holding a lone surrogate: JSON can spell one (`"\\ud800"`), but it is no text and
  has no UTF-8 form, so the event id, the signed log and every answer would fail on it
  later. The pipeline's own client cannot send one: its encoder refuses it first, as
  in-process custody does (ValueError).
- A refusal is one short line: a tag name it names is cut, not echoed whole.
- Each bound of the table on one request (events, tags, values in a tag, content, the AUTH
  strings), a duplicate member and `true` where an integer belongs, one past: `bad_message`.
- Memory: bounded by the in-flight budget, the values bound and one `agents` answer at a
  time, not by connections (peak RSS, VmHWM, reset before each part); a `chain` answer
  by MAX_CHAIN, even over a cycle of owners.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from custody import TokenConfig
from custody.custodian import messages
from custody.custodian.client import CustodianClient, decode_reply, request
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
    asks: dict[str, tuple[str, dict[str, object]]] = {
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


async def test_one_past_each_bound_of_the_table_is_bad_message_and_changes_nothing(
        bounded: CustodianProcess, local_relay: str) -> None:
    """What the table bounds a request by, each one past its bound, is refused at parse:
    nothing signed, stored, logged or spent, where without the bound a frame would be signed,
    rate-limited, or refused only later by `intents`. Each is next to the frame at its bound,
    which parses."""
    client = await CustodianClient.open(bounded.socket)
    agent = await held(client, human())
    log = bounded.config.parent / "state" / "custodian" / "signed.jsonl"
    lines, version = log.read_text(), client.records_version()
    post = intent(agent, 9, [["h", "c"]], "hi")

    def sign(**changes: object) -> bytes:
        return spelled("sign", {"events": [{**post, **changes}]})

    def auth(**changes: object) -> bytes:
        return spelled("sign_auth", {"agent": agent, "relay_url": local_relay, "challenge": "c",
                                     "created_at": 1_700_000_000, **changes})

    def twice(body: bytes, member: str, first: str) -> bytes:
        """`body` with `member` spelled twice, `first` the one before its own value."""
        key = f'"{member}": '
        return body.replace(key.encode(), f"{key}{first}, {key}".encode(), 1)

    values = messages.MAX_TAG_VALUES
    #: what: (the frame at the bound, the frame one past it)
    frames: dict[str, tuple[bytes, bytes]] = {
        "MAX_EVENTS": (spelled("sign", {"events": [post] * messages.MAX_EVENTS}),
                       spelled("sign", {"events": [post] * (messages.MAX_EVENTS + 1)})),
        "MAX_TAGS": (sign(tags=[["h", "c"]] * messages.MAX_TAGS),
                     sign(tags=[["h", "c"]] * (messages.MAX_TAGS + 1))),
        "MAX_TAG_VALUES": (sign(tags=[["h"] + ["c"] * (values - 1)]),
                           sign(tags=[["h"] + ["c"] * values])),
        "a tag holds its name": (sign(tags=[["h"]]), sign(tags=[[]])),
        "MAX_CONTENT": (sign(content="x" * messages.MAX_CONTENT),
                        sign(content="x" * (messages.MAX_CONTENT + 1))),
        # the sign_auth row's own bounds (messages.OPS)
        "relay_url": (auth(relay_url="r" * 2048), auth(relay_url="r" * 2049)),
        "challenge": (auth(challenge="c" * 1024), auth(challenge="c" * 1025)),
        "true is no integer": (auth(created_at=1), auth(created_at=True)),
        "true is no kind": (sign(kind=1), sign(kind=True)),
        "a member twice (frame)": (spelled("records_version", {}),
                                   twice(spelled("records_version", {}), "op", '"agents"')),
        "a member twice (args)": (auth(), twice(auth(), "agent", json.dumps(human()))),
        "a member twice (intent)": (sign(), twice(sign(), "signer", json.dumps(human()))),
    }
    for what, (fits, breaks) in frames.items():
        messages.decode_request(fits)
        ok, value = send_raw(bounded.socket, breaks)
        assert not ok and isinstance(value, tuple) and value[0] == "bad_message", (what, value)
    assert log.read_text() == lines
    assert client.records_version() == version
    ok, signed = send_raw(bounded.socket, spelled("sign", {"events": [post] * PER_MINUTE}))
    assert ok and isinstance(signed, list) and len(signed) == PER_MINUTE
    await client.aclose()


async def test_a_refusal_is_one_short_line_whatever_the_tag_name(
        bounded: CustodianProcess) -> None:
    """A tag name outside the shape is named in the refusal, cut to its first 64 characters:
    a 1 MiB name was answered, and written to the custodian's stderr, whole."""
    client = await CustodianClient.open(bounded.socket)
    agent = await held(client, human())
    logged = bounded.stderr.stat().st_size
    ok, value = send_raw(bounded.socket, spelled("sign", {"events": [
        intent(agent, 9, [["h", "c"], ["x" * 1_000_000, "y"]], "hi")]}))
    assert not ok and isinstance(value, tuple) and value[0] == "refused"
    assert value[1] == f"kind 9 carries no {'x' * 64!r} tag"
    assert bounded.stderr.stat().st_size - logged < 1024
    await client.aclose()


def peak_rss(process: CustodianProcess, *, reset: bool = False) -> int:
    """The custodian's peak resident memory since the last reset, in bytes (VmHWM);
    `reset`: start a new peak from what it holds now (clear_refs 5)."""
    assert process.proc is not None
    proc = Path(f"/proc/{process.proc.pid}")
    if reset:
        (proc / "clear_refs").write_text("5")
    return next(int(line.split()[1]) * 1024 for line in (proc / "status").read_text().splitlines()
                if line.startswith("VmHWM:"))


def in_threads(path: Path, bodies: list[bytes], read: bool = True) -> list[socket.socket]:
    """Each body as one frame on its own connection, all at once; their answers read
    (`read`), else the connections returned open, their answers unread."""
    socks = []
    for _ in bodies:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(120)
        sock.connect(str(path))
        socks.append(sock)
    answers: list[tuple[bool, object] | None] = [None] * len(bodies)

    def one(i: int) -> None:
        socks[i].sendall(messages.HEADER.pack(len(bodies[i])) + bodies[i])
        if read:
            answers[i] = _answer(socks[i])
            socks[i].close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not read or all(a is not None and a[0] for a in answers), answers
    return socks


async def test_memory_is_bounded_by_the_in_flight_budget_not_by_connections(
        bounded: CustodianProcess) -> None:
    """64 connections at 24 MiB each held 1.5 GiB of frames, a frame's parse up to 25 times
    its size, and unread `agents` answers one frame each: now at most `max_inflight_bytes`
    (default 32 MiB) of frames at once, each parsed within a bound of values, one `agents`
    answer at a time."""
    client = await CustodianClient.open(bounded.socket)
    owner = human()
    agent = await held(client, owner)
    # 32 `agents` answers of 400 records at their largest, first (a fresh heap) (a 512-character mint_ref JSON
    # writes six-fold: 3.2 KB a record), none read
    for i in range(400):  # a mint_ref names one mint: each its own
        await client.mint_agent(owner=owner, mint_ref=f"{i:03}" + "\x00" * 509)
    size = len(messages.reply_ok(ask_records(bounded.socket)))
    before = peak_rss(bounded, reset=True)
    unread = in_threads(bounded.socket, [spelled("agents", {"include_deleted": True})] * 32,
                        read=False)
    assert send_raw(bounded.socket, spelled("records_version", {}))[0]  # answered beside them
    listed = peak_rss(bounded) - before
    for sock in unread:
        sock.close()
    # 16 frames of a full MAX_FRAME each (256 NIP-44 payloads, none opens: answered [null...])
    payload = "A" * ((messages.MAX_FRAME - 1024) // messages.MAX_PAYLOADS - 8)
    body = spelled("decrypt", {"agent": agent, "peer": owner,
                               "payloads": [payload] * messages.MAX_PAYLOADS})
    assert messages.MAX_FRAME - 4096 < len(body) <= messages.MAX_FRAME
    before = peak_rss(bounded, reset=True)
    in_threads(bounded.socket, [body] * 16)
    frames = peak_rss(bounded) - before
    # one frame of 8 million empty objects (3 bytes of frame each, 72 parsed)
    n = (messages.MAX_FRAME - 100) // 3
    flood = b'{"v":3,"op":"sign","args":{"events":[' + b"{}," * n + b'{}]}}'
    before = peak_rss(bounded, reset=True)
    answer = send_raw(bounded.socket, flood)
    flooded = peak_rss(bounded) - before
    print(f"16 frames of {len(body) >> 20} MiB at once: peak RSS +{frames >> 20} MiB; "
          f"{len(flood) >> 20} MiB of empty objects: +{flooded >> 20} MiB; 32 unread answers "
          f"of {size >> 10} KiB: +{listed >> 20} MiB")
    assert frames < 4 * messages.MAX_FRAME
    assert flooded < 4 * messages.MAX_FRAME
    assert listed < 4 * size
    assert answer == (False, ("bad_message", f"more than {messages.MAX_VALUES} values in one frame"))
    await client.aclose()


def ask_records(path: Path) -> list[object]:
    ok, records = send_raw(path, spelled("agents", {"include_deleted": True}))
    assert ok and isinstance(records, list)
    return records


async def test_a_peer_that_closes_with_its_answer_unread_ends_only_its_connection(
        bounded: CustodianProcess) -> None:
    """On Linux a Unix socket closed with unread data in its receive queue resets the
    other end: the custodian's next read of that connection fails with ECONNRESET, an
    OSError, not trio's stream error. The honest client does this too (a request cut by
    its deadline), and it ended the whole process."""
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(bounded.socket))
            sock.sendall(request("records_version"))
            # The answer arrives and stays unread; the close then resets the custodian's end.
            sock.settimeout(30)
            assert sock.recv(1, socket.MSG_PEEK)
    ok, _ = send_raw(bounded.socket, request("records_version")[messages.HEADER.size:])
    assert ok and bounded.proc is not None and bounded.proc.poll() is None
    assert "Traceback" not in bounded.stderr.read_text()


async def test_the_chain_answer_is_bounded_even_over_a_cycle(tmp_path: Path) -> None:
    """`chain` walks from an agent to its owner's record and on. Records can form a cycle
    (two keys imported each under the other, the second with the first's own NIP-OA tag):
    the walk stops at MAX_CHAIN records, one bounded answer. In-process, over records that
    are a cycle of two."""
    import os

    from custody import KeyRecord
    from custody.custodian.server import MAX_CHAIN, Custodian, Settings

    a, b = human(), human()
    records = {key: KeyRecord(pubkey=key, owner=owner, auth_tag=None, created_at=1,
                              deleted_at=None) for key, owner in ((a, b), (b, a))}

    class Cycle:
        lookups = 0

        def agent(self, pubkey: str, include_deleted: bool = False) -> KeyRecord | None:
            self.lookups += 1
            assert self.lookups <= 2 * MAX_CHAIN, "the walk has no end"
            return records.get(pubkey)

    custodian = Custodian(Cycle(), Settings(  # type: ignore[arg-type]
        socket=tmp_path / "unused.sock", pipeline_uid=os.getuid(), relay_url="wss://r.example",
        log_path=tmp_path / "log" / "signed.jsonl"))
    frame = await custodian.answer(messages.Request("chain", {"pubkey": a}))
    custodian.log.close()
    ok, chain = decode_reply(frame[messages.HEADER.size:])
    assert ok and isinstance(chain, list)
    assert [record["pubkey"] for record in chain] == [a, b] * (MAX_CHAIN // 2)

