"""A Buzz-shaped fleet against the real daemon over loopback TCP (issue 24 item 4).

Three agents (tests/fleet/buzz_agent.py: Buzz's runtime in broker mode, as
../shared/spec/buzz-client.md describes it) poll two channels each every 200 ms through
the daemon's `listen_tcp` listener, `http://localhost:PORT` as Buzz's transport names it,
against the session's LocalRelay and the real SoftHSM token. Another client posts over the
Unix socket. What is asserted is the fleet's observable behaviour, never a timing: every
poll got a valid envelope under Buzz's strict reading and every one succeeded, each agent
started as the runtime does, posts by the other client reached every agent exactly once,
a mention woke a turn whose live signals were answered, and a credential revoked while its
agent polls ends that agent (and no other). How fast is benchmarks/fleet.py's question.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from custody import TokenConfig
from daemon.state.sessions import SessionStore
from tests.adversarial._daemon import envelope, post, request_body, setup_state
from tests.fleet.buzz_agent import BuzzAgent
from tests.test_tcp_listener import start_daemon

from buzzwire.contract import ACTIONS

AGENTS = 3
INTERVAL = 0.2
#: Bounds on waits for things that must happen; a broken host fails here, never hangs.
WAIT_SECONDS = 8.0


def uid_bound(state_dir: Path, agent: str, channels: Sequence[str]) -> tuple[str, str]:
    """(credential id, credential) bound to this process's uid: over TCP only those count."""
    store = SessionStore.open(state_dir)
    try:
        return store.issue(agent=agent, channels=frozenset(channels), actions=frozenset(ACTIONS),
                           ttl_seconds=None, uid=os.getuid(), now=int(time.time()))
    finally:
        store.close()


async def until(condition: Callable[[], bool], what: str) -> None:
    with trio.move_on_after(WAIT_SECONDS):
        while not condition():
            await trio.sleep(0.05)
        return
    raise AssertionError(f"not within {WAIT_SECONDS} s: {what}")


async def test_buzz_shaped_fleet_over_loopback_tcp(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    token, state_dir = custody_state
    channels = [str(uuid.uuid4()) for _ in range(2)]
    members = [await setup_state(token, state_dir, channels, name=f"fleet{i}")
               for i in range(AGENTS)]
    poster = await setup_state(token, state_dir, channels, name="poster")
    bound = [uid_bound(state_dir, m.agent, channels) for m in members]
    daemon, port, socket_path = await start_daemon(custody_state, local_relay, tmp_path,
                                                   [os.getuid()])
    base = f"http://localhost:{port}"

    async def post_to(channel: str, content: str, mentions: list[str]) -> str:
        args: dict[str, object] = {"channelId": channel, "content": content}
        if mentions:
            args["mentions"] = mentions
        answer = envelope(await post(socket_path, request_body("message.post", args),
                                     poster.credential))
        assert answer["status"] == "succeeded", answer
        return str(answer["outcome"]["eventId"])

    # A backlog before the fleet starts: the first poll delivers it, every later one re-reads it.
    backlog = {c: await post_to(c, "before the fleet", []) for c in channels}
    fleet = [BuzzAgent(base, credential, channels, interval=INTERVAL) for _, credential in bound]
    revoked = fleet[-1]
    posted: dict[str, list[str]] = {c: [] for c in channels}
    try:
        async with trio.open_nursery() as nursery:
            for agent in fleet:
                nursery.start_soon(agent.run)
            await until(lambda: all(a.stats.scheduled >= 2 * len(channels) for a in fleet),
                        "every agent started and polled each channel")
            assert [a.ended for a in fleet] == [None] * AGENTS, [a.ended for a in fleet]
            # Another client posts, each post mentioning the first agent (a mention wakes it).
            for channel in channels:
                for n in range(2):
                    posted[channel].append(await post_to(channel, f"fleet post {n}",
                                                         [members[0].agent]))
            await until(lambda: all(set(posted[c]) <= set(a.stats.delivered[c])
                                    for a in fleet for c in channels),
                        "every agent delivered every post")
            await until(lambda: fleet[0].stats.turns >= 1, "the mentioned agent took a turn")
            # Revoked while it polls: its next request is unauthenticated, and that ends it.
            store = SessionStore.open(state_dir)
            try:
                assert store.revoke(bound[-1][0])
            finally:
                store.close()
            await until(lambda: revoked.ended is not None, "the revoked agent ended")
            await until(lambda: all(a.stats.scheduled >= 3 * len(channels) * 2 for a in fleet[:-1]),
                        "the others kept polling")
            for agent in fleet[:-1]:
                agent.stop()
    finally:
        await daemon.stop()

    assert revoked.ended == "unauthenticated"
    assert [a.ended for a in fleet[:-1]] == ["stopped"] * (AGENTS - 1)
    for member, agent in zip(members, fleet):
        stats = agent.stats
        assert not stats.no_answer, stats.no_answer  # every answer passed the strict reading
        assert agent.pubkey == member.agent  # storage.address core named the agent itself
        assert agent.memory == {}  # storage.get core: no memory record yet
        assert stats.answers["storage.address succeeded"] == 1
        assert stats.answers["storage.get succeeded"] == 1
        assert stats.answers["presence.set succeeded"] >= 1
        polls = {k: v for k, v in stats.answers.items() if k.startswith("channel.read")}
        # Every poll answered, and answered ok; the revoked agent's last ones (at most one
        # in flight per channel) unauthenticated.
        assert sum(polls.values()) == stats.sent >= 3
        unauthenticated = polls.pop("channel.read failed:unauthenticated", 0)
        assert set(polls) == {"channel.read succeeded"}, polls
        if agent is revoked:
            assert 1 <= unauthenticated <= len(channels)
        else:
            assert unauthenticated == 0
        for channel in channels:
            delivered = stats.delivered[channel]
            assert len(delivered) == len(set(delivered))  # de-duplication by event id holds
            assert set(posted[channel]) <= set(delivered)
            assert delivered[0] == backlog[channel]  # the first poll: the newest page
        # The default window was read again and again: the same events came back, dropped
        # (each poll after a channel's first re-reads at least the backlog).
        read_ok = polls["channel.read succeeded"]
        assert stats.duplicates >= read_ok - len(channels) > 0 and stats.dropped == 0
    woken = fleet[0].stats.answers
    assert woken["typing.set succeeded"] >= 1 and woken["observer.emit succeeded"] >= 1
    assert woken["liveness.ping failed:unsupported"] >= 1  # a normal answer: carries on
    assert all(a.stats.turns == 0 for a in fleet[1:])  # nobody else was mentioned
