"""channel.read without a network: a relay object that behaves like one, or fails like one."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from buzzwire.contract import (
    MAX_CONTENT_BYTES, MAX_ENCODED_EVENT_BYTES, MAX_PAGE_BYTES, ChannelReadArgs, ErrorCode, Event,
    ReadOutcome, Status,
)
from daemon.relay.cursor import CURSOR_TTL_SECONDS, KEY_FILE_NAME, CursorCodec
from daemon.operations import channel_read
from daemon.operations._base import Context
from daemon.relay.paging import MAX_ROUNDS, READ_AHEAD
from daemon.relay.pool import AnswerTooLarge, RelayRefused, RelayUnavailable
from daemon.relay.windows import encode_event
from tests.fixtures.relay import TestKey
from tests.read._support import NOW, context, declared_order, new_channel, principal_for, read_through
from tests.read.fake_relay import FakeRelay


class PoolLike:
    """RelayPool's query surface over a FakeRelay; records who read, can be made to fail."""

    def __init__(self, events: Sequence[Mapping[str, Any]], *, cap: int = 500, fail: Exception | None = None) -> None:
        self.inner = FakeRelay(events, cap=cap, seed=7)
        self.fail = fail
        self.agents: list[str] = []
        self.extra: list[dict[str, Any]] = []

    async def query(self, agent: str, filters: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        self.agents.append(agent)
        if self.fail is not None:
            raise self.fail
        reply = await self.inner.query([dict(f) for f in filters])
        return [*reply, *self.extra]  # type: ignore[list-item]


def _reading(tmp_path: Path, reader: TestKey, channel: str, pool: PoolLike) -> Context:
    """A read's context: `reader`, bound to `channel`, reading through `pool`."""
    return context(pool, principal_for(tmp_path, reader.pubkey, [channel]),
                   CursorCodec.open(tmp_path))


def fields(caplog: pytest.LogCaptureFixture, event: str) -> list[Mapping[str, Any]]:
    return [r.buzz_fields for r in caplog.records if getattr(r, "buzz_event", None) == event]  # type: ignore[attr-defined]


@pytest.fixture
def reader() -> TestKey:
    return TestKey()


def channel_events(author: TestKey, channel: str, n: int, *, per_second: int) -> list[dict[str, Any]]:
    return [author.sign(9, f"m{i}", [["h", channel]], NOW - 100 - i // per_second) for i in range(n)]


def encoded_size(event: Mapping[str, Any]) -> int:
    """The event's bytes as an answer carries it: compact JSON, UTF-8, nothing escaped
    that need not be (contract `encode_response`), as Buzz's SDK measures it."""
    return len(json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode())


def encoded_exactly(author: TestKey, channel: str, size: int, created_at: int) -> dict[str, Any]:
    """A message of short content whose `t` tag pads its encoded JSON to exactly `size`."""
    draft = author.sign(9, "short", [["h", channel], ["t", ""]], created_at)
    event = author.sign(9, "short", [["h", channel], ["t", "x" * (size - encoded_size(draft))]], created_at)
    assert encoded_size(event) == size
    return event


async def test_reads_as_the_requester_and_pages_exactly(tmp_path: Path, reader: TestKey) -> None:
    channel = new_channel()
    events = channel_events(TestKey(), channel, 60, per_second=12)
    pool = PoolLike(events)
    ctx = _reading(tmp_path, reader, channel, pool)
    got, verdicts = await read_through(ctx, channel_id=channel, limit=5)
    assert [e.id for e in got] == declared_order(events)
    assert set(pool.agents) == {reader.pubkey}
    assert verdicts[-1].outcome.next_cursor is None  # type: ignore[union-attr]


async def test_default_limit_is_one_hundred(tmp_path: Path, reader: TestKey) -> None:
    channel = new_channel()
    events = channel_events(TestKey(), channel, 150, per_second=30)
    ctx = _reading(tmp_path, reader, channel, PoolLike(events))
    verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel))
    assert len(verdict.outcome.messages) == 100 and verdict.outcome.next_cursor is not None  # type: ignore[union-attr]


async def test_undeliverable_events_are_dropped_and_logged(tmp_path: Path, reader: TestKey, caplog: pytest.LogCaptureFixture) -> None:
    channel, other = new_channel(), new_channel()
    alice = TestKey()
    good = channel_events(alice, channel, 10, per_second=3)
    forged = dict(alice.sign(9, "forged", [["h", channel]], NOW - 100))
    forged["content"] = "tampered after signing"  # id no longer matches
    bad_sig = dict(alice.sign(9, "bad sig", [["h", channel]], NOW - 100))
    bad_sig["sig"] = ("0" if bad_sig["sig"][0] != "0" else "1") + bad_sig["sig"][1:]
    no_h = alice.sign(9, "no h", [], NOW - 101)
    foreign = alice.sign(9, "foreign", [["h", other]], NOW - 101)
    extra_member = {**alice.sign(9, "extra", [["h", channel]], NOW - 101), "relay": "x"}
    wrong_kind = alice.sign(1, "kind 1", [["h", channel]], NOW - 101)
    # Validly signed, but NIP-01 tags hold one or more strings: Buzz's SDK (rust-nostr)
    # refuses the event, and with it the whole page it came in.
    empty_tag = alice.sign(9, "empty tag", [["h", channel], []], NOW - 101)
    # Validly signed and in the channel, but past what Buzz's SDK takes in a read answer:
    # content over NIP-BA's post bound in UTF-8 bytes (not characters: 16,385 of a 4-byte
    # character), or the event's JSON over 512 KiB with small content (its escapes count:
    # U+0001 is six bytes as sent). Any one refuses the whole page (`_size_ok`).
    half = MAX_CONTENT_BYTES // 2
    too_long = [alice.sign(9, "x" * (MAX_CONTENT_BYTES + 1), [["h", channel]], NOW - 101),
                alice.sign(9, "é" * half + "x", [["h", channel]], NOW - 101),
                alice.sign(9, "\U0001f440" * (MAX_CONTENT_BYTES // 4 + 1), [["h", channel]], NOW - 101),
                encoded_exactly(alice, channel, MAX_ENCODED_EVENT_BYTES + 1, NOW - 101),
                alice.sign(9, "s", [["h", channel], ["t", "\x01" * (MAX_ENCODED_EVENT_BYTES // 6 + 1)]],
                           NOW - 101)]
    # At the bounds exactly: delivered (a 65,536-byte content in 1-, 2- and 4-byte
    # characters, and an event of exactly 512 KiB of JSON).
    at_bounds = [alice.sign(9, "x" * MAX_CONTENT_BYTES, [["h", channel]], NOW - 99),
                 alice.sign(9, "é" * half, [["h", channel]], NOW - 99),
                 alice.sign(9, "\U0001f440" * (MAX_CONTENT_BYTES // 4), [["h", channel]], NOW - 99),
                 encoded_exactly(alice, channel, MAX_ENCODED_EVENT_BYTES, NOW - 99)]
    good = at_bounds + good
    pool = PoolLike(good)
    # A misbehaving relay sends all of these whatever the filter says.
    pool.extra = [forged, bad_sig, no_h, foreign, extra_member, wrong_kind, empty_tag, *too_long]
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    ctx = _reading(tmp_path, reader, channel, pool)
    got, _ = await read_through(ctx, channel_id=channel, limit=4)
    assert [e.id for e in got] == declared_order(good)
    # One line per check that dropped (the first event it dropped), every drop counted.
    dropped = {"bad_signature": {forged["id"], bad_sig["id"]},
               "wrong_channel": {no_h["id"], foreign["id"]},
               "not_canonical": {extra_member["id"]}, "off_filter": {wrong_kind["id"]},
               "empty_tag": {empty_tag["id"]}, "oversized": {e["id"] for e in too_long}}
    shown = fields(caplog, "read.event_dropped")
    assert sorted(f["reason"] for f in shown) == sorted(dropped)
    assert all(f["event_id"] in dropped[f["reason"]] for f in shown)
    assert ctx.read_log.total("read.event_dropped") >= 12
    # No content of any event reached the log, nor the host's cursor key in any spelling.
    assert "tampered" not in caplog.text and "forged" not in caplog.text and "x" * 100 not in caplog.text
    key = (tmp_path / KEY_FILE_NAME).read_bytes()
    logged = caplog.text + repr([getattr(r, "buzz_fields", None) for r in caplog.records])
    for spelling in (key.hex(), base64.b64encode(key).decode(), base64.urlsafe_b64encode(key).decode(), repr(key)):
        assert spelling not in logged


async def test_pages_of_only_dropped_events_still_move_on(tmp_path: Path, reader: TestKey) -> None:
    # A member's oversized messages, more than one page's rounds reach (MAX_ROUNDS of
    # limit + READ_AHEAD + 1 each), above older ordinary ones: the first pages deliver
    # nothing, each with a cursor past what it dropped, and following them reaches every
    # ordinary message once; the read never loops on the same events.
    channel = new_channel()
    alice = TestKey()
    limit = 4
    oversized = [alice.sign(9, "x" * (MAX_CONTENT_BYTES + 1), [["h", channel]], NOW - 10 - i)
                 for i in range(MAX_ROUNDS * (limit + READ_AHEAD + 1) + 12)]
    ordinary = [alice.sign(9, f"m{i}", [["h", channel]], NOW - 1_000 - i) for i in range(6)]
    ctx = _reading(tmp_path, reader, channel, PoolLike(oversized + ordinary))
    got, verdicts = await read_through(ctx, channel_id=channel, limit=limit, max_pages=20)
    assert [e.id for e in got] == declared_order(ordinary)
    first = verdicts[0].outcome
    assert isinstance(first, ReadOutcome) and first.messages == () and first.next_cursor is not None


@pytest.mark.parametrize(
    ("failure", "event"),
    [(RelayUnavailable("no EOSE within 10s"), "read.relay_unavailable"), (RelayRefused("restricted: not a member"), "read.relay_refused")],
)
async def test_relay_faults_are_failed_action_failed(tmp_path: Path, reader: TestKey, caplog: pytest.LogCaptureFixture, failure: Exception, event: str) -> None:
    channel = new_channel()
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    ctx = _reading(tmp_path, reader, channel, PoolLike([], fail=failure))
    verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel))
    assert verdict.status is Status.FAILED and verdict.code is ErrorCode.ACTION_FAILED
    # the relay's reason is for the operator log, never the agent
    assert verdict.message is not None and failure.args[0] not in verdict.message
    assert [f["reason"] for f in fields(caplog, event)] == [failure.args[0]]


@pytest.mark.parametrize("event", ["read.relay_unavailable", "read.event_dropped",
                                   "read.cursor_refused"])
async def test_a_fault_at_every_read_is_one_line_not_one_per_read(
        tmp_path: Path, reader: TestKey, caplog: pytest.LogCaptureFixture, event: str) -> None:
    # A relay that is down, or sends a bad event, does so to every poll of a fleet, and a
    # forged cursor comes as often as an agent likes: each was a line per read.
    channel = new_channel()
    alice = TestKey()
    forged = {**alice.sign(9, "x", [["h", channel]], NOW - 5), "content": "changed"}
    pool = PoolLike(channel_events(alice, channel, 3, per_second=1),
                    fail=RelayUnavailable("no EOSE within 10s")
                    if event == "read.relay_unavailable" else None)
    pool.extra = [forged]
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    ctx = _reading(tmp_path, reader, channel, pool)
    for _ in range(50):
        await channel_read.execute(ctx, ChannelReadArgs(
            channel_id=channel, cursor="forged" if event == "read.cursor_refused" else None))
    assert len(fields(caplog, event)) == 1
    assert ctx.read_log.total(event) == 50


async def test_garbage_relay_is_failed(tmp_path: Path, reader: TestKey) -> None:
    channel = new_channel()
    pool = PoolLike([])
    pool.extra = [{"not": "an event"}] * 200
    ctx = _reading(tmp_path, reader, channel, pool)
    verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel, limit=5))
    assert verdict.status is Status.FAILED and verdict.code is ErrorCode.ACTION_FAILED


async def test_expired_forged_and_foreign_cursors_are_invalid_request(tmp_path: Path, reader: TestKey) -> None:
    channel = new_channel()
    events = channel_events(TestKey(), channel, 20, per_second=4)
    pool = PoolLike(events)
    clock = [NOW]
    codec = CursorCodec.open(tmp_path)
    ctx = context(pool, principal_for(tmp_path, reader.pubkey, [channel]), codec, now=lambda: clock[0])
    first = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel, limit=3))
    cursor = first.outcome.next_cursor  # type: ignore[union-attr]
    assert cursor is not None
    clock[0] = NOW + CURSOR_TTL_SECONDS
    assert (await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel, cursor=cursor))).status is Status.SUCCEEDED
    asked = len(pool.agents)
    bad = [cursor[:-1] + ("A" if cursor[-1] != "A" else "B"), "x", "~" * 256]
    clock[0] = NOW + CURSOR_TTL_SECONDS + 1
    verdicts = [await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel, cursor=c)) for c in [cursor, *bad]]
    assert {(v.status, v.code) for v in verdicts} == {(Status.FAILED, ErrorCode.INVALID_REQUEST)}
    assert len({v.message for v in verdicts}) == 1  # one fixed message, no oracle
    assert len(pool.agents) == asked  # refused before any relay I/O


