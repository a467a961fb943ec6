"""NIP-AE encrypted-memory addresses: the conversation key K_c and the d-tag of a slug.

Rules (buzz-on-the-relay.md, "Encrypted memory address"):
- K_c = NIP-44 v2 conversation key(agent secret, owner pubkey) (`_nip44.conversation_key`,
  the one derivation: the d-tags and the record encryption use the same key).
- d = lower_hex(HMAC-SHA256(K_c, utf8("agent-memory/v1/d-tag") || 0x00 || utf8(slug))).
- K_c is a secret (it decrypts the agent's memory). It exists only inside `d_tag` and the
  facade's encrypt/decrypt hops, is wiped before they return (best effort, see _secret),
  and only the d-tag (public: it is published on the relay) leaves.
- Slugs: `core`, or `^mem/[a-z0-9][a-z0-9_-]{0,63}(/[a-z0-9][a-z0-9_-]{0,63})*$`, at most
  255 bytes. A bad slug is the caller's bug (the contract validates first): ValueError.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from buzzwire import kinds

from custody._nip44 import conversation_key
from custody._records import MemoryAddress
from custody._secret import Secret, wipe_bytes

__all__ = ["MEMORY_KIND", "MemoryAddress", "check_slug", "d_tag", "d_tag_of"]

#: NIP-AE agent memory events are kind 30174 (parameterized replaceable).
MEMORY_KIND = kinds.MEMORY
_D_TAG_LABEL = b"agent-memory/v1/d-tag"
_SLUG = re.compile(r"core|mem/[a-z0-9][a-z0-9_-]{0,63}(/[a-z0-9][a-z0-9_-]{0,63})*")
#: NIP-AE bound on a slug's length.
MAX_SLUG_BYTES = 255


def check_slug(slug: str) -> None:
    if not isinstance(slug, str) or not _SLUG.fullmatch(slug) or len(slug.encode()) > MAX_SLUG_BYTES:
        raise ValueError("slug must be 'core' or mem/<segments> (NIP-AE), at most 255 bytes")


def d_tag(agent_secret: Secret, owner_pubkey: str, slug: str) -> str:
    """NIP-AE d-tag for `slug` of the agent whose (checked) secret is given."""
    check_slug(slug)
    k_c = conversation_key(agent_secret, owner_pubkey)
    try:
        return d_tag_of(k_c, slug)
    finally:
        wipe_bytes(k_c)


def d_tag_of(k_c: bytes, slug: str) -> str:
    """The d-tag of `slug` under an already derived K_c (the caller wipes K_c)."""
    check_slug(slug)
    return hmac.digest(k_c, _D_TAG_LABEL + b"\x00" + slug.encode(), hashlib.sha256).hex()

