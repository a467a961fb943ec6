"""Fuzzing the HTTP layer over the real socket: the whole daemon (`broker` fixture) under abuse.

Invariant: whatever bytes a client writes, the daemon never answers 500 and never dies;
every answer is either HTTP 200 with an envelope `parse_response` accepts whose requestId
is the one the body carried, or a 4xx (505 for an HTTP version other than 1.0 and 1.1)
without an envelope; each exchange ends, with the
daemon closing the connection, within a bounded time; after each abuse a well-formed
request is still answered; and the process's resident memory does not grow beyond a
generous bound over the whole run.

Inputs: a table of header abuse (two Authorization headers, no Content-Length, chunked
bodies good, bad and oversized, pipelined requests, bytes after the body, garbage request
lines, huge and many headers, conflicting lengths, Expect: 100-continue, HTTP/1.0), then
hypothesis-generated bodies (random bytes, random JSON, mutated envelopes of the nine
actions) sent with a valid credential, so they reach the ledger, validation and execution.

Every exchange is read until the daemon closes the connection (each one ends in
``Connection: close``, an error the daemon closes on, HTTP/1.0, or the client's EOF), never
until a quiet spell: on a loaded machine the daemon, which runs in this process, can be
paused longer than any such spell, and a pause would read as "no answer".
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buzzwire.contract import ACTIONS, ErrorCode, parse_response, read_request
from tests.adversarial import scaled, tally
from tests.adversarial.test_fuzz_contract import all_mutations_of, json_values, mutate
from tests.contract.vectors import dump
from tests.contract.vectors import envelope as _shared_envelope
from tests.fixtures.broker import BrokerHarness, request_body

#: Seconds one exchange may take. The daemon answers in milliseconds; a hang shows as this.
EXCHANGE_SECONDS = 8.0
#: Resident memory the whole fuzz run may add to the test process (daemon included): far
#: above what buffers and caches need, far below what a leak per request would cost.
MAX_RSS_GROWTH_BYTES = 96 * 1024 * 1024

EXAMPLES = scaled(200, 3000)


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


Answer = tuple[int, dict[str, bytes], bytes]


def parse_answers(data: bytes) -> list[Answer]:
    """Split what the server wrote into (status, headers, body) answers (100s included)."""
    answers: list[Answer] = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"an answer's head is cut: {data[:80]!r}"
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower().decode()] = value.strip()
        length = int(headers.get("content-length", b"0"))
        assert len(rest) >= length, f"an answer's body is cut: {head[:80]!r}"
        answers.append((status, headers, rest[:length]))
        data = rest[length:]
    return answers


async def exchange(broker: BrokerHarness, raw: bytes, *, close_write: bool = False) -> list[Answer]:
    """Write `raw`, read until the server closes the connection, parse its answers.

    The only bound is EXCHANGE_SECONDS: a daemon that neither answers nor closes fails
    the test with TooSlowError (module docstring: why no quiet spell ends a read).
    """
    received = bytearray()
    with trio.fail_after(EXCHANGE_SECONDS):
        stream = await trio.open_unix_socket(str(broker.socket))
        async with stream:
            try:
                await stream.send_all(raw)
                if close_write:
                    await stream.send_eof()
            except trio.BrokenResourceError:
                pass  # the server may close early (413, 431): what it wrote still counts
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break  # closed with our unread bytes in its buffer (ECONNRESET): closed
                if not chunk:
                    break
                received += chunk
    return parse_answers(bytes(received))


def check_answer(answer: Answer, sent_body: bytes | None) -> None:
    """The per-answer invariant: no 500; 200 = correlated envelope; a transport refusal
    (4xx, or 505 for an HTTP version not served) = no envelope."""
    status, _headers, body = answer
    assert status != 500, "HTTP 500"
    if status == 100:
        return
    if status == 200:
        response = parse_response(body)
        if sent_body is not None:
            reading = read_request(sent_body)
            assert reading.request_id is not None
            assert response.request_id == reading.request_id
        return
    assert 400 <= status < 500 or status == 505, status
    assert body == b"", f"a {status} carries a body"


def http_request(body: bytes, *, credential: str | None, extra: str = "",
                 length: bool = True, target: str = "/v1/action", method: str = "POST") -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n"
    if length:
        head += f"Content-Length: {len(body)}\r\n"
    if credential is not None:
        head += f"Authorization: Bearer {credential}\r\n"
    return (head + extra + "\r\n").encode("latin-1") + body


def chunked(body: bytes, size: int = 7) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
             for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


async def still_serving(broker: BrokerHarness, credential: str, channel: str) -> None:
    body = request_body("channel.read", {"channelId": channel, "limit": 1})
    answers = await exchange(broker, http_request(body, credential=credential,
                                                  extra="Connection: close\r\n"))
    assert [a[0] for a in answers] == [200]
    assert parse_response(answers[0][2]).status.value == "succeeded"


async def _setup(broker: BrokerHarness) -> tuple[str, str]:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent("fuzzed")
    return broker.credential(agent, [channel]), channel


async def test_header_abuse_table(broker: BrokerHarness) -> None:
    cred, channel = await _setup(broker)
    body = request_body("channel.read", {"channelId": channel})
    body2 = request_body("channel.read", {"channelId": channel})
    body3 = request_body("storage.address", {"slug": "s"})
    sent_ids = {json.loads(b)["requestId"] for b in (body, body2, body3)}
    close = "Connection: close\r\n"
    big = broker.config.server.max_body_bytes
    # (name, bytes, close_write, the statuses expected in order)
    cases: list[tuple[str, bytes, bool, list[int]]] = [
        ("two Authorization headers",
         http_request(body, credential=cred, extra=f"Authorization: Bearer {cred}\r\n{close}"),
         False, [200]),
        ("no Content-Length (an empty body: nothing to correlate)",
         http_request(body, credential=cred, length=False, extra=close), False, [400]),
        ("chunked body", http_request(b"", credential=cred, length=False,
                                      extra=f"Transfer-Encoding: chunked\r\n{close}")
         + chunked(body), False, [200]),
        ("chunked body over the limit", http_request(b"", credential=cred, length=False,
                                                     extra="Transfer-Encoding: chunked\r\n")
         + chunked(b"x" * (big + 10), 65536), False, [413]),
        ("chunk size that is not hex", http_request(b"", credential=cred, length=False,
                                                    extra="Transfer-Encoding: chunked\r\n")
         + b"zz\r\nabc\r\n0\r\n\r\n", False, [400]),
        ("pipelined three", http_request(body, credential=cred)
         + http_request(body2, credential=cred)
         + http_request(body3, credential=cred, extra=close), False, [200, 200, 200]),
        ("a bad line after the body", http_request(body, credential=cred) + b"GARBAGE\x00\xff\r\n\r\n",
         False, [200, 400]),
        # A truncated next request from a client that hung up has nobody to answer.
        ("bytes after the body, then EOF", http_request(body, credential=cred) + b"GARB",
         True, [200]),
        ("garbage request line", b"GARBAGE\r\n\r\n", False, [400]),
        ("binary noise", bytes(range(256)) * 4, True, [400]),
        # Only 1.0 and 1.1 are served: another version is 505 and the connection closed.
        ("HTTP/9.9", b"POST /v1/action HTTP/9.9\r\nHost: b\r\n\r\n", False, [505]),
        ("HTTP/2.0 with a body", http_request(body, credential=cred).replace(
            b"HTTP/1.1", b"HTTP/2.0", 1), False, [505]),
        ("no Host in HTTP/1.1", b"POST /v1/action HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
         False, [400]),
        ("huge header", http_request(body, credential=cred, extra="X-Big: " + "a" * 40000 + "\r\n"),
         False, [431]),
        ("many headers", http_request(body, credential=cred,
                                      extra="".join(f"X-{i}: {i}\r\n" for i in range(3000))),
         False, [431]),
        ("Authorization of 100 KiB", http_request(body, credential="A" * 100_000), False, [431]),
        ("two different Content-Lengths", http_request(body, credential=cred,
                                                       extra="Content-Length: 3\r\n"), False, [400]),
        ("negative Content-Length", http_request(body, credential=cred, length=False,
                                                 extra="Content-Length: -1\r\n"), False, [400]),
        # RFC 9112 6.3: chunked wins over Content-Length, so the JSON is read as a chunk
        # size line and refused; it is never taken as a body of the declared length.
        ("Content-Length and chunked", http_request(body, credential=cred,
                                                    extra="Transfer-Encoding: chunked\r\n")
         + b"\r\n", False, [400]),
        ("declared body longer than sent", http_request(b"", credential=cred, length=False,
                                                        extra=f"Content-Length: {len(body) + 100}\r\n") + body,
         True, []),
        ("Expect: 100-continue", http_request(body, credential=cred,
                                              extra=f"Expect: 100-continue\r\n{close}"),
         False, [100, 200]),
        ("HTTP/1.0", http_request(body, credential=cred).replace(b"HTTP/1.1", b"HTTP/1.0", 1),
         False, [200]),
        ("GET", http_request(b"", credential=cred, method="GET", extra=close), False, [405]),
        ("another path", http_request(b"", credential=cred, target="/v1/sign", extra=close),
         False, [404]),
        ("request target abuse", http_request(body, credential=cred, target="/v1/action?x=../..",
                                              extra=close), False, [404]),
    ]
    for name, raw, close_write, expected in cases:
        answers = await exchange(broker, raw, close_write=close_write)
        assert [a[0] for a in answers] == expected, name
        for answer in answers:
            check_answer(answer, None)
        for status, _h, payload in answers:
            if status == 200:  # correlated to a request this case sent
                assert parse_response(payload).request_id in sent_ids, name
        await still_serving(broker, cred, channel)
    # The two-header request was judged, and refused as unauthenticated (never guessed).
    answers = await exchange(broker, http_request(
        request_body("channel.read", {"channelId": channel}), credential=cred,
        extra=f"Authorization: Bearer {cred}\r\nConnection: close\r\n"))
    assert parse_response(answers[0][2]).code is ErrorCode.UNAUTHENTICATED
    tally("fuzz_http_table", {"cases": len(cases)})


def _fresh(action: str) -> dict[str, Any]:
    doc = copy.deepcopy(_shared_envelope(action))
    doc["requestId"] = str(uuid.uuid4())  # each example is a new request, not a conflict
    return doc


@st.composite
def bodies(draw: st.DrawFn, channel: str) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "mutated", "valid"]))
    if kind == "bytes":
        return draw(st.binary(max_size=1024))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    doc: Any = _fresh(draw(st.sampled_from(sorted(ACTIONS))))
    if isinstance(doc.get("args"), dict) and "channelId" in doc["args"]:
        doc["args"]["channelId"] = channel  # reach the operation, not just authorization
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 3))):
            choices = list(all_mutations_of(doc))
            if not choices or not isinstance(doc, dict):
                break
            kind_, path, arg = draw(st.sampled_from(choices))
            doc = mutate(doc, kind_, path, arg)
    return dump(doc).encode("utf-8")


def generate(n: int, channel: str) -> list[tuple[bytes, bool]]:
    """`n` hypothesis-drawn (body, pipelined) inputs, drawn up front.

    Drawn synchronously rather than with @given on the async test: under pytest-trio,
    @given would set the whole daemon up again for every example. Without shrinking, a
    failure names the input itself (in the assertion message).
    """
    drawn: list[tuple[bytes, bool]] = []

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(channel), pipelined=st.booleans())
    def collect(body: bytes, pipelined: bool) -> None:
        drawn.append((body, pipelined))

    collect()
    return drawn


_random_figures: dict[str, Any] = {}


async def test_random_bodies_over_the_socket(broker: BrokerHarness) -> None:
    cred, channel = await _setup(broker)
    inputs = generate(EXAMPLES, channel)
    assert len(inputs) >= EXAMPLES // 2
    statuses: dict[int, int] = {}
    for body, pipelined in inputs:
        raw = http_request(body, credential=cred)
        if pipelined:  # the same body twice on one connection: the second replays or conflicts
            raw += http_request(body, credential=cred)
        # A bodiless GET closes the exchange: its 405 proves the connection was still sane.
        answers = await exchange(broker, raw + http_request(b"", credential=None, method="GET",
                                                            extra="Connection: close\r\n"))
        context = f"input {body[:120]!r} (pipelined={pipelined})"
        assert [a[0] for a in answers][-1:] == [405], context
        assert len(answers) == (3 if pipelined else 2), context
        for answer in answers[:-1]:
            try:
                check_answer(answer, body)
            except AssertionError as exc:
                raise AssertionError(f"{context}: {exc}") from None
            statuses[answer[0]] = statuses.get(answer[0], 0) + 1
    await still_serving(broker, cred, channel)
    _random_figures.update(inputs=len(inputs), answers=dict(sorted(statuses.items())))
    tally("fuzz_http_random", _random_figures)


async def test_memory_after_the_fuzz(broker: BrokerHarness) -> None:
    """RSS across a burst of bad and good requests: bounded growth (no per-request leak)."""
    cred, channel = await _setup(broker)
    await still_serving(broker, cred, channel)
    before = rss_bytes()
    n = scaled(300, 3000)
    for i in range(n):
        body = (request_body("channel.read", {"channelId": channel, "limit": 1}) if i % 3 == 0
                else b'{"requestId":"' + str(i).encode() + b'","type":' + b"[" * 5000)
        answers = await exchange(broker, http_request(body, credential=cred,
                                                      extra="Connection: close\r\n"))
        assert len(answers) == 1
        check_answer(answers[0], body)
    growth = rss_bytes() - before
    tally("fuzz_http_memory", {"requests": n, "rss_growth_bytes": growth})
    assert growth < MAX_RSS_GROWTH_BYTES, f"RSS grew {growth} bytes over {n} requests"
