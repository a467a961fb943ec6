"""The closed list of events the custodian signs: each kind, its tags, and who may sign it.

Why: without it "nothing signs arbitrary bytes" would hold only because the pipeline
behaves. The list is the kinds the fifteen actions publish (ActionSpec.published_kind in
buzzwire.contract, and the events agents.create/update/delete sign: daemon/operations/).
Kind 22242 (NIP-42 AUTH) is not in it: only the `sign_auth` request makes one, for the
relay the custodian is configured with.

Rules, one row per kind in `KINDS`:
- `tags`: tag name -> (fewest, most) values after the name; a tag not named is refused,
  and so is any `auth` tag: the custodian adds the agent's NIP-OA tag itself.
- `required`: tags that must be there.
- `repeats`: tags that may appear more than once, and how often at most (None: as often as
  the frame holds); every other tag appears once at most.
- `signer`: AGENT (any live agent for itself) or OWNER (the event is about an agent named
  in `about`, and the signer must be that agent's recorded owner: NIP-BA's managed-agent
  records are the owner's).
- `links`: tag name -> what its first value must be: "owner" (the signer's own recorded
  owner) or "self" (the signer).
- `values`: tag name (a required one) -> the one value it may carry.
`check` returns None for an intent that fits, else one line saying which rule it broke.
Every intent's `created_at`, AUTH's included, is at most `MAX_FUTURE_SECONDS` ahead of the
custodian's clock (the server checks it: this module has no clock).
"""

from __future__ import annotations

import json
from buzzwire import kinds
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

__all__ = ["KINDS", "AGENT", "OWNER", "Shape", "check"]

AGENT: Final = "agent"
OWNER: Final = "owner"

KIND_MANAGED_AGENT: Final = kinds.MANAGED_AGENT
#: How far ahead of the custodian's clock created_at may be: an hour. A replaceable event
#: (0, 30174, 30177) dated further would beat every later version on every relay. The
#: daemon dates an event ahead only to follow a version already ahead (one second past it:
#: daemon/operations/_events.py), a memory write at most NIP-AE's clock-poison 900 s.
MAX_FUTURE_SECONDS: Final = 3600


@dataclass(frozen=True, slots=True)
class Shape:
    tags: Mapping[str, tuple[int, int]]
    signer: str = AGENT
    required: frozenset[str] = frozenset()
    links: Mapping[str, str] = field(default_factory=dict)
    #: OWNER rows: the tag whose value names the agent (for `a`, the coordinate's last part)
    about: str | None = None
    json_content: bool = False
    values: Mapping[str, str] = field(default_factory=dict)
    repeats: Mapping[str, int | None] = field(default_factory=dict)


KINDS: Final[Mapping[int, Shape]] = MappingProxyType({
    kinds.METADATA: Shape(tags={}, json_content=True),                       # profile.set, agents.create
    kinds.DELETION: Shape(tags={"a": (1, 1), "k": (1, 1)}, signer=OWNER,     # agents.delete
             required=frozenset({"a", "k"}), about="a"),
    kinds.REACTION: Shape(tags={"e": (1, 1), "h": (1, 1)},                  # reaction.add
             required=frozenset({"e", "h"})),
    kinds.STREAM_MESSAGE: Shape(tags={"h": (1, 1), "e": (1, 3), "p": (1, 2)},      # message.post/reply
             required=frozenset({"h"}), repeats={"e": 2, "p": None}),  # root, parent; mentions
    kinds.PUT_USER: Shape(tags={"h": (1, 1), "p": (1, 1), "role": (1, 1)},  # agents.create put-user
                signer=OWNER, required=frozenset({"h", "p", "role"}), about="p",
                values={"role": kinds.PUT_USER_ROLE}),  # never admin: the owner's key signs it
    kinds.PRESENCE: Shape(tags={}),                                      # presence.set
    kinds.TYPING: Shape(tags={"h": (1, 1)}, required=frozenset({"h"})),  # typing.set
    kinds.OBSERVER_FRAME: Shape(tags={"p": (1, 1), "agent": (1, 1), "frame": (1, 1)},  # observer.emit
                 required=frozenset({"p", "agent", "frame"}),
                 links={"p": "owner", "agent": "self"}, values={"frame": "telemetry"}),
    kinds.MEMORY: Shape(tags={"d": (1, 1), "p": (1, 1)},               # storage.put (NIP-AE)
                 required=frozenset({"d", "p"}), links={"p": "owner"}),
    kinds.MANAGED_AGENT: Shape(tags={"d": (1, 1)}, signer=OWNER,              # agents.create/update
                 required=frozenset({"d"}), about="d", json_content=True),
})


def _about(shape: Shape, tags: Mapping[str, tuple[str, ...]], signer: str) -> str | None:
    """The agent an OWNER event is about, or None if its tag does not name one."""
    if shape.about is None:
        return None
    value = tags[shape.about][0]
    if shape.about == "a":  # "30177:<owner>:<agent>"
        parts = value.split(":")
        if len(parts) != 3 or parts[0] != str(KIND_MANAGED_AGENT) or parts[1] != signer:
            return None
        if tags.get("k", ("",))[0] != str(KIND_MANAGED_AGENT):
            return None
        return parts[2]
    return value


def check(signer: str, kind: int, tags: tuple[tuple[str, ...], ...], content: str,
          owner_of: Callable[[str], str | None]) -> str | None:
    """None if the intent fits `KINDS`, else the rule it breaks.

    `owner_of(pubkey)` is the recorded owner of a live agent held here, else None.
    """
    shape = KINDS.get(kind)
    if shape is None:
        return f"kind {kind} is not one the custodian signs"
    seen: dict[str, tuple[str, ...]] = {}
    count: dict[str, int] = {}
    for tag in tags:
        name, values = tag[0], tag[1:]
        bounds = shape.tags.get(name)
        if bounds is None:  # the name cut: the answer and the custodian's log echo it
            return f"kind {kind} carries no {name[:64]!r} tag" + (
                " (the custodian adds the NIP-OA tag)" if name == "auth" else "")
        if not bounds[0] <= len(values) <= bounds[1]:
            return f"kind {kind}: tag {name!r} has {len(values)} values"
        count[name] = count.get(name, 0) + 1
        most = shape.repeats.get(name, 1)
        if most is not None and count[name] > most:
            return f"kind {kind}: tag {name!r} " + ("twice" if most == 1 else f"{count[name]} times")
        seen.setdefault(name, values)
    missing = shape.required - seen.keys()
    if missing:
        return f"kind {kind} needs the tags {sorted(missing)}"
    if shape.json_content:
        try:
            if not isinstance(json.loads(content), dict):
                return f"kind {kind}: content is not a JSON object"
        except (ValueError, RecursionError):
            return f"kind {kind}: content is not a JSON object"
    if shape.signer == OWNER:
        about = _about(shape, seen, signer)
        if about is None or owner_of(about) != signer:
            return f"kind {kind} is signed only by the recorded owner of the agent it names"
    elif owner_of(signer) is None:
        return "the signer is no live agent held here"
    for name, rule in shape.links.items():
        wanted = owner_of(signer) if rule == "owner" else signer
        if seen[name][0] != wanted:
            return f"kind {kind}: tag {name!r} must name the signer's {'owner' if rule == 'owner' else 'own key'}"
    for name, value in shape.values.items():
        if seen[name][0] != value:
            return f"kind {kind}: tag {name!r} must be {value!r}"
    return None
