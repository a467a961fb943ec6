"""The sealed-key formats, the two seals, and the only way a sealed key is opened.

Format 2 (every new blob; one SQLite BLOB):
    offset  size  field
    0       1     version 0x02
    1       1     seal kind: 0x01 AES-256-GCM, 0x02 encrypt-then-MAC (`SEAL_CODES`)
    2       1     n = length of the KEK label, 1..255 (`_token.MAX_KEK_LABEL`)
    3       n     KEK label, printable ASCII (0x20-0x7E): the KEK the blob is sealed under
    3+n     12    nonce (GCM: the IV), random per seal, from the OS CSPRNG
    15+n    32    ciphertext of the 32-byte agent key
    47+n    16|32 tag: the GCM tag, or the HMAC-SHA256
AAD = "buzz-broker/agent-key/v2" 0x00 || bytes[0:3+n] (the header) || agent pubkey (32 raw)
The AAD binds format, seal kind, KEK and agent: a blob copied onto another agent's
record, or whose header is edited to name another seal or KEK, fails authentication.

Format 1 (blobs written before format 2; still opened, never written):
    0x01 || IV (12) || AES-256-GCM ciphertext (32) || tag (16), under the configured KEK
    (`Token.legacy_kek`), AAD = "buzz-broker/agent-key/v1:" || agent pubkey (32 raw).

The encrypt-then-MAC seal (every token tried has its mechanisms; field-lab.md):
- keystream = AES-256-ECB in the token over the counter blocks nonce || BE32(0),
  nonce || BE32(1): byte for byte AES-CTR with the initial block nonce || 0^32
  (tests/custody/test_seal_kinds.py checks it against `cryptography`'s AES-CTR);
- ciphertext = key XOR keystream; tag = HMAC-SHA256 under the KEK's HMAC key (`L-mac`)
  over BE32(len(AAD)) || AAD || nonce || ciphertext (nonce and ciphertext have fixed
  lengths, so the input is unambiguous);
- opening computes the tag in the token and compares it with `hmac.compare_digest`
  BEFORE the keystream is asked for: nothing is decrypted from an unauthenticated blob.
The AES key of a KEK may serve both seals (a configuration switched from "gcm" to "etm").
GCM's counter blocks are IV || BE32(1..3) and ours nonce || BE32(0..1); they meet only if a
GCM IV equals an EtM nonce, two random 96-bit values (about n²/2^97 for n blobs).

`unseal` is the one door, in this order (style.md rule 13), each step a named defence
(`DEFENCES`):
  format          read the header (unverified): length, version, seal kind, KEK label
  kek             the KEK the blob names is in the token and passes its attribute checks
  authentication  the GCM tag or the HMAC over the AAD and ciphertext verifies
  pubkey          the key opened re-derives the pubkey of the agent asked for
Only then does the caller get a `Secret`. Every refusal is the same opaque `UnsealFailed`
for the caller (and so for any agent); the operator log alone says which defence refused.
A token that fails while opening (its handles gone after the one retry, or any PKCS#11
error around encrypt-then-MAC, whose MAC takes any bytes) is no verdict on the blob: the
same `UnsealFailed`, logged as "the token failed (<error>)". A token that cannot be
logged in to again is a `CustodyError`.

`seal` trusts its caller that `agent` is the secret's own pubkey (the facade derives it
from the secret): the tests use that to build blobs that exactly one defence can catch.

WARNING: a format 3 must keep 1 and 2 readable and take a new AAD label.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import pkcs11
from coincurve._libsecp256k1 import ffi

from custody._errors import CustodyError, UnsealFailed
from custody._secp256k1 import xonly_pubkey
from custody._secret import SECRET_SIZE, Secret, wipe_bytes
from custody._token import (
    GCM_IV_BYTES,
    STALE_HANDLE_ERRORS,
    KekRefused,
    Token,
    kek_label_ok,
)

__all__ = ["DEFENCES", "FORMAT_VERSION", "SEAL_CODES", "seal", "unseal"]

log = logging.getLogger("buzz_broker.custody")

FORMAT_VERSION = 2
_FORMAT_1 = 1
_AAD_LABEL = b"buzz-broker/agent-key/v2\x00"
_AAD_LABEL_1 = b"buzz-broker/agent-key/v1:"
#: Seal kind -> its header byte.
SEAL_CODES: dict[str, int] = {"gcm": 0x01, "etm": 0x02}
_KIND_BY_CODE = {code: kind for kind, code in SEAL_CODES.items()}
#: Seal kind -> tag length.
_TAG_BYTES: dict[str, int] = {"gcm": 16, "etm": 32}
_HEADER_FIXED = 3
_BLOCK = 16

#: The defences `unseal` applies, in order; a refusal's log line names one.
DEFENCES: dict[str, str] = {
    "format": "the blob's header is unreadable (length, version, seal kind or KEK label)",
    "kek": "the KEK the blob names is not in the token or fails its attribute checks",
    "authentication": "the tag over the header, the agent's pubkey and the ciphertext did "
                      "not verify (AES-GCM tag or HMAC-SHA256)",
    "pubkey": "the key opened does not derive the pubkey of the agent asked for",
}


class _TokenFault(Exception):
    """The token failed while opening (not a verdict on the blob). Becomes UnsealFailed."""


class _Refused(Exception):
    """One defence refused the blob. Never leaves this module (becomes UnsealFailed)."""

    def __init__(self, defence: str, detail: str) -> None:
        super().__init__(defence)
        self.defence = defence
        self.detail = detail


@dataclass(frozen=True, slots=True)
class _Blob:
    """A blob's fields, read before authentication: trust none until the tag agrees."""

    seal: str
    kek: str
    aad: bytes
    nonce: bytes
    body: bytes  # ciphertext || tag


