"""Every operation through the agent-side client against the real daemon and relay (issue 7).

The client checks each verdict against its request (I5) and verifies returned events (I4);
here the host is the real one, so every answer must pass those checks and come back as a
verdict, never as "no answer".
"""

from __future__ import annotations

import time
import uuid

import pytest
import trio

from buzz_broker_client import AsyncBrokerClient, BrokerClient, Failed, ReadEnd, Succeeded, Unsupported
from daemon.relay.windows import WindowKey
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import TestKey, nostr_publish


@pytest.mark.broker_config(policy={"models": ["m-2"]})  # the model it names, declared
async def test_every_operation_through_the_client(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent("client-agent")
    client = AsyncBrokerClient(str(broker.socket), broker.credential(agent, [channel]),
                               agent_pubkey=agent)

    posted = await client.message_post(channel, "through the client")
    assert isinstance(posted, Succeeded), posted
    replied = await client.message_reply(channel, posted.outcome.event_id, "a reply",
                                         mentions=[agent])
    assert isinstance(replied, Succeeded), replied
    reacted = await client.reaction_add(channel, posted.outcome.event_id, "🎉")
    assert isinstance(reacted, Succeeded), reacted
    profile = await client.profile_set(display_name="Client Agent")
    assert isinstance(profile, Succeeded), profile
    address = await client.storage_address("core")
    assert isinstance(address, Succeeded) and address.outcome.author_pubkey == agent

    mentions = await client.channel_read(channel, mentions_only=True)
    assert isinstance(mentions, Succeeded), mentions
    assert [m.id for m in mentions.outcome.messages] == [replied.outcome.event_id]

    created = await client.agents_create(channel, "Sub", "help out", respond_to="anyone")
    assert isinstance(created, Succeeded), created
    sub = created.outcome.agent_pubkey
    updated = await client.agents_update(target_pubkey=sub, model="m-2")
    assert isinstance(updated, Succeeded) and updated.outcome.updated_fields == ("model",)
    deleted = await client.agents_delete(target_name="Sub")
    assert isinstance(deleted, Succeeded) and deleted.outcome.agent_pubkey == sub

    again = await client.agents_delete(target_pubkey=sub)
    assert isinstance(again, Failed) and again.code.value == "unauthorized"


async def test_read_all_pages_to_the_end(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    client = AsyncBrokerClient(str(broker.socket), broker.credential(agent, [channel]))
    sent = []
    for i in range(12):
        answer = await client.message_post(channel, f"message {i}")
        assert isinstance(answer, Succeeded)
        sent.append(answer.outcome.event_id)
    everything = await client.read_all(channel, limit=5)
    assert everything.end is ReadEnd.EXHAUSTED, everything
    assert everything.pages == 3
    assert sorted(m.id for m in everything.messages) == sorted(sent)


async def test_reaction_switched_off_is_unsupported_not_a_failure(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    client = AsyncBrokerClient(str(broker.socket), broker.credential(agent, [channel]))
    post = await client.message_post(channel, "react to me")
    assert isinstance(post, Succeeded), post
    # The target must exist in the channel (issue 15: reaction.add checks it).
    assert isinstance(await client.reaction_add(channel, post.outcome.event_id, "👍"), Succeeded)
    # The operator switches reactions off and reloads (SIGHUP): the next one is unsupported,
    # which the client keeps apart from a failure.
    broker.reconfigure('[policy]\ndisabled_actions = ["reaction.add"]\n')
    answer = await client.reaction_add(channel, "cd" * 32, "👍")
    assert isinstance(answer, Unsupported), answer


async def test_the_synchronous_client_from_a_thread(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    client = BrokerClient(str(broker.socket), broker.credential(agent, [channel]))
    answer = await trio.to_thread.run_sync(client.message_post, channel, "from plain code")
    assert isinstance(answer, Succeeded), answer


# ------------------------------------------------------------------ pages of many tags
# A channel member may post an ordinary signed message with thousands of tags; the relay
# keeps it, the host serves it, and Buzz's own client shows it. The client's bound on an
# answer's JSON values is the host's page (contract MAX_PAGE_VALUES), so such a page is
# read, at any limit (an allowance of 1,024 values an event refused it: the agent was
# blind to the channel while the events were in its newest page).

#: 2,000 one-letter tags: 24 KB of JSON, ~6,000 JSON values.
_MANY_TAGS = [["t", "x"]] * 1999


async def _post_many_tags(broker: BrokerHarness, channel: str, count: int) -> list[str]:
    member, now = TestKey(), int(time.time())
    ids = []
    for i in range(count):
        event = member.sign(9, f"tags {i}", [["h", channel]] + _MANY_TAGS, now + 1 + i)
        assert await trio.to_thread.run_sync(nostr_publish, broker.relay_url, event,
                                             member.secret_hex)
        ids.append(event["id"])
    return ids[::-1]  # newest first, as a page is


async def _agent_who_posted(broker: BrokerHarness
                            ) -> tuple[str, str, AsyncBrokerClient, Succeeded]:
    """A fresh channel, an agent's client bound to it, and the agent's one message there."""
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    client = AsyncBrokerClient(str(broker.socket), broker.credential(agent, [channel]),
                               agent_pubkey=agent)
    posted = await client.message_post(channel, "hello")
    assert isinstance(posted, Succeeded), posted
    return channel, agent, client, posted


def _tag_counts(answer: object) -> list[int]:
    assert isinstance(answer, Succeeded), answer
    return [len(m.tags) for m in answer.outcome.messages]


async def test_a_message_of_2000_tags_reads_through_the_client_at_limit_1(
        broker: BrokerHarness) -> None:
    channel, agent, client, posted = await _agent_who_posted(broker)
    [tagged] = await _post_many_tags(broker, channel, 1)
    newest = await client.channel_read(channel, limit=1)
    assert _tag_counts(newest) == [2000]
    assert newest.outcome.messages[0].id == tagged and newest.outcome.next_cursor
    both = await client.channel_read(channel, limit=100)
    assert _tag_counts(both) == [2000, 1]
    assert [m.id for m in both.outcome.messages] == [tagged, posted.outcome.event_id]


async def test_a_poll_over_twenty_messages_of_2000_tags_reads_through_the_client(
        broker: BrokerHarness) -> None:
    # Buzz's poll: limit 100, the newest page. The first read opens the agent's read window
    # (a cold read of the relay); the second is answered from the window.
    channel, agent, client, posted = await _agent_who_posted(broker)
    tagged = await _post_many_tags(broker, channel, 20)
    windows = broker.app._relay.windows  # the daemon's own pool
    assert windows is not None
    for _ in range(2):
        poll = await client.channel_read(channel, limit=100)
        assert _tag_counts(poll) == [2000] * 20 + [1]
        assert [m.id for m in poll.outcome.messages] == tagged + [posted.outcome.event_id]
        assert windows.get(WindowKey(agent=agent, channel_id=channel, mentions_only=False))
