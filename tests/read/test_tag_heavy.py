"""A member's tag-heavy messages do not blind anyone's reads of the channel.

A kind 9 message of 2,000 tags of one-letter values is ~24 KB of JSON, which LocalRelay
(as Buzz's relay) accepts from any member, but ~390 KB as decoded objects
(`decoded_size`): a relay answer of 100 of them (or of the 60 newest, with older ordinary
messages) is past the pool's per-query bound (pool.MAX_QUERY_BYTES), and every read of the
channel failed with action_failed, at any limit, Buzz's own poll included. Paging now asks
such a query again with a smaller `limit` (daemon/relay/paging.py "Answers too large"):
the page ends early with a nextCursor, and walking the cursors returns every event of the
channel exactly once, in declared order.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from buzzwire.contract import ChannelReadArgs, ReadOutcome, Status
from daemon.operations import channel_read
from daemon.relay.cursor import CursorCodec
from daemon.relay.pool import MAX_QUERY_BYTES, RelayPool, RelayTimeouts, decoded_size
from daemon.relay.windows import WindowCache
from tests.fixtures.relay import TestKey, auth_signer_for
from tests.read._support import NOW, context, declared_order, new_channel, principal_for, publish_all, read_through

TIMEOUTS = RelayTimeouts(connect=10, ok=10, eose=10, idle_seconds=60)
#: Tags of one heavy message: the shape of the finding.
HEAVY_TAGS = 2_000
#: Heavy messages in the channel: more than one query's bound holds (about 43).
HEAVY = 60
#: Ordinary messages around them.
ORDINARY = 90
#: Heavy messages that share one second (a sweep must hold them all at once).
SHARED_SECOND = 12


@dataclass
class Channel:
    pool: RelayPool
    reader: TestKey
    channel: str
    events: list[dict[str, Any]]


def _heavy_tags(channel: str, n: int) -> list[list[str]]:
    # `t` (hashtag): a tag no check of the read path reads, unlike a second `h` or an `e`.
    return [["h", channel], *(["t", chr(ord("a") + (n + i) % 26)] for i in range(HEAVY_TAGS - 1))]


@pytest.fixture
async def heavy_channel(local_relay: str) -> AsyncIterator[Channel]:
    reader, member = TestKey(), TestKey()
    channel = new_channel()
    pool = RelayPool(local_relay, auth_signer_for(reader, member), timeouts=TIMEOUTS)
    events: list[dict[str, Any]] = []
    for n in range(HEAVY):
        # The first SHARED_SECOND in one second, the rest one per second.
        created_at = NOW - 500 if n < SHARED_SECOND else NOW - 500 + n
        events.append(member.sign(9, f"heavy {n}", _heavy_tags(channel, n), created_at))
    for n in range(ORDINARY):
        # Older than most heavy ones: the newest 100 hold all 60 of them.
        events.append(member.sign(9, f"ordinary {n}", [["h", channel]], NOW - 600 + 2 * n))
    # The finding's shape: one read window's 100 events, even the whole channel's heavy
    # ones, are more than one query's bound.
    heavy_size = decoded_size(json.loads(json.dumps(events[0])))
    assert HEAVY * heavy_size > 1.2 * MAX_QUERY_BYTES
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        await publish_all(pool, events)
        yield Channel(pool, reader, channel, events)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("limit", [100, None])
async def test_tag_heavy_messages_page_through_the_whole_channel(
        heavy_channel: Channel, tmp_path: Path, limit: int | None) -> None:
    ctx = context(heavy_channel.pool,
                  principal_for(tmp_path, heavy_channel.reader.pubkey, [heavy_channel.channel]),
                  CursorCodec.open(tmp_path))
    # read_through asserts every page `succeeded` and follows nextCursor to its end.
    events, verdicts = await read_through(ctx, channel_id=heavy_channel.channel, limit=limit)
    ids = [e.id for e in events]
    assert ids == declared_order(heavy_channel.events)  # every event once, in order
    assert len(set(ids)) == HEAVY + ORDINARY
    assert len(verdicts) > 1  # pages ended early, with a nextCursor, and were walked


async def test_buzz_poll_of_a_tag_heavy_channel_succeeds(heavy_channel: Channel,
                                                         tmp_path: Path) -> None:
    # Buzz's runtime polls with no cursor and the default window, through a read window.
    pool = heavy_channel.pool
    pool.windows = WindowCache(pool)
    ctx = context(pool, principal_for(tmp_path, heavy_channel.reader.pubkey, [heavy_channel.channel]),
                  CursorCodec.open(tmp_path))
    newest = declared_order(heavy_channel.events)
    for _ in range(3):
        verdict = await channel_read.execute(ctx, ChannelReadArgs(channel_id=heavy_channel.channel))
        assert verdict.status is Status.SUCCEEDED, verdict
        outcome = verdict.outcome
        assert isinstance(outcome, ReadOutcome)
        got = [e.id for e in outcome.messages]
        assert got and got == newest[:len(got)]  # the newest events, none skipped
        assert outcome.next_cursor is not None
