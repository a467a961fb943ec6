"""Secret buffers: where a 32-byte secret lives while custody uses it, and how it is wiped.

Rules:
- A secret (an agent key, an ECDH x-coordinate) lives in a `Secret`: a C buffer from
  coincurve's cffi (`ffi.new`), which libsecp256k1 reads directly. It is zeroed by
  `wipe()`, on leaving a `with` block, and its repr never shows the bytes.
- Text that encodes a secret (64 hex digits or `nsec1…`) is read into a `bytearray`
  (`read_limited`: `os.readv` straight into it, then copied through views into one of
  the size read, the first zeroed on every way out) and decoded character by character
  into a `Secret` (`parse_secret_text`), so no `str` or `bytes` copy of it is made; the
  bytearray is zeroed afterwards (tests/custody/test_secret_reads.py).
- Fresh secrets come from the OS CSPRNG read straight into the C buffer (`random_secret`):
  see its docstring for why not the token's generator.

What Python cannot guarantee (best effort, documented rather than hidden):
- python-pkcs11's decrypt returns an immutable `bytes`. `wipe_bytes` zeroes that object's
  storage in place (CPython only: its payload sits at a fixed offset inside the object);
  on another interpreter it does nothing and the bytes wait for the allocator.
- Before that `bytes` exists, python-pkcs11 (0.10) has C_Decrypt write the plaintext into
  its operation's own output buffer (a Cython array) and copies it out; that buffer is
  private to the library and freed unzeroed. glibc overwrites it as it is freed
  (`_process`'s M_PERTURB); without glibc the key stays there until reused. Likewise
  the PIN passes through a `str` (the only form `Token.open` takes) and the library's own
  encoded copy of it.
- Python's `hmac`/`hashlib` copy their input and key into OpenSSL state they free without
  our control; a K_c produced by `hmac.digest` is a `bytes` we wipe the same way.
- The OS may have swapped a page, a core dump may catch a buffer mid-use, and the
  interpreter may have copied a value we never saw. Run the daemon with core dumps off
  and memory locked down by systemd (see systemd/).
"""

from __future__ import annotations

import ctypes
import os
import sys
from types import TracebackType
from typing import Any

from coincurve._libsecp256k1 import ffi, lib
from coincurve.context import GLOBAL_CONTEXT

from custody._errors import CustodyError

__all__ = [
    "SECRET_SIZE",
    "Secret",
    "parse_secret_text",
    "random_secret",
    "read_limited",
    "wipe_bytes",
]

SECRET_SIZE = 32
_CTX = GLOBAL_CONTEXT.ctx  # coincurve's context: read-only after creation, safe to share


