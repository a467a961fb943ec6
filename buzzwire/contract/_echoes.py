"""The identities a succeeded outcome echoes from its request (I5), as data, and their check.

Rules:
- An `Echo` says: this member of the outcome (or each event of a page) names the same
  identity as that member of the request's arguments (or the requesting agent).
  The table lives in `ActionSpec.echoes`; the client checks every answer against it and the
  host's tests check every real answer against it, so both read one list.
- How each event of a page must stand to the identity is its `Membership`, a row of
  `_MEMBERSHIPS`: named by some tag (a mention), in exactly that channel, or in that
  thread. The last two are `buzzwire.threads`' rules, the ones the host's channel.read
  delivers by and message.reply builds on, so a page this check accepts is a page that
  host could have delivered, not merely one whose events cite what was asked for.
- Identities are compared parsed (`Identity`): a channel as its canonical UUID, hex as
  lowercase. Two spellings of one identity never mismatch; an unparsable value always does.
  For a page's events, the values of the tags a membership reads (and the event's id) are
  put in canonical form first, then the membership's rule is applied to them as it is:
  so the rule is the host's own, and only the spelling of an identity is forgiven.
- A page event that is not a wire event (an object whose `id` is a string and whose
  `tags` are lists of strings) breaks every echo of the page.
- An echo whose request side is absent is not checked: a target named by name (the reply
  may carry a new name, spec I5 Limits), a read without `rootEventId`, a `when` member
  absent, or the requester's pubkey when the caller did not say it.
- What `echo_mismatch` returns is a fixed sentence per membership, filled only with the
  echo's own names (from the table): never a value from the answer.

WARNING: `outcome` paths are outcome wire names or `messages[].<tag>`; `source` paths are
argument wire names, dotted for a nested object (`target.pubkey`), or `REQUESTER`. A
membership that reads a fixed tag (`_Test.tag`) is only valid on an echo of that tag.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from buzzwire.threads import CHANNEL_TAG, THREAD_TAG, in_channel, in_thread

from ._ids import normalize_channel_id, normalize_hex64
from ._shapes import to_wire

__all__ = ["Echo", "Identity", "Membership", "REQUESTER", "echo_mismatch"]

#: `Echo.source` for the requesting agent's own pubkey (known to the caller, not the wire).
REQUESTER = "@requester"
_EVENTS = "messages[]."


class Identity(enum.Enum):
    """How both sides of an echo are parsed before they are compared."""

    CHANNEL = "channel"
    HEX = "hex"


_PARSE: Mapping[Identity, Callable[[str], str | None]] = {
    Identity.CHANNEL: normalize_channel_id,
    Identity.HEX: normalize_hex64,
}


class Membership(enum.Enum):
    """How each event of a page must stand to the echoed identity (`Echo.membership`)."""

    #: some tag of the echo's name names it (`messages[].p`: the event mentions you)
    TAGGED = "tagged"
    #: its `h` values are exactly it (`buzzwire.threads.in_channel`)
    CHANNEL = "channel"
    #: it is that event, or its signed `e` tags declare it their root
    #: (`buzzwire.threads.in_thread`)
    THREAD = "thread"


#: A page event's tags, as the wire writes them.
_Tags = Sequence[Sequence[str]]


def _tagged(event_id: str, tags: _Tags, tag: str, wanted: str) -> bool:
    return any(len(t) >= 2 and t[0] == tag and t[1] == wanted for t in tags)


def _in_channel(event_id: str, tags: _Tags, tag: str, wanted: str) -> bool:
    return in_channel(tags, wanted)


def _in_thread(event_id: str, tags: _Tags, tag: str, wanted: str) -> bool:
    return in_thread(event_id, tags, wanted)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Test:
    """One membership's rule: what it reads, the test, and what a break is called."""

    #: the tag it reads (an echo of it must name that tag), or None for the echo's own
    tag: str | None
    #: the identity it compares, or None for the echo's own
    identity: Identity | None
    #: (event id, tags, tag, wanted) -> holds; the id, the tag's values and `wanted` are
    #: in canonical form
    holds: Callable[[str, _Tags, str, str], bool]
    #: the fixed sentence of a break, filled with the echo's `tag` and `source`
    broken: str


