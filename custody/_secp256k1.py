"""libsecp256k1 through coincurve's cffi layer, with secrets only in C buffers.

Rules:
- Functions here take a `Secret` (a C buffer) and hand it to libsecp256k1 by pointer, so
  no `bytes` copy of a secret key is made (coincurve's high-level `PrivateKey(bytes)` would
  keep one for the object's life). Every intermediate that embeds the secret (the
  `secp256k1_keypair` struct, the ECDH point) is zeroed before returning.
- Public values (x-only pubkeys, signatures) come back as `bytes`.
- No Schnorr mechanism exists in PKCS#11, so BIP-340 runs here, in-process.
- Every libsecp256k1 call's return value is checked with `if not ...: raise`, never with
  `assert`: `python -O` strips asserts together with the calls inside them, which once
  made every pubkey 32 zero bytes and every ECDH x zero. No `assert` in this package may
  hold a call with an effect (and `custody/__init__` refuses -O anyway).
- coincurve's GLOBAL_CONTEXT is created and randomized once at import and only read
  afterwards, so sharing it between threads is safe.
"""

from __future__ import annotations

from typing import Any

from coincurve._libsecp256k1 import ffi, lib
from coincurve.context import GLOBAL_CONTEXT

from custody._secret import Secret

__all__ = ["xonly_pubkey", "schnorr_sign", "ecdh_x", "is_xonly_pubkey"]

_CTX = GLOBAL_CONTEXT.ctx
_KEYPAIR_SIZE = ffi.sizeof("secp256k1_keypair")
_PUBKEY_SIZE = ffi.sizeof("secp256k1_pubkey")


def _zero(cdata: Any, size: int) -> None:
    ffi.memmove(cdata, bytes(size), size)


def _keypair(secret: Secret) -> Any:
    keypair = ffi.new("secp256k1_keypair *")
    if not lib.secp256k1_keypair_create(_CTX, keypair, secret.cdata):
        _zero(keypair, _KEYPAIR_SIZE)
        raise ValueError("not a valid secp256k1 secret key")
    return keypair


def xonly_pubkey(secret: Secret) -> bytes:
    """The BIP-340 x-only public key (32 bytes) of `secret`."""
    keypair = _keypair(secret)
    try:
        xonly = ffi.new("secp256k1_xonly_pubkey *")
        if not lib.secp256k1_keypair_xonly_pub(_CTX, xonly, ffi.NULL, keypair):
            raise ValueError("libsecp256k1 could not take the x-only key of a keypair")
        out = ffi.new("unsigned char[32]")
        if not lib.secp256k1_xonly_pubkey_serialize(_CTX, out, xonly):
            raise ValueError("libsecp256k1 could not serialize an x-only key")
        return bytes(ffi.buffer(out, 32))
    finally:
        _zero(keypair, _KEYPAIR_SIZE)


def schnorr_sign(secret: Secret, message32: bytes, aux32: bytes) -> bytes:
    """BIP-340 signature (64 bytes) of a 32-byte message with explicit 32-byte aux randomness."""
    if len(message32) != 32 or len(aux32) != 32:
        raise ValueError("BIP-340 signs a 32-byte message with 32 bytes of aux randomness")
    keypair = _keypair(secret)
    try:
        sig = ffi.new("unsigned char[64]")
        if not lib.secp256k1_schnorrsig_sign32(_CTX, sig, message32, keypair, aux32):
            raise ValueError("BIP-340 signing failed")
        return bytes(ffi.buffer(sig, 64))
    finally:
        _zero(keypair, _KEYPAIR_SIZE)


def is_xonly_pubkey(candidate: bytes) -> bool:
    """True iff `candidate` is 32 bytes that are the x-coordinate of a secp256k1 point.

    About half of all 32-byte strings are not (x^3 + 7 has no square root mod p): such an
    "owner" could never sign a NIP-OA tag nor be an ECDH peer for NIP-AE. Public data only.
    """
    if not isinstance(candidate, bytes) or len(candidate) != 32:
        return False
    parsed = ffi.new("secp256k1_xonly_pubkey *")
    return bool(lib.secp256k1_xonly_pubkey_parse(_CTX, parsed, candidate))


def ecdh_x(secret: Secret, peer_xonly: bytes) -> Secret:
    """The raw x-coordinate of secret * P, where P is the even-y point of `peer_xonly`.

    NIP-44 v2 takes the unhashed x (libsecp256k1's own ECDH would hash it), so this is a
    point multiplication. x(k*P) == x(k*(-P)), so lifting the x-only key to even y is exact.
    The result is secret: it comes back as a `Secret` the caller must wipe.

    Raises:
        ValueError: `peer_xonly` is not the x-coordinate of a curve point.
    """
    if len(peer_xonly) != 32:
        raise ValueError("an x-only public key is 32 bytes")
    point = ffi.new("secp256k1_pubkey *")
    if not lib.secp256k1_ec_pubkey_parse(_CTX, point, b"\x02" + peer_xonly, 33):
        raise ValueError("not a secp256k1 x-only public key")
    compressed = ffi.new("unsigned char[33]")
    try:
        if not lib.secp256k1_ec_pubkey_tweak_mul(_CTX, point, secret.cdata):
            raise ValueError("not a valid secp256k1 secret key")
        size = ffi.new("size_t *", 33)
        if not lib.secp256k1_ec_pubkey_serialize(
            _CTX, compressed, size, point, lib.SECP256K1_EC_COMPRESSED
        ) or size[0] != 33:
            raise ValueError("libsecp256k1 could not serialize the ECDH point")
        shared = Secret()
        ffi.memmove(shared.cdata, compressed + 1, 32)
        return shared
    finally:
        _zero(point, _PUBKEY_SIZE)
        _zero(compressed, 33)