async def test_second_over_the_relay_cap_is_logged(tmp_path: Path, reader: TestKey, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # A relay whose cap (and ours) is 20, with 30 events in one second: detected, logged.
    monkeypatch.setattr(channel_read, "RELAY_MAX_LIMIT", 20)
    channel = new_channel()
    events = channel_events(TestKey(), channel, 30, per_second=30)
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    ctx = _reading(tmp_path, reader, channel, PoolLike(events, cap=20))
    got, _ = await read_through(ctx, channel_id=channel, limit=5)
    assert len({e.id for e in got}) == len(got)
    assert fields(caplog, "read.second_overflow")


def test_a_judged_event_is_reused_only_for_an_exact_copy() -> None:
    """The fleet's agents receive the same event on their own connections; it is judged
    (shape, id, signature) once, and a later item is taken as that event only when it is
    the same JSON member for member, with integer created_at and kind."""
    from daemon.operations.channel_read import JudgedCache
    from buzzwire.contract import Event
    from tests.fixtures.relay import TestKey

    item = TestKey().sign(9, "hello", [["h", "c"]], 1_700_000_000)
    event = Event.from_json_obj(item)
    cache = JudgedCache(1 << 20)
    assert cache.known(item) is None
    cache.remember(event)
    assert cache.known(dict(item)) is event
    for changed in ({**item, "content": "forged"}, {**item, "created_at": float(item["created_at"])},
                    {**item, "tags": [["h", "d"]]}, {**item, "extra": 1},
                    {k: v for k, v in item.items() if k != "content"},
                    {**item, "id": [item["id"]]}, {**item, "sig": {"x": 1}}):
        assert cache.known(changed) is None, changed
    # Bounded by bytes: the oldest judgement goes first.
    small = JudgedCache(1)
    small.remember(event)
    assert small.known(item) is None


async def test_a_relay_failure_worded_anew_each_read_is_still_one_line(
        tmp_path: Path, reader: TestKey, caplog: pytest.LogCaptureFixture) -> None:
    # A RelayUnavailable may quote the relay: an `auth-required:` CLOSED whose AUTH then
    # fails without a refusal (`_after_closed`). A relay wording each one anew made a
    # line per read when the line was kept apart by the reason; it is kept apart by the
    # reason's NIP-01 prefix (`_relay_cause`).
    channel = new_channel()
    pool = PoolLike([])
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    ctx = _reading(tmp_path, reader, channel, pool)
    for n in range(50):
        pool.fail = RelayUnavailable(
            f"auth-required: attempt {n} (the relay sent no AUTH challenge)")
        await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel))
    assert len(fields(caplog, "read.relay_unavailable")) == 1
    assert ctx.read_log.total("read.relay_unavailable") == 50


