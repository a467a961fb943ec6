"""NIP-AE encrypted-memory addresses: the conversation key K_c and the d-tag of a slug.

Rules (buzz-on-the-relay.md, "Encrypted memory address"):
- K_c = NIP-44 v2 conversation key(agent secret, owner pubkey)
      = HMAC-SHA256(key=utf8("nip44-v2"), msg=raw x of ECDH(agent secret, owner pubkey)).
  The raw x, NOT sha256(x): libsecp256k1's own ECDH hashes, so `_secp256k1.ecdh_x` multiplies.
- d = lower_hex(HMAC-SHA256(K_c, utf8("agent-memory/v1/d-tag") || 0x00 || utf8(slug))).
- K_c is a secret (it decrypts the agent's memory). It exists only inside `d_tag`, is
  wiped before return (best effort, see _secret), and only the d-tag (public: it is
  published on the relay) leaves.
- Slugs: `core`, or `^mem/[a-z0-9][a-z0-9_-]{0,63}(/[a-z0-9][a-z0-9_-]{0,63})*$`, at most
  255 bytes. A bad slug is the caller's bug (the contract validates first): ValueError.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from coincurve._libsecp256k1 import ffi

from custody._secp256k1 import ecdh_x
from custody._secret import Secret, wipe_bytes

__all__ = ["MEMORY_KIND", "MemoryAddress", "check_slug", "d_tag"]

#: NIP-AE agent memory events are kind 30174 (parameterized replaceable).
MEMORY_KIND = 30174
_NIP44_SALT = b"nip44-v2"
_D_TAG_LABEL = b"agent-memory/v1/d-tag"
_SLUG = re.compile(r"core|mem/[a-z0-9][a-z0-9_-]{0,63}(/[a-z0-9][a-z0-9_-]{0,63})*")
#: NIP-AE bound on a slug's length.
MAX_SLUG_BYTES = 255


@dataclass(frozen=True, slots=True)
class MemoryAddress:
    """Where an agent's memory note lives on the relay. Public."""

    author_pubkey: str
    kind: int
    d_tag: str


def check_slug(slug: str) -> None:
    if not isinstance(slug, str) or not _SLUG.fullmatch(slug) or len(slug.encode()) > MAX_SLUG_BYTES:
        raise ValueError("slug must be 'core' or mem/<segments> (NIP-AE), at most 255 bytes")


def d_tag(agent_secret: Secret, owner_pubkey: str, slug: str) -> str:
    """NIP-AE d-tag for `slug` of the agent whose (checked) secret is given."""
    check_slug(slug)
    k_c = _conversation_key(agent_secret, owner_pubkey)
    try:
        return hmac.digest(k_c, _D_TAG_LABEL + b"\x00" + slug.encode(), hashlib.sha256).hex()
    finally:
        wipe_bytes(k_c)


def _conversation_key(agent_secret: Secret, owner_pubkey: str) -> bytes:
    """K_c. Private: only `d_tag` (which wipes it) and the K_c vector test call this."""
    with ecdh_x(agent_secret, bytes.fromhex(owner_pubkey)) as shared_x:
        # hmac copies its message into OpenSSL state; see _secret's docstring.
        return hmac.digest(_NIP44_SALT, ffi.buffer(shared_x.cdata), hashlib.sha256)
