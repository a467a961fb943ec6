"""When the fleet client's polls are due (tests/fleet/buzz_agent.py, "Polls").

The benchmark starts each agent at a random moment of the interval so that the fleet's
polls arrive at random phases, as agents started apart do. A timer counted from the start
calls' answers loses that: a host answers the start calls of agents that started apart
together (a batch, a pause), and those agents then poll together every tick for the rest
of the run. That is what the benchmark's runs did until 2026-12-06 (docs/performance.md,
"Phases"); `timer_origin="ready"` keeps it, to be measured on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing

from tests.fleet.buzz_agent import TIMER_ORIGINS, BuzzAgent, Verdict

INTERVAL = 1.0
#: When the scripted host answers every start call (a batch), in the test's clock.
ANSWERED_AT = 0.9
#: The agents' own start moments, apart, both before the batch is answered.
STARTS = (0.0, 0.5)
STOP_AT = 3.2

_START_OUTCOMES: Mapping[str, Mapping[str, Any]] = {
    "storage.address": {"authorPubkey": "ab" * 32},
    "storage.get": {"found": False},
    "presence.set": {},
}


class _ScriptedAgent(BuzzAgent):
    """Answers its own calls: the start calls once the host's batch is out, every poll at
    once (failed: a poll's answer does not move the timer)."""

    def __init__(self, origin: str, answered: trio.Event) -> None:
        super().__init__("http://127.0.0.1:1", "credential", ["a", "b"], interval=INTERVAL,
                         timer_origin=origin)
        self.answered = answered
        self.polled: list[tuple[float, str]] = []

    async def call(self, action: str, args: Mapping[str, Any],
                   since: float | None = None) -> Verdict | None:
        if action == "channel.read":
            self.polled.append((round(trio.current_time(), 3), args["channelId"]))
            return Verdict("failed", "internal", {}, False)
        await self.answered.wait()
        return Verdict("succeeded", None, _START_OUTCOMES[action], False)


async def _polls(origin: str) -> list[list[tuple[float, str]]]:
    answered = trio.Event()
    agents = [_ScriptedAgent(origin, answered) for _ in STARTS]

    async def start(agent: BuzzAgent, at: float) -> None:
        await trio.sleep_until(at)
        await agent.run()

    async with trio.open_nursery() as nursery:
        for agent, at in zip(agents, STARTS):
            nursery.start_soon(start, agent, at)
        await trio.sleep_until(ANSWERED_AT)
        answered.set()
        await trio.sleep_until(STOP_AT)
        for agent in agents:
            agent.stop()
    return [agent.polled for agent in agents]


def _ticks(begin: float) -> list[tuple[float, str]]:
    """Every channel polled at `begin` and each interval after it, until the stop."""
    out = []
    at = begin
    while at < STOP_AT:
        out += [(round(at, 3), "a"), (round(at, 3), "b")]
        at += INTERVAL
    return out


@pytest.mark.parametrize("origin", TIMER_ORIGINS)
async def test_the_poll_timer_counts_from_its_origin(
        origin: str, autojump_clock: trio.testing.MockClock) -> None:
    first, second = await _polls(origin)
    if origin == "start":
        # Each agent keeps the phase it started at: its first tick is the first one after
        # its start calls were answered, counted from its own start.
        assert sorted(first) == _ticks(1.0)
        assert sorted(second) == _ticks(1.5)
    else:
        # Both count from the batch that answered them: they poll together, every tick.
        assert sorted(first) == sorted(second) == _ticks(ANSWERED_AT)


def test_an_unknown_timer_origin_is_refused() -> None:
    with pytest.raises(ValueError, match="timer_origin"):
        BuzzAgent("http://127.0.0.1:1", "credential", ["a"], timer_origin="tick")
