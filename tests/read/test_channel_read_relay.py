"""channel.read against nostr-sdk's LocalRelay (NIP-42 AUTH required) through RelayPool.

1,000 messages in one channel, 300 of them in one second, read with limit 7 and 500:
every event exactly once, in (created_at DESC, id ASC); the mentions and thread views;
events that must not be delivered; cursors refused on another channel / principal / filter.
A thread is what declares its root in NIP-10 marked tags, not what cites it (`Threads`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from buzzwire.contract import ChannelReadArgs, ErrorCode, Status
from daemon.relay.cursor import CursorCodec
from daemon.operations import channel_read
from daemon.relay.pool import RelayPool, RelayTimeouts
from tests.fixtures.relay import TestKey, auth_signer_for, signed, nostr_verify
from tests.read._support import NOW, context, declared_order, new_channel, principal_for, publish_all, read_through

TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=60)
#: The second 300 messages share.
CROWDED = NOW - 1_000


@dataclass
class World:
    pool: RelayPool
    reader: TestKey
    channel: str
    other_channel: str
    root: dict[str, Any]
    readable: list[dict[str, Any]]  # every event channel.read must return (whole channel)
    mentions: list[dict[str, Any]]
    thread: list[dict[str, Any]]
    not_delivered: list[dict[str, Any]]


@pytest.fixture
async def world(local_relay: str) -> AsyncIterator[World]:
    reader, alice, bob = TestKey(), TestKey(), TestKey()
    channel, other = new_channel(), new_channel()
    pool = RelayPool(local_relay, auth_signer_for(reader, alice, bob), timeouts=TIMEOUTS)
    root = alice.sign(9, "thread root", [["h", channel]], CROWDED + 5)
    readable: list[dict[str, Any]] = [root]
    mentions: list[dict[str, Any]] = []
    thread: list[dict[str, Any]] = [root]
    for n in range(999):
        author = (alice, bob)[n % 2]
        created_at = CROWDED if n < 300 else CROWDED + 1 + (n * 7919) % 400  # 300 in one second
        tags = [["h", channel]]
        if n % 10 == 0:
            tags.append(["e", root["id"], "", "root"])
        if n % 13 == 0:
            tags.append(["p", reader.pubkey])
        ev = author.sign(9 if n % 5 else 40002, f"message {n}", tags, created_at)
        readable.append(ev)
        if n % 10 == 0:
            thread.append(ev)
        if n % 13 == 0:
            mentions.append(ev)
    not_delivered = [
        alice.sign(9, "other channel", [["h", other], ["p", reader.pubkey]], CROWDED),
        alice.sign(7, "+", [["h", channel], ["e", root["id"]]], CROWDED),  # not a read kind
        alice.sign(9, "two channels", [["h", channel], ["h", other]], CROWDED),  # relay returns it; we drop it
    ]
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        await publish_all(pool, readable + not_delivered)
        yield World(pool, reader, channel, other, root, readable, mentions, thread, not_delivered)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("limit", [7, 500])
async def test_whole_channel_every_event_once_in_order(world: World, tmp_path: Path, limit: int, caplog: pytest.LogCaptureFixture) -> None:
    assert len(world.readable) == 1000
    ctx = context(world.pool, principal_for(tmp_path, world.reader.pubkey, [world.channel]), CursorCodec.open(tmp_path))
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    events, verdicts = await read_through(ctx, channel_id=world.channel, limit=limit)
    ids = [e.id for e in events]
    assert ids == declared_order(world.readable)
    assert len(set(ids)) == 1000
    assert all(len(v.outcome.messages) == limit for v in verdicts[:-1])  # type: ignore[union-attr]
    # verbatim: the seven members exactly as the relay holds them, signatures verify independently
    by_id = {e["id"]: e for e in world.readable}
    for event in events[:: max(1, len(events) // 50)]:
        assert event.to_json_obj() == by_id[event.id]
        assert nostr_verify(event.to_json_obj())
    # the two-channel event reached us and was dropped with a log line naming the check
    dropped = [r.buzz_fields for r in caplog.records if getattr(r, "buzz_event", None) == "read.event_dropped"]  # type: ignore[attr-defined]
    assert dropped
    assert {(f["reason"], f["event_id"]) for f in dropped} == {("wrong_channel", world.not_delivered[2]["id"])}
    assert not any(getattr(r, "buzz_event", None) == "read.second_overflow" for r in caplog.records)


async def test_mentions_and_thread(world: World, tmp_path: Path) -> None:
    ctx = context(world.pool, principal_for(tmp_path, world.reader.pubkey, [world.channel]), CursorCodec.open(tmp_path))
    mentions, _ = await read_through(ctx, channel_id=world.channel, mentions_only=True, limit=9)
    assert [e.id for e in mentions] == declared_order(world.mentions)
    thread, _ = await read_through(ctx, channel_id=world.channel, root_event_id=world.root["id"], limit=11)
    assert [e.id for e in thread] == declared_order(world.thread)
    assert world.root["id"] in {e.id for e in thread}  # the root is part of its thread
    both, _ = await read_through(ctx, channel_id=world.channel, root_event_id=world.root["id"], mentions_only=True, limit=3)
    assert [e.id for e in both] == declared_order([e for e in world.thread if e in world.mentions])


@dataclass
class Threads:
    """A small channel of two threads, R and S, and events that cite R without being in it.

    The relay answers a read of R's thread (`#e` = [R]) with every one of them; only
    `in_r` may be delivered (NIP-BA: ancestry comes from signed tags)."""

    pool: RelayPool
    reader: TestKey
    channel: str
    r: dict[str, Any]
    s: dict[str, Any]
    direct: dict[str, Any]  # Buzz's direct reply to R: only a reply-marked e tag
    nested: dict[str, Any]  # a reply to `direct`: root R, reply `direct`
    in_r: list[dict[str, Any]]
    in_s: list[dict[str, Any]]
    cites_r: list[dict[str, Any]]  # each names R in an e tag, none is in R's thread


def _e(event: dict[str, Any], marker: str) -> list[str]:
    return ["e", event["id"], "", marker]


@pytest.fixture
async def threads(local_relay: str) -> AsyncIterator[Threads]:
    reader, alice = TestKey(), TestKey()
    channel = new_channel()
    pool = RelayPool(local_relay, auth_signer_for(reader, alice), timeouts=TIMEOUTS)
    h = ["h", channel]
    r = alice.sign(9, "root R", [h], NOW - 100)
    s = alice.sign(9, "root S", [h], NOW - 99)
    direct = alice.sign(9, "reply to R", [h, _e(r, "reply")], NOW - 90)
    nested = alice.sign(9, "reply to the reply", [h, _e(r, "root"), _e(direct, "reply")], NOW - 80)
    in_s = alice.sign(9, "in S, citing R", [h, _e(s, "root"), _e(s, "reply"), _e(r, "mention")],
                      NOW - 70)
    cites_r = [
        alice.sign(9, "top level, citing R", [h, _e(r, "mention")], NOW - 60),
        in_s,
        alice.sign(9, "positional", [h, ["e", r["id"]]], NOW - 50),
        alice.sign(9, "positional with a hint", [h, ["e", r["id"], "wss://relay.example"]],
                   NOW - 49),
        alice.sign(9, "two roots", [h, _e(r, "root"), _e(s, "root")], NOW - 40),
    ]
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        await publish_all(pool, [r, s, direct, nested, *cites_r])
        yield Threads(pool, reader, channel, r, s, direct, nested, in_r=[r, direct, nested],
                      in_s=[s, in_s], cites_r=cites_r)
        nursery.cancel_scope.cancel()


async def _read_thread(threads: Threads, tmp_path: Path, root: dict[str, Any],
                       caplog: pytest.LogCaptureFixture) -> tuple[list[str], int, set[str]]:
    """One thread read: the ids delivered, how many events were dropped, and the checks
    named by the drop lines logged."""
    ctx = context(threads.pool, principal_for(tmp_path / root["id"][:8], threads.reader.pubkey,
                                              [threads.channel]),
                  CursorCodec.open(tmp_path))
    caplog.clear()
    events, _ = await read_through(ctx, channel_id=threads.channel, root_event_id=root["id"],
                                   limit=100)
    reasons = {r.buzz_fields["reason"] for r in caplog.records  # type: ignore[attr-defined]
               if getattr(r, "buzz_event", None) == "read.event_dropped"}
    return [e.id for e in events], ctx.read_log.total("read.event_dropped"), reasons


async def test_a_thread_is_what_declares_its_root_not_what_cites_it(
        threads: Threads, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    # R's thread: R, the direct reply, and the nested reply whose root tag is R. Not the
    # top-level mention, the reply in S citing R, the positional tags, the two roots: the
    # relay sends each (`#e` = [R]) and each is dropped as off the thread.
    ids, dropped, reasons = await _read_thread(threads, tmp_path, threads.r, caplog)
    assert ids == declared_order(threads.in_r)
    assert dropped == len(threads.cites_r)
    assert reasons == {"off_thread"}
    # Control: the reply in S is S's, whatever it cites.
    ids, dropped, _ = await _read_thread(threads, tmp_path, threads.s, caplog)
    assert ids == declared_order(threads.in_s)
    assert dropped == 1  # "two roots" names S too, and is in neither


async def test_a_thread_read_of_a_reply_is_not_its_childrens_thread(
        threads: Threads, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker.read")
    # `direct` is a reply in R's thread; `nested` answers it but declares R its root, so
    # it is R's thread, not presented as `direct`'s (channel_read.py module doc).
    ids, dropped, reasons = await _read_thread(threads, tmp_path, threads.direct, caplog)
    assert ids == [threads.direct["id"]]
    assert (dropped, reasons) == (1, {"off_thread"})


async def test_cursor_is_refused_elsewhere(world: World, tmp_path: Path) -> None:
    codec = CursorCodec.open(tmp_path)
    me = principal_for(tmp_path, world.reader.pubkey, [world.channel, world.other_channel])
    ctx = context(world.pool, me, codec)
    first = await channel_read.execute(ctx, ChannelReadArgs(channel_id=world.channel, limit=5))
    cursor = first.outcome.next_cursor  # type: ignore[union-attr]
    assert cursor is not None
    stranger = TestKey()
    other_ctx = context(world.pool, principal_for(tmp_path / "s", stranger.pubkey, [world.channel]), codec)
    refusals = [
        await channel_read.execute(ctx, ChannelReadArgs(channel_id=world.other_channel, cursor=cursor)),
        await channel_read.execute(other_ctx, ChannelReadArgs(channel_id=world.channel, cursor=cursor)),
        await channel_read.execute(ctx, ChannelReadArgs(channel_id=world.channel, cursor=cursor, mentions_only=True)),
        await channel_read.execute(ctx, ChannelReadArgs(channel_id=world.channel, cursor=cursor, root_event_id=world.root["id"])),
    ]
    for verdict in refusals:
        assert verdict.status is Status.FAILED and verdict.code is ErrorCode.INVALID_REQUEST
    # the rightful owner, after a "restart" (a new codec from the same state dir), continues
    again = context(world.pool, me, CursorCodec.open(tmp_path))
    second = await channel_read.execute(again, ChannelReadArgs(channel_id=world.channel, cursor=cursor, limit=5))
    assert second.status is Status.SUCCEEDED
    got = [e.id for e in first.outcome.messages + second.outcome.messages]  # type: ignore[union-attr]
    assert got == declared_order(world.readable)[:10]
