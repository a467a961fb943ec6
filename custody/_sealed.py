"""The sealed-key format, and the only way a sealed key is opened.

Format v1 (stored as one SQLite BLOB):
    version (1 byte, 0x01) || IV (12 bytes) || AES-256-GCM ciphertext (32) || tag (16)
AAD = utf8("buzz-broker/agent-key/v1:") || agent pubkey (32 raw bytes)
The AAD binds the blob to its format version and its agent: a blob copied onto another
agent's record, or relabelled with another version byte, fails GCM authentication.

`unseal` is the one door, in this order (style.md rule 13): read the header (unverified),
authenticate and decrypt in the token, re-derive the pubkey from the plaintext and compare
it with the agent asked for; only then does the caller get a `Secret`. Every failure is the
same opaque `UnsealFailed`; the cause's type name goes to the log, nothing else.

WARNING: a v2 must keep v1 readable, and must change both `FORMAT_VERSION` and the AAD
label in the same commit.
"""

from __future__ import annotations

import hmac
import logging

import pkcs11

from custody._errors import UnsealFailed
from custody._secp256k1 import xonly_pubkey
from custody._secret import Secret
from custody._token import GCM_IV_BYTES, Token

__all__ = ["FORMAT_VERSION", "seal", "unseal"]

log = logging.getLogger("buzz_broker.custody")

FORMAT_VERSION = 1
_AAD_LABEL = b"buzz-broker/agent-key/v1:"
_SEALED_BYTES = 32 + 16  # ciphertext of a 32-byte key + 128-bit GCM tag


def _aad(agent: str) -> bytes:
    return _AAD_LABEL + bytes.fromhex(agent)


def seal(token: Token, secret: Secret, agent: str) -> bytes:
    """Seal `secret` (whose pubkey is `agent`) into a v1 blob."""
    iv, sealed = token.seal(secret, _aad(agent))
    return bytes([FORMAT_VERSION]) + iv + sealed


def _split_unverified(blob: bytes) -> tuple[int, bytes, bytes]:
    """Header fields read before authentication: trust none of them until GCM agrees."""
    if len(blob) != 1 + GCM_IV_BYTES + _SEALED_BYTES:
        raise ValueError("sealed blob has the wrong length")
    return blob[0], blob[1 : 1 + GCM_IV_BYTES], blob[1 + GCM_IV_BYTES :]


def unseal(token: Token, blob: bytes, agent: str) -> Secret:
    """Open `blob` as `agent`'s secret key, or raise UnsealFailed.

    Returns a Secret the caller must wipe (use it as a context manager).
    """
    try:
        version, iv, sealed = _split_unverified(blob)
        if version != FORMAT_VERSION:
            raise ValueError("unknown sealed-key format version")
        secret = token.open_sealed(iv, sealed, _aad(agent))
    except (ValueError, pkcs11.PKCS11Error) as exc:
        log.warning("unseal failed for agent %s (%s)", agent, type(exc).__name__)
        raise UnsealFailed(agent) from None
    try:
        derived = xonly_pubkey(secret)
    except ValueError:
        derived = b""
    if not hmac.compare_digest(derived, bytes.fromhex(agent)):
        secret.wipe()
        log.warning("unseal failed for agent %s (pubkey mismatch)", agent)
        raise UnsealFailed(agent)
    return secret
