"""Helpers for the channel.read tests: a real Principal, a Context, and page-through loops."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from daemon.config import PolicyConfig
from buzzwire.contract import ChannelReadArgs, Event, ReadOutcome, Status, Verdict
from daemon.relay.cursor import CursorCodec
from daemon.pipeline.policy import Authorized
from daemon.operations import channel_read
from daemon.operations._base import Context
from daemon.operations.channel_read import JUDGED_CACHE_BYTES, JudgedCache, ReadLog
from daemon.relay.paging import order_key
from daemon.relay.pool import Accepted, RelayPool
from daemon.state.sessions import Principal, SessionStore
from tests.fixtures.relay import signed

NOW = 1_787_675_388
POLICY = PolicyConfig(disabled_actions=frozenset(), max_agent_depth=1, runtimes=frozenset())


def new_channel() -> str:
    return str(uuid.uuid4())


def principal_for(state_dir: Path, agent: str, channels: Sequence[str]) -> Principal:
    """A Principal made the only way one can be: issue a credential and authenticate it."""
    store = SessionStore.open(state_dir / "sessions")
    try:
        _, token = store.issue(
            agent=agent, channels=frozenset(channels), actions=frozenset({"channel.read"}),
            ttl_seconds=None, uid=None, now=NOW,
        )
        principal = store.authenticate(f"Bearer {token}", None, NOW)
    finally:
        store.close()
    assert principal is not None
    return principal


def context(relay: Any, principal: Principal, cursors: CursorCodec, *, now: Callable[[], int] = lambda: NOW) -> Context:
    # channel.read never touches custody: None proves it (an attribute access would raise).
    return Context(
        custody=None,  # type: ignore[arg-type]
        signer=None,  # type: ignore[arg-type]
        relay=relay, principal=principal, host=POLICY, cursors=cursors,
        request_id="read-test", now=now,
        authorized=Authorized(), read_log=ReadLog(), judged=JudgedCache(JUDGED_CACHE_BYTES),
    )


def declared_order(events: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(e["id"]) for e in sorted(events, key=lambda e: order_key(int(e["created_at"]), str(e["id"])))]


async def read_through(ctx: Context, *, max_pages: int = 2000, **args: Any) -> tuple[list[Event], list[Verdict]]:
    """Every page of one read, following nextCursor until it is absent."""
    events: list[Event] = []
    verdicts: list[Verdict] = []
    cursor: str | None = None
    for _ in range(max_pages):
        verdict = await channel_read.execute(ctx, ChannelReadArgs(cursor=cursor, **args))
        verdicts.append(verdict)
        assert verdict.status is Status.SUCCEEDED, verdict
        outcome = verdict.outcome
        assert isinstance(outcome, ReadOutcome)
        events.extend(outcome.messages)
        if outcome.next_cursor is None:
            return events, verdicts
        cursor = outcome.next_cursor
    raise AssertionError("paging did not end")


#: Publishes in flight at once while filling (two agents, a connection each). Any number
#: is safe against LocalRelay's AUTH: the pool's AUTH gate sends one request on a fresh
#: connection until it is authenticated (daemon/relay/gate.py; the burst it fixed is
#: tests/relay/test_auth_burst.py). This one only keeps the fill from holding 1,000 tasks.
PUBLISHES_IN_FLIGHT = 32


async def publish_all(pool: RelayPool, events: list[dict[str, Any]]) -> None:
    """Publish `events` (made by tests.fixtures.relay.TestKey) through `pool`, each Accepted."""
    limiter = trio.CapacityLimiter(PUBLISHES_IN_FLIGHT)

    async def one(ev: dict[str, Any]) -> None:
        async with limiter:
            result = await pool.publish(ev["pubkey"], signed(ev))
        assert isinstance(result, Accepted), result

    async with trio.open_nursery() as nursery:
        for ev in events:
            nursery.start_soon(one, ev)