async def test_relay_refusals_with_different_prefixes_are_kept_apart(
        tmp_path: Path, reader: TestKey, caplog: pytest.LogCaptureFixture) -> None:
    # The operator tells "not a member" (restricted:) from "AUTH refused" (blocked:, ...)
    # in the log: each prefix its own line, whatever the words after it.
    channel = new_channel()
    pool = PoolLike([])
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    ctx = _reading(tmp_path, reader, channel, pool)
    for reason in ("restricted: not a member 1", "restricted: not a member 2",
                   "blocked: banned 1", "blocked: banned 2"):
        pool.fail = RelayRefused(reason)
        await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel))
    assert [f["reason"] for f in fields(caplog, "read.relay_refused")] == [
        "restricted: not a member 1", "blocked: banned 1"]


async def test_an_answer_too_large_even_at_limit_one_fails_the_read_as_unavailable(
        tmp_path: Path, reader: TestKey, caplog: pytest.LogCaptureFixture) -> None:
    # One event can pass MAX_QUERY_BYTES decoded (170,000 one-letter tags in a 1 MiB frame):
    # paging asks again down to limit 1 and then gives up. The read fails as any relay
    # failure does (AnswerTooLarge is a RelayUnavailable), not with an unhandled error.
    channel = new_channel()
    pool = PoolLike([], fail=AnswerTooLarge("relay sent more than ... for one query"))
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    ctx = _reading(tmp_path, reader, channel, pool)
    verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel))
    assert verdict.status is Status.FAILED and verdict.code is ErrorCode.ACTION_FAILED
    assert len(pool.agents) > 1  # asked again, smaller, before giving up
    assert ctx.read_log.total("read.relay_unavailable") == 1


