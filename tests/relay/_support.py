"""Helpers the relay tests share: bursts of concurrent requests, and a held AUTH signer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import trio

from daemon.relay.pool import RelayPool
from tests.fixtures.relay import TestKey, auth_signer_for, signed


async def publish_all(pool: RelayPool, key: TestKey, events: Sequence[dict[str, Any]]) -> list[object]:
    """Publish every one of `events` as `key` at once; each result, in finishing order."""
    results: list[object] = []

    async def one(ev: dict[str, Any]) -> None:
        results.append(await pool.publish(key.pubkey, signed(ev)))

    async with trio.open_nursery() as inner:
        for ev in events:
            inner.start_soon(one, ev)
    return results


async def query_all(pool: RelayPool, agent: str, filters: Sequence[Mapping[str, object]],
                    count: int) -> list[object]:
    """`count` identical queries as `agent` at once; each answer, in finishing order."""
    answers: list[object] = []

    async def one() -> None:
        answers.append(await pool.query(agent, filters))

    async with trio.open_nursery() as inner:
        for _ in range(count):
            inner.start_soon(one)
    return answers


class HeldSigner:
    """An AUTH signer for `key` that signs only once `release` is set: a test holds an
    AUTH between the relay's challenge and our answer."""

    def __init__(self, key: TestKey) -> None:
        self._sign = auth_signer_for(key)
        self.release = trio.Event()

    async def __call__(self, agent: str, url: str, challenge: str, created_at: int) -> Any:
        await self.release.wait()
        return await self._sign(agent, url, challenge, created_at)
