"""NIP-44 v2 encrypted payloads: conversation key, message keys, padding, encrypt, decrypt.

Rules (nostr-protocol/nips 44.md, version 2):
- conversation key = HKDF-extract(SHA-256, IKM = raw x of ECDH(secret, peer), salt =
  utf8("nip44-v2")) = HMAC-SHA256(key = salt, msg = x). It is symmetric: conv(a, B) ==
  conv(b, A). It is a secret; whoever calls `conversation_key` wipes it (`wipe_bytes`).
- message keys = HKDF-expand(SHA-256, PRK = conversation key, info = nonce, L = 76), cut
  into chacha_key [0:32], chacha_nonce [32:44], hmac_key [44:76].
- padded = u16 big-endian plaintext length || plaintext || zeros, to `padded_length`.
- ciphertext = ChaCha20 (IETF, counter 0) of padded; mac = HMAC-SHA256(hmac_key, nonce ||
  ciphertext) (the nonce is the AAD); payload = base64(0x02 || nonce || ciphertext || mac).
- Decrypt checks, in NIP-44's order, before any decryption: '#' first means a future
  encoding (unsupported version), payload length 132..87,472 characters, strict base64,
  decoded length 99..65,603 bytes, version byte 2; then the MAC in constant time; then,
  after decrypting, the length prefix (1..65,535, equal to what the padding holds) and the
  padding's exact size.
- Plaintexts are 1..65,535 bytes. NIP-44 says they are UTF-8 text; these functions carry
  bytes, and each caller decodes (strictly) what it reads.

Pure functions: no I/O, no randomness. The nonce is an argument (the vectors pin it); the
one production caller (`_facade`) draws it from the OS CSPRNG for every payload.

Errors, cryptography's Fernet way: every untrusted payload that does not open raises the
one opaque `DecryptFailed` (no oracle between a bad MAC and bad padding), except the
version refusal NIP-44 asks to be told apart, `UnsupportedVersion` (a subclass). A bad
argument of our own (a plaintext out of bounds, a 31-byte nonce) is a ValueError.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from coincurve._libsecp256k1 import ffi
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from custody._secp256k1 import ecdh_x
from custody._secret import Secret, wipe_bytes

__all__ = [
    "MAX_PLAINTEXT",
    "MIN_PLAINTEXT",
    "NONCE_SIZE",
    "DecryptFailed",
    "UnsupportedVersion",
    "conversation_key",
    "decrypt",
    "encrypt",
    "message_keys",
    "padded_length",
]

VERSION = 2
_SALT = b"nip44-v2"
#: NIP-44 v2 plaintext bounds, in bytes (a u16 length prefix, and 0 is refused).
MIN_PLAINTEXT = 1
MAX_PLAINTEXT = 65_535
NONCE_SIZE = 32
_KEY_SIZE = 32
_MAC_SIZE = 32
#: NIP-44's bounds on the base64 text and on its decoding, checked before decoding (the
#: first keeps a hostile relay from making us decode megabytes).
_MIN_PAYLOAD_CHARS, _MAX_PAYLOAD_CHARS = 132, 87_472
_MIN_DECODED, _MAX_DECODED = 99, 65_603


class DecryptFailed(ValueError):
    """A NIP-44 payload that does not open. Deliberately says nothing more."""

    def __init__(self) -> None:
        super().__init__("NIP-44 payload does not decrypt")


class UnsupportedVersion(DecryptFailed):
    """A payload of an encryption version (or encoding) other than v2."""

    def __init__(self) -> None:
        ValueError.__init__(self, "NIP-44 payload of an unsupported version")


def conversation_key(secret: Secret, peer_pubkey: str) -> bytes:
    """The NIP-44 v2 conversation key of `secret` and the x-only `peer_pubkey` (hex).

    A secret: the caller wipes it (`wipe_bytes`) as soon as it is done with it.

    Raises:
        ValueError: `peer_pubkey` is not an x-only point, or `secret` is not a scalar.
    """
    with ecdh_x(secret, bytes.fromhex(peer_pubkey)) as shared_x:
        # hmac copies its message into OpenSSL state; see _secret's docstring.
        return hmac.digest(_SALT, ffi.buffer(shared_x.cdata), hashlib.sha256)


def message_keys(conv_key: bytes, nonce: bytes) -> tuple[bytes, bytes, bytes]:
    """(chacha_key, chacha_nonce, hmac_key) for one payload. All three are secret."""
    if len(conv_key) != _KEY_SIZE or len(nonce) != NONCE_SIZE:
        raise ValueError("NIP-44 message keys take a 32-byte conversation key and nonce")
    okm = HKDFExpand(algorithm=SHA256(), length=76, info=nonce).derive(conv_key)
    try:
        return okm[0:32], okm[32:44], okm[44:76]
    finally:
        wipe_bytes(okm)


def padded_length(unpadded: int) -> int:
    """NIP-44's padded size: 32 at least, then steps of 32 up to 256 bytes and of an eighth
    of the next power of two above. Defined for any positive length (the vectors go past
    65,535); `encrypt` bounds the plaintext itself."""
    if unpadded < 1:
        raise ValueError("a padded length is defined for 1 byte or more")
    if unpadded <= 32:
        return 32
    next_power = 1 << (unpadded - 1).bit_length()
    chunk = 32 if next_power <= 256 else next_power // 8
    return chunk * ((unpadded - 1) // chunk + 1)


def _chacha20(key: bytes, nonce12: bytes, data: bytes) -> bytes:
    try:
        return _chacha20_once(key, nonce12, data)
    finally:
        # OpenSSL's ChaCha20 (4.0, which cryptography 50 bundles) leaves the key on the
        # calling thread's stack, where nothing frees or overwrites it
        # (tests/custodian/test_custodian_memory.py found it). The same call again, from
        # this frame and of the same length, takes the same path down the same stack:
        # its zero key lands on the very slots the real one was left in.
        _chacha20_once(_NO_KEY, bytes(12), bytes(len(data)))


_NO_KEY = bytes(_KEY_SIZE)


def _chacha20_once(key: bytes, nonce12: bytes, data: bytes) -> bytes:
    # cryptography's ChaCha20 takes a 16-byte nonce: the 32-bit little-endian block counter
    # (NIP-44 starts at 0) followed by the 96-bit IETF nonce.
    cipher = Cipher(algorithms.ChaCha20(key, bytes(4) + nonce12), mode=None).encryptor()
    return cipher.update(data) + cipher.finalize()


def _mac(hmac_key: bytes, nonce: bytes, ciphertext: bytes) -> bytes:
    return hmac.digest(hmac_key, nonce + ciphertext, hashlib.sha256)


def encrypt(conv_key: bytes, plaintext: bytes, nonce: bytes) -> str:
    """The NIP-44 v2 payload (base64 text) of `plaintext` under `conv_key` with `nonce`.

    `nonce` must be fresh and random for each payload (32 bytes from a CSPRNG): reusing one
    under the same key makes both payloads readable.

    Raises:
        ValueError: a plaintext outside 1..65,535 bytes, or a key or nonce not 32 bytes.
    """
    if not isinstance(plaintext, bytes):
        raise TypeError("a NIP-44 plaintext is bytes")
    length = len(plaintext)
    if not MIN_PLAINTEXT <= length <= MAX_PLAINTEXT:
        raise ValueError("a NIP-44 plaintext is 1 to 65,535 bytes")
    padded = length.to_bytes(2, "big") + plaintext + bytes(padded_length(length) - length)
    chacha_key, chacha_nonce, hmac_key = message_keys(conv_key, nonce)
    try:
        ciphertext = _chacha20(chacha_key, chacha_nonce, padded)
        mac = _mac(hmac_key, nonce, ciphertext)
    finally:
        for part in (chacha_key, hmac_key, padded):
            wipe_bytes(part)
    return base64.b64encode(bytes([VERSION]) + nonce + ciphertext + mac).decode("ascii")


def decrypt(conv_key: bytes, payload: str) -> bytes:
    """The plaintext of a NIP-44 v2 `payload` under `conv_key`.

    Raises:
        UnsupportedVersion: an empty payload or a '#' encoding (NIP-44's `decode_payload`:
            "unknown version"), or a version byte other than 2.
        DecryptFailed: anything else about the payload (length, base64, MAC, padding).
    """
    if not isinstance(payload, str):
        raise DecryptFailed()
    if not payload or payload.startswith("#"):
        raise UnsupportedVersion()
    if not _MIN_PAYLOAD_CHARS <= len(payload) <= _MAX_PAYLOAD_CHARS:
        raise DecryptFailed()
    try:
        raw = base64.b64decode(payload.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise DecryptFailed() from None
    if not _MIN_DECODED <= len(raw) <= _MAX_DECODED:
        raise DecryptFailed()
    if raw[0] != VERSION:
        raise UnsupportedVersion()
    nonce = raw[1 : 1 + NONCE_SIZE]
    ciphertext = raw[1 + NONCE_SIZE : -_MAC_SIZE]
    chacha_key, chacha_nonce, hmac_key = message_keys(conv_key, nonce)
    try:
        if not hmac.compare_digest(_mac(hmac_key, nonce, ciphertext), raw[-_MAC_SIZE:]):
            raise DecryptFailed()
        padded = _chacha20(chacha_key, chacha_nonce, ciphertext)
    finally:
        wipe_bytes(chacha_key)
        wipe_bytes(hmac_key)
    try:
        length = int.from_bytes(padded[0:2], "big")
        plaintext = padded[2 : 2 + length]
        if (
            length < MIN_PLAINTEXT
            or len(plaintext) != length
            or len(padded) != 2 + padded_length(length)
        ):
            wipe_bytes(plaintext)
            raise DecryptFailed()
        return plaintext
    finally:
        wipe_bytes(padded)