async def test_a_page_of_large_messages_ends_at_max_page_bytes_with_a_cursor(
        tmp_path: Path, reader: TestKey) -> None:
    # 100 messages of 60,000 characters are ~6 MB: the page holds what fits in
    # MAX_PAGE_BYTES (contract `page_bytes`) and says there is more; the next page goes on.
    channel = new_channel()
    alice = TestKey()
    events = [alice.sign(9, f"{i:05d}" + "z" * 60_000, [["h", channel]], NOW - 100 - i)
              for i in range(100)]
    ctx = _reading(tmp_path, reader, channel, PoolLike(events))
    verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=channel, limit=100))
    assert verdict.status is Status.SUCCEEDED
    page = verdict.outcome
    assert isinstance(page, ReadOutcome)
    held = len(page.messages)
    assert MAX_PAGE_BYTES // 70_000 < held < 100, held
    assert page.next_cursor is not None


@pytest.mark.parametrize(("content", "tags", "created_at"), [
    ("", [], 0),
    ("\x01\x1f\"\\", [["h", "\x00" * 50]], 2**63 - 1),
    ("\U0001f440é" * 3_000, [["t", "\U0001f440"]] * 500, NOW),
    ("s", [[""]] * 20_000 + [["", "", ""]] * 5_000, NOW),
])
def test_the_cheap_json_bound_is_never_below_the_encoding(
        content: str, tags: list[list[str]], created_at: int) -> None:
    # `_size_ok` encodes an event only when this bound is past MAX_ENCODED_EVENT_BYTES: a
    # bound below the real size would let a too-large event through unencoded.
    event = Event.from_json_obj(TestKey().sign(65_535, content, tags, created_at))
    assert channel_read._json_bytes_at_most(event) >= len(encode_event(event))


def test_an_honest_buzz_message_is_judged_by_its_bound_alone() -> None:
    # 8 KB of content in 2-byte characters and 55 tags of an id, a relay and a marker: far
    # under the bound, so a cold read never encodes it to judge its size.
    tags = [["h", new_channel()]] + [["e", "a" * 64, "wss://relay.example", "reply"]] * 55
    event = Event.from_json_obj(TestKey().sign(9, "é" * 4_000, tags, NOW))
    assert channel_read._json_bytes_at_most(event) < MAX_ENCODED_EVENT_BYTES // 4