class Secret:
    """32 secret bytes in a C buffer. Use as a context manager; wiped on exit.

    Only custody creates these; nothing outside custody ever receives one.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf: Any = ffi.new("unsigned char[32]")  # zero-filled by cffi

    @property
    def cdata(self) -> Any:
        """The C buffer, for libsecp256k1 calls and `ffi.buffer` views. Never copy it to bytes."""
        return self._buf

    def wipe(self) -> None:
        ffi.memmove(self._buf, bytes(SECRET_SIZE), SECRET_SIZE)

    def is_valid_scalar(self) -> bool:
        """1 <= secret < n (the secp256k1 group order): anything else is not a key."""
        return bool(lib.secp256k1_ec_seckey_verify(_CTX, self._buf))

    def __enter__(self) -> Secret:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.wipe()

    def __repr__(self) -> str:
        return "Secret(<redacted>)"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # pickling would copy the bytes out
        raise TypeError("a Secret cannot be pickled")


def wipe_bytes(data: bytes) -> None:
    """Zero an immutable bytes object's payload in place (CPython only; see module docstring).

    Only for bytes we alone hold (a fresh decrypt result, a fresh digest). Objects of length
    0 or 1 are interpreter-wide singletons and are left alone; they are never secrets here.
    """
    if sys.implementation.name != "cpython" or len(data) < 2:
        return
    # PyBytesObject: header of bytes.__basicsize__ - 1 bytes, then the payload (ob_sval).
    ctypes.memset(id(data) + bytes.__basicsize__ - 1, 0, len(data))


def random_secret() -> Secret:
    """A fresh uniformly random secp256k1 secret key.

    Source: the kernel CSPRNG, read from /dev/urandom straight into the C buffer. Why this
    and not the token's C_GenerateRandom: the kernel generator is the one everything else on
    the host already trusts, it costs no token round-trip, and reading into our buffer makes
    no `bytes` copy (os.urandom, secrets.token_bytes and python-pkcs11's generate_random all
    return immutable bytes). Values 0 and >= n are rejected and drawn again (probability
    about 2^-128), so the key is uniform on [1, n).
    """
    secret = Secret()
    view = ffi.buffer(secret.cdata)
    with open("/dev/urandom", "rb", buffering=0) as rng:
        while True:
            filled = 0
            while filled < SECRET_SIZE:
                got = rng.readinto(memoryview(view)[filled:])
                if not got:
                    secret.wipe()
                    raise CustodyError("the OS random generator returned no data")
                filled += got
            if secret.is_valid_scalar():
                return secret


def read_limited(fd: int, limit: int) -> bytearray | None:
    """At most `limit` bytes from `fd`, in a bytearray of the size read: the caller zeroes
    it. The buffer read into is zeroed before it is let go, however the read ends.

    Returns None if `fd` holds more than `limit` bytes.
    Used for every secret read from a file or stdin (PIN, secret text, age identity).
    """
    buf = bytearray(limit + 1)
    filled = 0
    try:
        while filled < len(buf):
            with memoryview(buf) as whole, whole[filled:] as chunk:
                got = os.readv(fd, [chunk])
            if got == 0:
                break
            filled += got
        if filled > limit:
            return None
        # Copied into a bytearray of the size read, through views (no bytes object): a cut
        # (`del buf[filled:]`) lets CPython's allocator move a small buffer to a smaller
        # block and free the old one unwiped, the secret in it (a review found 56 of 64 hex
        # digits there after an import).
        out = bytearray(filled)
        with memoryview(out) as into, memoryview(buf) as whole, whole[:filled] as part:
            into[:] = part
        return out
    finally:  # every way out, an interrupted read (Ctrl-C after the line) included
        _zero(buf)


# --- decoding secret text without making str/bytes copies ---------------------------

_HEX = {c: v for v, c in enumerate(b"0123456789abcdef")} | {
    c: v + 10 for v, c in enumerate(b"ABCDEF")
}
_BECH32_ALPHABET = b"qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_BECH32 = {c: v for v, c in enumerate(_BECH32_ALPHABET)}
_BECH32_GEN = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)
_NSEC_HRP = b"nsec"
_WHITESPACE = frozenset(b" \t\r\n")
_MALFORMED = "malformed secret: expected 64 hex digits or an nsec1 bech32 string"


def _zero(buf: bytearray) -> None:
    for i in range(len(buf)):
        buf[i] = 0


def parse_secret_text(text: bytearray) -> Secret:
    """Decode 64 hex digits or `nsec1…` (BIP-173 bech32, NIP-19) into a Secret.

    Surrounding whitespace is ignored. `text` is zeroed whether or not it parses.

    Raises:
        CustodyError: not one of the two forms, a bad bech32 checksum, or a value that is
            not a valid secp256k1 secret key (0 or >= n). The message never quotes input.
    """
    secret = Secret()
    try:
        start, end = 0, len(text)
        while start < end and text[start] in _WHITESPACE:
            start += 1
        while end > start and text[end - 1] in _WHITESPACE:
            end -= 1
        length = end - start
        if length == 2 * SECRET_SIZE:
            _decode_hex(text, start, secret)
        elif length == 63 and _lower(text[start : start + 5]) == bytearray(b"nsec1"):
            _decode_nsec(text, start, end, secret)
        else:
            raise CustodyError(_MALFORMED)
        if not secret.is_valid_scalar():
            raise CustodyError("malformed secret: not a valid secp256k1 secret key (0 or >= n)")
        return secret
    except BaseException:
        secret.wipe()
        raise
    finally:
        _zero(text)


def _lower(chunk: bytearray) -> bytearray:
    return bytearray(c | 0x20 if 0x41 <= c <= 0x5A else c for c in chunk)


def _decode_hex(text: bytearray, start: int, secret: Secret) -> None:
    out = secret.cdata
    for i in range(SECRET_SIZE):
        hi = _HEX.get(text[start + 2 * i])
        lo = _HEX.get(text[start + 2 * i + 1])
        if hi is None or lo is None:
            raise CustodyError(_MALFORMED)
        out[i] = (hi << 4) | lo


def _decode_nsec(text: bytearray, start: int, end: int, secret: Secret) -> None:
    # BIP-173: all one case; hrp "nsec", separator "1", 52 data groups of 5 bits carrying
    # 32 bytes (256 bits + 4 zero padding bits), then 6 checksum groups.
    has_upper = any(0x41 <= text[i] <= 0x5A for i in range(start, end))
    has_lower = any(0x61 <= text[i] <= 0x7A for i in range(start, end))
    if has_upper and has_lower:
        raise CustodyError(_MALFORMED)
    chk = 1
    for c in _NSEC_HRP:
        chk = _polymod_step(chk, c >> 5)
    chk = _polymod_step(chk, 0)
    for c in _NSEC_HRP:
        chk = _polymod_step(chk, c & 31)
    out = secret.cdata
    acc = bits = written = 0
    for pos in range(start + 5, end):
        c = text[pos] | 0x20 if 0x41 <= text[pos] <= 0x5A else text[pos]
        value = _BECH32.get(c)
        if value is None:
            raise CustodyError(_MALFORMED)
        chk = _polymod_step(chk, value)
        if pos >= end - 6:
            continue  # checksum groups: in the polymod, not in the payload
        acc = ((acc << 5) | value) & 0xFFF
        bits += 5
        if bits >= 8:
            bits -= 8
            if written < SECRET_SIZE:
                out[written] = (acc >> bits) & 0xFF
            written += 1
    padding_is_zero = acc & ((1 << bits) - 1) == 0
    acc = 0
    if chk != 1 or written != SECRET_SIZE or bits != 4 or not padding_is_zero:
        raise CustodyError(_MALFORMED)


def _polymod_step(chk: int, value: int) -> int:
    top = chk >> 25
    chk = ((chk & 0x1FFFFFF) << 5) ^ value
    for i in range(5):
        if (top >> i) & 1:
            chk ^= _BECH32_GEN[i]
    return chk
