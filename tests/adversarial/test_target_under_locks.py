"""The target an agents.update acts on is the one authorization resolved under its locks.

Attack (issue 16, one resolution): the target is named by name; between the moment the
request is judged and the moment it holds its agents' locks, another change renames the
agents, so the name now means another agent. Before, the operation resolved the target a
second time on its own and the pipeline a third time to know what to lock; now
`authorize` runs again under the locks and the operation acts on exactly what it
resolved. When that is an agent the locks do not cover, nothing has happened yet and the
locks are taken again with it.

Proven here: the update lands on the agent the name means once the locks are held (the
outcome names it, its 30177 is the one published), and the second taking of the locks
covers it; the agent the name meant before is untouched. A target removed while the
request waits is refused by that second authorization (unauthorized), and nothing is
published for it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager

import coincurve
import pytest
import trio

from daemon.pipeline import broker as broker_module
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import nostr_fetch

CHANNEL = str(uuid.uuid4())


async def _kid(broker: BrokerHarness, owner: str, name: str) -> str:
    secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
    return await broker.hold(secret, owner=owner, name=name)


def _before_the_first_locks(monkeypatch: pytest.MonkeyPatch,
                            meanwhile: Callable[[], Awaitable[None]]) -> list[frozenset[str]]:
    """Run `meanwhile` while the request waits for its first locks; the agents of every
    taking of the locks are appended to the list returned."""
    real_hold_all = broker_module._AgentLocks.hold_all
    taken: list[frozenset[str]] = []

    @asynccontextmanager
    async def hold_all(self: broker_module._AgentLocks, agents: Iterable[str]
                       ) -> AsyncIterator[None]:
        agents = frozenset(agents)
        taken.append(agents)
        if len(taken) == 1:
            await meanwhile()
        async with real_hold_all(self, agents):
            yield

    monkeypatch.setattr(broker_module._AgentLocks, "hold_all", hold_all)
    return taken


@pytest.mark.broker_config(policy={"models": ["m-2"]})  # the model it names, declared
async def test_a_target_renamed_before_the_locks_is_the_one_acted_on(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = await broker.human_owned_agent("owner")
    first = await _kid(broker, owner, "kid")
    second = await _kid(broker, owner, "other")
    cred = broker.credential(owner, [CHANNEL])

    async def swap_names() -> None:  # "kid" comes to mean the other agent
        broker.app.directory.rename(first, "was-kid")
        broker.app.directory.rename(second, "kid")

    taken = _before_the_first_locks(monkeypatch, swap_names)
    answer = await broker.call(cred, "agents.update",
                               {"target": {"name": "kid"}, "model": "m-2"})
    assert answer["status"] == "succeeded", answer
    assert answer["outcome"]["agentPubkey"] == second
    assert taken[0] == {owner, first}
    assert second in taken[1] and len(taken) == 2

    records = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"kinds": [30177], "authors": [owner]}])
    assert [tag[1] for r in records for tag in r["tags"] if tag[0] == "d"] == [second]


@pytest.mark.broker_config(policy={"models": ["m-2"]})
async def test_a_target_removed_before_the_locks_is_refused_not_updated(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = await broker.human_owned_agent("owner")
    kid = await _kid(broker, owner, "kid")
    cred = broker.credential(owner, [CHANNEL])

    async def remove_target() -> None:
        await broker.app.custody.destroy_agent(kid)

    taken = _before_the_first_locks(monkeypatch, remove_target)
    answer = await broker.call(cred, "agents.update", {"target": {"pubkey": kid}, "model": "m-2"})
    assert answer["status"] == "failed", answer
    assert answer["error"]["code"] == "unauthorized", answer
    assert taken == [{owner, kid}]  # refused under the first locks, not taken again

    records = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"kinds": [30177], "authors": [owner]}])
    assert records == []