def _header(seal_kind: str, kek: str) -> bytes:
    label = kek.encode("ascii")
    return bytes([FORMAT_VERSION, SEAL_CODES[seal_kind], len(label)]) + label


def _aad(header: bytes, agent: str) -> bytes:
    return _AAD_LABEL + header + bytes.fromhex(agent)


def _parse(token: Token, blob: bytes, agent: str) -> _Blob:
    if not blob:
        raise _Refused("format", "empty")
    if blob[0] == _FORMAT_1:
        if len(blob) != 1 + GCM_IV_BYTES + SECRET_SIZE + _TAG_BYTES["gcm"]:
            raise _Refused("format", "format 1 of the wrong length")
        return _Blob("gcm", token.legacy_kek, _AAD_LABEL_1 + bytes.fromhex(agent),
                     blob[1:1 + GCM_IV_BYTES], blob[1 + GCM_IV_BYTES:])
    if blob[0] != FORMAT_VERSION or len(blob) < _HEADER_FIXED:
        raise _Refused("format", "unknown version")
    kind = _KIND_BY_CODE.get(blob[1])
    if kind is None:
        raise _Refused("format", "unknown seal kind")
    end = _HEADER_FIXED + blob[2]
    try:
        kek = blob[_HEADER_FIXED:end].decode("ascii")
    except UnicodeDecodeError:
        raise _Refused("format", "KEK label is not ASCII") from None
    if not kek_label_ok(kek):
        raise _Refused("format", "bad KEK label")
    if len(blob) != end + GCM_IV_BYTES + SECRET_SIZE + _TAG_BYTES[kind]:
        raise _Refused("format", "wrong length")
    return _Blob(kind, kek, _aad(blob[:end], agent), blob[end:end + GCM_IV_BYTES],
                 blob[end + GCM_IV_BYTES:])


# --- the seals ----------------------------------------------------------------------------

