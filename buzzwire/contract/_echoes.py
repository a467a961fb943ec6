"""The identities a succeeded outcome echoes from its request (I5), as data, and their check.

Rules:
- An `Echo` says: this member of the outcome (or this tag of every event of a page) names
  the same identity as that member of the request's arguments (or the requesting agent).
  The table lives in `ActionSpec.echoes`; the client checks every answer against it and the
  host's tests check every real answer against it, so both read one list.
- Identities are compared parsed (`Identity`): a channel as its canonical UUID, hex as
  lowercase. Two spellings of one identity never mismatch; an unparsable value always does.
- An echo whose request side is absent is not checked: a target named by name (the reply
  may carry a new name, spec I5 Limits), a read without `rootEventId`, a `when` member
  absent, or the requester's pubkey when the caller did not say it.

WARNING: `outcome` paths are outcome wire names or `messages[].<tag>`; `source` paths are
argument wire names, dotted for a nested object (`target.pubkey`), or `REQUESTER`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._ids import normalize_channel_id, normalize_hex64
from ._shapes import to_wire

__all__ = ["Echo", "Identity", "REQUESTER", "echo_mismatch"]

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Echo:
    """One identity the outcome must repeat from the request (see the module rules)."""

    outcome: str
    source: str
    identity: Identity
    #: the argument that must be present (and true) for this echo to be checked
    when: str | None = None
    #: for an event tag: the event's own id counts too (a thread's root is in its thread)
    or_event_id: bool = False

    def __post_init__(self) -> None:
        if not self.outcome or not self.source:
            raise ValueError("an echo names an outcome member and a source")
        if self.or_event_id and not self.outcome.startswith(_EVENTS):
            raise ValueError("or_event_id applies to the events of a page only")

    @property
    def event_tag(self) -> str | None:
        """The tag every event of the page must carry, or None for a plain member."""
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


def _page_events(wire_outcome: Mapping[str, object]) -> list[dict[str, object]]:
    # `to_wire` writes a page's events as a list of wire objects; anything else is no page.
    events = wire_outcome.get("messages", ())
    if not isinstance(events, list):
        return []
    return [event for event in events if isinstance(event, dict)]


def _tag_values(event: Mapping[str, object], tag: str) -> list[object]:
    """The first value of every `tag` tag of one wire event (tags are lists of strings)."""
    tags = event.get("tags", ())
    if not isinstance(tags, list):
        return []
    return [t[1] for t in tags if isinstance(t, list) and len(t) >= 2 and t[0] == tag]


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
        for event in _page_events(wire_outcome):
            if echo.or_event_id and _same(event.get("id"), wanted, echo.identity):
                continue
            if not any(_same(value, wanted, echo.identity) for value in _tag_values(event, tag)):
                return f"an event of the page has no {tag} tag echoing the request's {echo.source}"
    return None
