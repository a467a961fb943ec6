"""The signing batcher against the real token: concurrent callers share hops, each gets its
own signatures in order, and one caller's bad agent never fails another's request."""

from __future__ import annotations

import coincurve
import trio

from custody import Custody, UnknownAgent, UnsignedEvent, verify_event
from daemon.pipeline.signing import MAX_EVENTS_PER_HOP, SigningBatcher


async def _agent(custody: Custody) -> str:
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    secret = bytearray(coincurve.PrivateKey().secret.hex().encode())
    return (await custody.import_agent(secret, owner=owner)).pubkey


def _event(agent: str, n: int) -> UnsignedEvent:
    return UnsignedEvent(pubkey=agent, created_at=1_700_000_000 + n, kind=9,
                         tags=(("h", "5df7dfa8-e919-43df-8efd-f1dcb8af7071"),), content=f"n{n}")


async def test_concurrent_callers_share_hops_and_keep_their_order(custody: Custody) -> None:
    agents = [await _agent(custody) for _ in range(4)]
    batcher = SigningBatcher(custody)
    results: dict[int, list[dict[str, object]]] = {}

    async def caller(i: int) -> None:
        agent = agents[i % len(agents)]
        signed = await batcher.sign([(agent, _event(agent, i)), (agent, _event(agent, i + 1000))])
        results[i] = [dict(s.to_json_obj()) for s in signed]

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as callers:
            for i in range(100):
                callers.start_soon(caller, i)
        nursery.cancel_scope.cancel()
    assert batcher.events == 200
    assert batcher.hops < 100  # callers that queued behind a hop shared the next one
    for i, (first, second) in results.items():
        assert first["content"] == f"n{i}" and second["content"] == f"n{i + 1000}"
        assert first["pubkey"] == second["pubkey"] == agents[i % len(agents)]
        assert verify_event(first) and verify_event(second)


async def test_a_bad_caller_fails_alone(custody: Custody) -> None:
    good = await _agent(custody)
    unknown = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
    batcher = SigningBatcher(custody)
    outcomes: dict[str, object] = {}

    async def caller(name: str, agent: str) -> None:
        try:
            outcomes[name] = await batcher.sign([(agent, _event(agent, 1))])
        except UnknownAgent as exc:
            outcomes[name] = exc

    async with trio.open_nursery() as nursery:
        await nursery.start(batcher.run)
        async with trio.open_nursery() as callers:
            for i in range(MAX_EVENTS_PER_HOP // 4):
                callers.start_soon(caller, f"good{i}", good)
            callers.start_soon(caller, "bad", unknown)
        nursery.cancel_scope.cancel()
    assert isinstance(outcomes.pop("bad"), UnknownAgent)
    assert all(isinstance(v, list) and len(v) == 1 for v in outcomes.values())


async def test_nothing_to_sign_needs_no_hop(custody: Custody) -> None:
    batcher = SigningBatcher(custody)
    assert await batcher.sign([]) == []
    assert batcher.hops == 0