_MEMBERSHIPS: Mapping[Membership, _Test] = {
    Membership.TAGGED: _Test(
        tag=None, identity=None, holds=_tagged,
        broken="an event of the page has no {tag} tag echoing the request's {source}"),
    Membership.CHANNEL: _Test(
        tag=CHANNEL_TAG, identity=Identity.CHANNEL, holds=_in_channel,
        broken="an event of the page is not in exactly the channel of the request's {source}"),
    Membership.THREAD: _Test(
        tag=THREAD_TAG, identity=Identity.HEX, holds=_in_thread,
        broken="an event of the page is not in the thread of the request's {source}"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Echo:
    """One identity the outcome must repeat from the request (see the module rules)."""

    outcome: str
    source: str
    identity: Identity
    #: the argument that must be present (and true) for this echo to be checked
    when: str | None = None
    #: for the events of a page: how each must stand to the identity (a plain member is
    #: compared as it is, and keeps the default)
    membership: Membership = Membership.TAGGED

    def __post_init__(self) -> None:
        if not self.outcome or not self.source:
            raise ValueError("an echo names an outcome member and a source")
        test = _MEMBERSHIPS[self.membership]
        if self.membership is not Membership.TAGGED and self.event_tag is None:
            raise ValueError(f"membership {self.membership.name} applies to a page's events only")
        if test.tag is not None and self.event_tag != test.tag:
            raise ValueError(f"membership {self.membership.name} reads the {test.tag} tags")
        if test.identity is not None and self.identity is not test.identity:
            raise ValueError(f"membership {self.membership.name} compares {test.identity.name}")

    @property
    def event_tag(self) -> str | None:
        """The tag every event of the page is judged by, or None for a plain member."""
        return self.outcome[len(_EVENTS):] if self.outcome.startswith(_EVENTS) else None


def _same(a: object, b: str, identity: Identity) -> bool:
    if type(a) is not str:
        return False
    parse = _PARSE[identity]
    left, right = parse(a), parse(b)
    return left is not None and left == right


def _source_value(echo: Echo, wire_args: Mapping[str, object], me: str | None) -> str | None:
    if echo.when is not None and not wire_args.get(echo.when):
        return None
    if echo.source == REQUESTER:
        return me
    value: object = wire_args
    for part in echo.source.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value if type(value) is str else None


def _page_events(wire_outcome: Mapping[str, object]) -> list[object]:
    # `to_wire` writes a page's events as a list of wire objects; anything else is no page.
    events = wire_outcome.get("messages", ())
    return events if isinstance(events, list) else []


def _canonical(value: str, identity: Identity) -> str:
    # A value that does not parse stays as written: it then equals no canonical identity.
    return _PARSE[identity](value) or value


def _event_holds(echo: Echo, tag: str, event: object, wanted: str) -> bool:
    """Whether one page event stands to `wanted` (canonical) as `echo.membership` asks,
    reading its `tag` tags (`echo.event_tag`, which the membership's own tag is)."""
    if not isinstance(event, dict):
        return False
    event_id, tags = event.get("id"), event.get("tags")
    if type(event_id) is not str or type(tags) is not list:
        return False
    if not all(type(t) is list and all(type(v) is str for v in t) for t in tags):
        return False
    canonical = [[t[0], _canonical(t[1], echo.identity), *t[2:]]
                 if len(t) >= 2 and t[0] == tag else t for t in tags]
    return _MEMBERSHIPS[echo.membership].holds(_canonical(event_id, echo.identity), canonical,
                                               tag, wanted)


def echo_mismatch(echoes: tuple[Echo, ...], args: object, outcome: object,
                  me: str | None) -> str | None:
    """The first echo the outcome breaks, as a fixed sentence; None when all hold.

    Args:
        echoes: the action's `ActionSpec.echoes`.
        args: the request's argument value (a contract args dataclass).
        outcome: the succeeded outcome (a contract outcome dataclass).
        me: the requesting agent's pubkey when known; echoes of REQUESTER need it.
    """
    wire_args = to_wire(args)
    wire_outcome = to_wire(outcome)
    for echo in echoes:
        wanted = _source_value(echo, wire_args, me)
        if wanted is None:
            continue
        tag = echo.event_tag
        if tag is None:
            if not _same(wire_outcome.get(echo.outcome), wanted, echo.identity):
                return f"outcome {echo.outcome} does not echo the request's {echo.source}"
            continue
        canonical = _PARSE[echo.identity](wanted)
        for event in _page_events(wire_outcome):
            if canonical is None or not _event_holds(echo, tag, event, canonical):
                return _MEMBERSHIPS[echo.membership].broken.format(tag=tag, source=echo.source)
    return None