def _counter_blocks(nonce: bytes) -> bytes:
    return b"".join(nonce + i.to_bytes(4, "big") for i in range(SECRET_SIZE // _BLOCK))


def _mac_input(aad: bytes, nonce: bytes, ciphertext: bytes) -> bytes:
    return len(aad).to_bytes(4, "big") + aad + nonce + ciphertext


def _gcm_seal(token: Token, kek: str, nonce: bytes, plaintext: bytearray, aad: bytes) -> bytes:
    return token.gcm_encrypt(kek, nonce, plaintext, aad)


def _etm_seal(token: Token, kek: str, nonce: bytes, plaintext: bytearray, aad: bytes) -> bytes:
    keystream = token.keystream(kek, _counter_blocks(nonce))
    try:
        ciphertext = bytes(p ^ k for p, k in zip(plaintext, keystream, strict=True))
    finally:
        wipe_bytes(keystream)
    return ciphertext + token.mac(kek, _mac_input(aad, nonce, ciphertext))


def _gcm_open(token: Token, blob: _Blob, secret: Secret) -> None:
    try:
        plaintext = token.gcm_decrypt(blob.kek, blob.nonce, blob.body, blob.aad)
    except STALE_HANDLE_ERRORS as exc:
        raise _TokenFault(type(exc).__name__) from None
    except pkcs11.PKCS11Error as exc:
        # SoftHSM reports a wrong tag or AAD as a generic error: the token refused the blob.
        raise _Refused("authentication", type(exc).__name__) from None
    try:
        if len(plaintext) != SECRET_SIZE:
            raise _Refused("format", "wrong plaintext length")
        ffi.memmove(secret.cdata, plaintext, SECRET_SIZE)
    finally:
        wipe_bytes(plaintext)


def _etm_open(token: Token, blob: _Blob, secret: Secret) -> None:
    ciphertext, tag = blob.body[:SECRET_SIZE], blob.body[SECRET_SIZE:]
    expected = token.mac(blob.kek, _mac_input(blob.aad, blob.nonce, ciphertext))
    if not hmac.compare_digest(expected, tag):
        raise _Refused("authentication", "HMAC mismatch")
    keystream = token.keystream(blob.kek, _counter_blocks(blob.nonce))
    try:
        buffer = secret.cdata
        for i in range(SECRET_SIZE):  # straight into the C buffer: no plaintext object
            buffer[i] = ciphertext[i] ^ keystream[i]
    finally:
        wipe_bytes(keystream)


_SEALERS: dict[str, Callable[[Token, str, bytes, bytearray, bytes], bytes]] = {
    "gcm": _gcm_seal,
    "etm": _etm_seal,
}
_OPENERS: dict[str, Callable[[Token, _Blob, Secret], None]] = {
    "gcm": _gcm_open,
    "etm": _etm_open,
}


def seal(token: Token, secret: Secret, agent: str) -> bytes:
    """Seal `secret` (whose pubkey is `agent`) into a format-2 blob under the token's
    active KEK, with the token's seal kind.

    Raises:
        CustodyError: the token refused to seal.
    """
    header = _header(token.seal, token.active)
    nonce = secrets.token_bytes(GCM_IV_BYTES)
    # A bytearray we zero afterwards: python-pkcs11 needs bytes/bytearray, not a C buffer.
    plaintext = bytearray(SECRET_SIZE)
    try:
        ffi.memmove(plaintext, secret.cdata, SECRET_SIZE)
        body = _SEALERS[token.seal](token, token.active, nonce, plaintext, _aad(header, agent))
    except (pkcs11.PKCS11Error, KekRefused) as exc:
        raise CustodyError(f"token refused to seal ({type(exc).__name__})") from None
    finally:
        ffi.memmove(plaintext, bytes(SECRET_SIZE), SECRET_SIZE)
    return header + nonce + body


def unseal(token: Token, blob: bytes, agent: str) -> Secret:
    """Open `blob` as `agent`'s secret key, or raise UnsealFailed (module docstring).

    Returns a Secret the caller must wipe (use it as a context manager).

    Raises:
        UnsealFailed: a defence refused the blob (the operator log names which).
        CustodyError: the token itself failed (gone, PIN no longer accepted).
    """
    secret = Secret()
    try:
        parsed = _parse(token, blob, agent)
        try:
            _OPENERS[parsed.seal](token, parsed, secret)
        except KekRefused as exc:
            raise _Refused("kek", str(exc)) from None
        except pkcs11.PKCS11Error as exc:
            # EtM computes its MAC over any bytes: an error here is the token's, not the blob's.
            raise _TokenFault(type(exc).__name__) from None
        try:
            derived = xonly_pubkey(secret)
        except ValueError:
            derived = b""
        if not hmac.compare_digest(derived, bytes.fromhex(agent)):
            raise _Refused("pubkey", "re-derived pubkey differs")
    except _Refused as refused:
        secret.wipe()
        log.warning("unseal refused for agent %s by the %s defence (%s)", agent,
                    refused.defence, refused.detail)
        raise UnsealFailed(agent) from None
    except _TokenFault as fault:
        secret.wipe()
        log.warning("unseal failed for agent %s: the token failed (%s)", agent, fault)
        raise UnsealFailed(agent) from None
    except BaseException:
        secret.wipe()
        raise
    return secret
