"""The signer: NIP-01 events, NIP-42 AUTH events and NIP-OA owner tags, from an open Secret.

Rules:
- Callers hand in a `Secret` that `_sealed.unseal` already checked against the agent's
  pubkey; this module signs and returns public values. It never keeps a Secret.
- BIP-340 with 32 bytes of fresh aux randomness per signature (BIP-340's recommendation:
  it hardens against fault and side-channel attacks). A private `_aux` seam fixes it for
  test vectors; production code never passes it.
- NIP-OA (buzz-on-the-relay.md, "Ownership tag"): an owned agent carries its owner's `auth`
  tag on every event it signs, exactly once. `with_owner_tag` appends the stored tag when
  the event has none; a caller-supplied `auth` tag is accepted only if it is that exact
  tag (it is then kept once, in place); any other `auth` tag is refused with ValueError.
  Refusing rather than replacing: a foreign ownership claim in a request is a bug or an
  attack, and silently rewriting it would hide either.
- Conditions (issue 22 L5): NIP-OA lets an owner sign a tag with conditions limiting what
  the agent may sign; this host adds the one stored tag to every kind it signs and reads
  no conditions, so a tag with non-empty conditions would be carried where its owner did
  not allow it. `owner_tag_fault` refuses one wherever a tag enters (import, attach-auth,
  restore); Buzz signs with conditions "" only.
- NIP-42 AUTH: kind 22242, tags `["relay", url]` and `["challenge", c]`, empty content; an
  owned agent's AUTH event carries its owner tag too (it is an event the agent signs).
"""

from __future__ import annotations

import secrets

from collections.abc import Sequence

from buzzwire import kinds
from buzzwire.nostr import (
    SignedEvent, Tags, UnsignedEvent, compute_event_id, owner_tag_digest, verify_owner_tag,
)
from custody._records import OWNER_TAG_CONDITIONS
from custody._secp256k1 import schnorr_sign
from custody._secret import Secret

__all__ = ["AUTH_KIND", "auth_event", "make_owner_tag", "owner_tag_fault", "sign",
           "with_owner_tag"]

#: NIP-42 client authentication event kind.
AUTH_KIND = kinds.AUTH

OwnerTag = tuple[str, str, str, str]

#: `owner_tag_fault`'s answer for a tag with conditions (restore keeps its own words for
#: the other faults, so it tells this one apart).
CONDITIONS_FAULT = ('auth tag has NIP-OA conditions; this host puts the tag on every kind it '
                    'signs and cannot honour them, so only conditions "" (as Buzz) are accepted')



def owner_tag_fault(tag: Sequence[object], *, agent: str, owner: str) -> str | None:
    """Why `tag` cannot be `agent`'s stored NIP-OA tag under `owner`, or None: the one
    check every path a tag enters by (import, attach-auth, restore) makes.

    Order: shape, owner, conditions, signature, so the answer names the first fault.
    """
    if len(tag) != 4 or not all(isinstance(item, str) for item in tag) or tag[0] != "auth":
        return 'auth tag must be ["auth", owner, conditions, sig]'
    if tag[1] != owner:
        return "auth tag names another owner than the agent's"
    if tag[2] != OWNER_TAG_CONDITIONS:
        return CONDITIONS_FAULT
    if not verify_owner_tag([str(item) for item in tag], agent):
        return "auth tag does not verify for this agent and owner"
    return None

def sign(secret: Secret, unsigned: UnsignedEvent, *, _aux: bytes | None = None) -> SignedEvent:
    """Sign `unsigned` with `secret` (whose pubkey the caller has checked equals unsigned.pubkey)."""
    event_id = compute_event_id(
        unsigned.pubkey, unsigned.created_at, unsigned.kind, unsigned.tags, unsigned.content
    )
    aux = secrets.token_bytes(32) if _aux is None else _aux
    sig = schnorr_sign(secret, bytes.fromhex(event_id), aux)
    return SignedEvent(
        id=event_id,
        pubkey=unsigned.pubkey,
        created_at=unsigned.created_at,
        kind=unsigned.kind,
        tags=unsigned.tags,
        content=unsigned.content,
        sig=sig.hex(),
    )


def with_owner_tag(unsigned: UnsignedEvent, owner_tag: OwnerTag | None) -> UnsignedEvent:
    """`unsigned` carrying `owner_tag` exactly once (see module rules).

    Raises:
        ValueError: the caller put an `auth` tag on the event that is not the agent's own.
    """
    present = [tag for tag in unsigned.tags if tag[:1] == ("auth",)]
    if owner_tag is None:
        if present:
            raise ValueError("event carries an auth tag but the agent has no owner tag")
        return unsigned
    if any(tag != owner_tag for tag in present) or len(present) > 1:
        raise ValueError("event carries an auth tag that is not the agent's owner tag")
    if present:
        return unsigned
    tags: Tags = unsigned.tags + (owner_tag,)
    return UnsignedEvent(unsigned.pubkey, unsigned.created_at, unsigned.kind, tags, unsigned.content)


def auth_event(
    agent: str, relay_url: str, challenge: str, created_at: int, owner_tag: OwnerTag | None
) -> UnsignedEvent:
    """The NIP-42 AUTH event to sign. `relay_url` is used exactly as configured (Buzz
    compares it byte for byte with its own URL)."""
    if not isinstance(relay_url, str) or not relay_url:
        raise ValueError("relay_url must be a non-empty str")
    if not isinstance(challenge, str):
        raise TypeError("challenge must be str")
    unsigned = UnsignedEvent(
        agent, created_at, AUTH_KIND, (("relay", relay_url), ("challenge", challenge)), ""
    )
    return with_owner_tag(unsigned, owner_tag)


def make_owner_tag(
    owner_secret: Secret, owner: str, agent: str, *, _aux: bytes | None = None
) -> OwnerTag:
    """NIP-OA `["auth", owner, "", sig]` for `agent`, signed by the owner's (checked) secret."""
    if owner == agent:
        raise ValueError("an agent cannot own itself (NIP-OA: owner != agent)")
    aux = secrets.token_bytes(32) if _aux is None else _aux
    sig = schnorr_sign(owner_secret, owner_tag_digest(agent, OWNER_TAG_CONDITIONS), aux)
    return ("auth", owner, OWNER_TAG_CONDITIONS, sig.hex())
