"""The page echoes of channel.read (I5): every event of a page must carry, in its signed
tags, the channel, thread root and mention the request asked for; `echo_mismatch` reads
them from the wire form of the outcome, so these tests pin that walk."""

from __future__ import annotations

from buzzwire.contract import ACTIONS, ChannelReadArgs, Event, ReadOutcome, echo_mismatch

from .vectors import CHANNEL, EVENT_ID

OTHER_CHANNEL = "6df7dfa8-e919-43df-8efd-f1dcb8af7071"
ME = "ab" * 32
ECHOES = ACTIONS["channel.read"].echoes


def event(*tags: tuple[str, ...], event_id: str = "cd" * 32) -> Event:
    return Event(id=event_id, pubkey="ef" * 32, created_at=1, kind=9, tags=tags,
                 content="hi", sig="01" * 64)


def mismatch(args: ChannelReadArgs, *events: Event) -> str | None:
    return echo_mismatch(ECHOES, args, ReadOutcome(messages=events), ME)


def test_page_events_echo_the_channel_in_any_spelling() -> None:
    args = ChannelReadArgs(channel_id=CHANNEL)
    assert mismatch(args, event(("h", CHANNEL.upper().replace("-", "")))) is None
    assert mismatch(args) is None  # an empty page echoes nothing and breaks nothing


def test_an_event_of_another_channel_or_without_h_breaks_the_echo() -> None:
    args = ChannelReadArgs(channel_id=CHANNEL)
    assert mismatch(args, event(("h", CHANNEL)), event(("h", OTHER_CHANNEL))) == (
        "an event of the page has no h tag echoing the request's channelId")
    assert mismatch(args, event(("h",))) is not None  # a tag with no value names nothing
    assert mismatch(args, event(("d", CHANNEL))) is not None  # the value under another tag
    assert mismatch(args, event()) is not None


def test_thread_root_is_echoed_by_an_e_tag_or_by_being_the_root() -> None:
    args = ChannelReadArgs(channel_id=CHANNEL, root_event_id=EVENT_ID)
    assert mismatch(args, event(("h", CHANNEL), ("e", EVENT_ID.upper()))) is None
    assert mismatch(args, event(("h", CHANNEL), event_id=EVENT_ID)) is None
    assert mismatch(args, event(("h", CHANNEL), ("e", "cd" * 32))) == (
        "an event of the page has no e tag echoing the request's rootEventId")


def test_mentions_only_needs_a_p_tag_naming_the_requester() -> None:
    args = ChannelReadArgs(channel_id=CHANNEL, mentions_only=True)
    assert mismatch(args, event(("h", CHANNEL), ("p", ME))) is None
    assert mismatch(args, event(("h", CHANNEL), ("p", "ef" * 32))) is not None
    # Without mentionsOnly the p tag is not asked for, so none is needed.
    assert mismatch(ChannelReadArgs(channel_id=CHANNEL), event(("h", CHANNEL))) is None
