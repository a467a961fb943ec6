"""Identities and the scalar checkers every shape is built from.

Rules (spec §Identities and spellings, §Operations):
- A channel id is a UUID; canonical = lowercase hyphenated. Accepted spellings, after
  trimming, exactly NIP-BA's ("Wire and normalization"): hyphenated (8-4-4-4-12) or 32 hex
  digits unhyphenated, hex in any letter case; braces `{…}` around the hyphenated form; or
  `urn:uuid:` (lowercase) before the hyphenated form. Braces or the prefix around 32 bare
  digits, an uppercase `URN:UUID:`, and hyphens anywhere else (`uuid.UUID` drops them
  anywhere) are refused. Version and variant bits are not checked: the id is Buzz's.
- Event ids, d-tags and public keys are 64 hex characters; canonical = lowercase. A public
  key must also be the x coordinate of a point on secp256k1 (BIP-340 x-only): x < p and
  x^3 + 7 a quadratic residue mod p (Legendre symbol, computed as a Jacobi symbol). We use the stdlib, not
  coincurve, because `contract` imports nothing outside it; results are memoised because
  the dataclasses re-check what the reader already checked.
- Trimmed text: exactly Unicode White_Space (`_text.trim`, never `str.strip()`, which also
  takes U+001C-U+001F). A trimmed field that is empty afterwards is refused: an empty
  string would be a second spelling of "absent" (I6). A trimmed name or prose field that
  holds a character its `TextKind` refuses (controls, bidi overrides: `_text`) is refused
  too, a host rule (docs/protocol.md "Text an operator reads").
- Characters are Unicode scalar values (`len(str)`); bytes are UTF-8. No string may hold a
  lone surrogate (it has no UTF-8 form).

Every checker has the signature `(value, pointer) -> canonical value` and raises
`ContractError(invalid_request, pointer, ...)` naming the `Rule` it broke; a rule's reason
never quotes the value (`_rules`).

WARNING: the accepted spellings are the ones spec §Identities lists, and the client's echo
checks (client/buzz_broker_client/client.py `_same`) rely on the normalizers answering None for a value they
cannot parse.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TypeGuard

from ._codes import ContractError, ErrorCode
from ._rules import Rule
from ._limits import (MAX_CURSOR_BYTES, MAX_JSON_INT, MAX_REQUEST_ID_BYTES, MAX_SLUG_BYTES,
                      MAX_SLUG_SEGMENT_CHARS)
from ._text import TextKind, is_blank, refused_in, trim

__all__ = [
    "normalize_channel_id", "normalize_hex64", "is_valid_pubkey", "is_request_id",
    "Checker", "fault", "channel_id", "hex64", "pubkey", "lower_hex64_exact", "lower_hex128_exact",
    "request_id", "cursor", "slug", "boolean", "integer", "text", "exact_text", "any_string",
]

Checker = Callable[[object, str], object]

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_LOWER_HEX64 = re.compile(r"[0-9a-f]{64}")
_LOWER_HEX128 = re.compile(r"[0-9a-f]{128}")
_UUID_HYPHENATED = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
# NIP-BA's four spellings; the digits are in whichever group matched.
_UUID = re.compile(
    rf"(?P<hyphenated>{_UUID_HYPHENATED})|(?P<bare>[0-9a-fA-F]{{32}})"
    rf"|\{{(?P<braced>{_UUID_HYPHENATED})\}}|urn:uuid:(?P<urn>{_UUID_HYPHENATED})"
)
# requestId and cursor: printable ASCII without space, 0x21-0x7E.
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
# NIP-AE slug grammar (spec buzz-on-the-relay.md, "Encrypted memory address"):
# core, or ^mem/[a-z0-9][a-z0-9_-]{0,63}(/[a-z0-9][a-z0-9_-]{0,63})*$, at most 255 bytes.
# This pattern alone decides what is accepted; `_SLUG_FAULTS` only says why a refused one is.
_SLUG_SEGMENT = rf"[a-z0-9][a-z0-9_-]{{0,{MAX_SLUG_SEGMENT_CHARS - 1}}}"
_SLUG = re.compile(rf"core|mem/{_SLUG_SEGMENT}(?:/{_SLUG_SEGMENT})*")
_SLUG_ALPHABET = re.compile(r"[a-z0-9_-]*")
#: Which part of the grammar a ``mem/`` slug's segments break, asked in this order (the
#: first that any segment breaks is the one the agent is told). The shape itself (the
#: prefix, no empty segment) and the byte bound are asked before and after (`_slug_fault`).
_SLUG_FAULTS: tuple[tuple[Callable[[str], bool], Rule], ...] = (
    (lambda segment: _SLUG_ALPHABET.fullmatch(segment) is None, Rule.SLUG_CHARACTER),
    (lambda segment: segment[0] in "_-", Rule.SLUG_SEGMENT_START),
    (lambda segment: len(segment) > MAX_SLUG_SEGMENT_CHARS, Rule.SLUG_SEGMENT_LONG),
)

#: TextKind -> the rule its refusal names.
_REFUSED_RULE: dict[TextKind, Rule] = {
    TextKind.LINE: Rule.LINE_CHARACTER,
    TextKind.PROSE: Rule.PROSE_CHARACTER,
}

# secp256k1 field prime (SEC 2 §2.4.1).
_P = 2**256 - 2**32 - 977


def fault(pointer: str, rule: Rule, *, detail: str | None = None,
          **bounds: int | str) -> ContractError:
    """The invalid_request error every checker raises: `rule` broken at `pointer`.

    `bounds` fill the rule's template (the host's limits, never the value); `detail` is
    operator-only text when the reader knows more than the rule says.
    """
    reason = rule.reason(**bounds)
    return ContractError(ErrorCode.INVALID_REQUEST, pointer,
                         reason if detail is None else detail, rule=rule, reason=reason)


def normalize_channel_id(value: str) -> str | None:
    """Canonical (lowercase hyphenated) form of any legal UUID spelling, or None."""
    match = _UUID.fullmatch(trim(value))
    if match is None:
        return None
    # Exactly one group matched (the alternatives are anchored and disjoint).
    spelled = next(group for group in match.groups() if group is not None)
    digits = spelled.replace("-", "").lower()
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def normalize_hex64(value: str) -> str | None:
    """Lowercase form of 64 hex characters (surrounding whitespace trimmed), or None."""
    value = trim(value)
    return value.lower() if _HEX64.fullmatch(value) else None


def _jacobi(a: int, n: int) -> int:
    # The Jacobi symbol (a/n) by the binary algorithm (quadratic reciprocity). For prime n
    # it is the Legendre symbol, i.e. Euler's criterion a^((n-1)/2) mod n, but measured
    # here about 4x faster in pure Python than the 256-bit pow() (33 us vs 130 us).
    a %= n
    result = 1
    while a:
        while not a & 1:
            a >>= 1
            if n & 7 in (3, 5):
                result = -result
        a, n = n, a
        if a & 3 == 3 and n & 3 == 3:
            result = -result
        a %= n
    return result if n == 1 else 0


@functools.lru_cache(maxsize=4096)
def _on_curve(x: int) -> bool:
    if x >= _P:
        return False
    y_squared = (pow(x, 3, _P) + 7) % _P
    # A y exists iff x^3 + 7 is a square mod p: Legendre symbol 1 (or 0 for y = 0).
    return _jacobi(y_squared, _P) >= 0


def is_valid_pubkey(value: str) -> bool:
    """True when `value` is 64 lowercase hex characters naming an x-only secp256k1 point."""
    return type(value) is str and _LOWER_HEX64.fullmatch(value) is not None and _on_curve(int(value, 16))


def is_request_id(value: object) -> TypeGuard[str]:
    """True for a usable requestId: 1-128 bytes of 0x21-0x7E (never trimmed)."""
    return (
        type(value) is str
        and len(value) <= MAX_REQUEST_ID_BYTES
        and _VISIBLE_ASCII.fullmatch(value) is not None
    )


def _string(value: object, pointer: str) -> str:
    if type(value) is not str:
        raise fault(pointer, Rule.EXPECTED_STRING)
    return value


def _no_surrogates(value: str, pointer: str) -> None:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise fault(pointer, Rule.LONE_SURROGATE) from None


def channel_id(value: object, pointer: str) -> str:
    canonical = normalize_channel_id(_string(value, pointer))
    if canonical is None:
        raise fault(pointer, Rule.CHANNEL)
    return canonical


def hex64(value: object, pointer: str) -> str:
    canonical = normalize_hex64(_string(value, pointer))
    if canonical is None:
        raise fault(pointer, Rule.HEX64)
    return canonical


def pubkey(value: object, pointer: str) -> str:
    canonical = hex64(value, pointer)
    if not _on_curve(int(canonical, 16)):
        raise fault(pointer, Rule.PUBKEY)
    return canonical


def lower_hex64_exact(value: object, pointer: str) -> str:
    """Verbatim fields of signed events: already canonical, never rewritten."""
    text = _string(value, pointer)
    if _LOWER_HEX64.fullmatch(text) is None:
        raise fault(pointer, Rule.LOWER_HEX64)
    return text


def lower_hex128_exact(value: object, pointer: str) -> str:
    text = _string(value, pointer)
    if _LOWER_HEX128.fullmatch(text) is None:
        raise fault(pointer, Rule.LOWER_HEX128)
    return text


def request_id(value: object, pointer: str) -> str:
    if not is_request_id(value):
        raise fault(pointer, Rule.VISIBLE_ASCII, max=MAX_REQUEST_ID_BYTES)
    return value


def cursor(value: object, pointer: str) -> str:
    # Opaque: never trimmed or altered, shape only (spec channel.read).
    string = _string(value, pointer)
    if len(string) > MAX_CURSOR_BYTES or _VISIBLE_ASCII.fullmatch(string) is None:
        raise fault(pointer, Rule.VISIBLE_ASCII, max=MAX_CURSOR_BYTES)
    return string


def slug(value: object, pointer: str) -> str:
    string = trim(_string(value, pointer))
    if len(string) <= MAX_SLUG_BYTES and _SLUG.fullmatch(string) is not None:
        return string
    # `max` fills BYTES's template; the slug rules' own have no placeholder.
    raise fault(pointer, _slug_fault(string), max=MAX_SLUG_BYTES)


def _slug_fault(string: str) -> Rule:
    """Which rule a slug the grammar refused breaks: the one an agent can fix it by."""
    if not string.startswith("mem/"):
        return Rule.SLUG
    segments = string[len("mem/"):].split("/")
    if "" in segments:
        return Rule.SLUG
    for broken, rule in _SLUG_FAULTS:
        if any(broken(segment) for segment in segments):
            return rule
    # Every segment is grammatical, so the slug is ASCII: its length is its bytes.
    return Rule.BYTES


def boolean(value: object, pointer: str) -> bool:
    if type(value) is not bool:
        raise fault(pointer, Rule.EXPECTED_BOOLEAN)
    return value


def integer(low: int, high: int = MAX_JSON_INT) -> Checker:
    """A checker for an integer in [low, high]; `true`, `1.0` and `1e0` are not integers."""

    def check(value: object, pointer: str) -> int:
        if type(value) is not int:
            raise fault(pointer, Rule.EXPECTED_INTEGER)
        if not low <= value <= high:
            raise fault(pointer, Rule.INTEGER_RANGE, low=low, high=high)
        return value

    return check


def text(max_chars: int, kind: TextKind = TextKind.LINE) -> Checker:
    """Trimmed text, non-empty after trimming, at most `max_chars` scalar values, holding
    no character `kind` refuses (a name or other one-line scalar unless told `PROSE`)."""

    def check(value: object, pointer: str) -> str:
        string = trim(_string(value, pointer))
        if not string:
            raise fault(pointer, Rule.BLANK)
        if len(string) > max_chars:
            raise fault(pointer, Rule.CHARS, max=max_chars)
        _no_surrogates(string, pointer)
        if refused_in(string, kind):
            raise fault(pointer, _REFUSED_RULE[kind])
        return string

    return check


def exact_text(max_bytes: int) -> Checker:
    """Untrimmed text (message content): kept exactly, not whitespace-only, UTF-8 bytes bounded."""

    def check(value: object, pointer: str) -> str:
        string = _string(value, pointer)
        # Any character outside White_Space makes content non-blank (U+001C does: NIP-BA).
        if is_blank(string):
            raise fault(pointer, Rule.BLANK)
        # A scalar value is 1-4 UTF-8 bytes, so short strings skip the encode.
        if len(string) > max_bytes:
            raise fault(pointer, Rule.BYTES, max=max_bytes)
        if len(string) * 4 > max_bytes or not string.isascii():
            try:
                size = len(string.encode("utf-8"))
            except UnicodeEncodeError:
                raise fault(pointer, Rule.LONE_SURROGATE) from None
            if size > max_bytes:
                raise fault(pointer, Rule.BYTES, max=max_bytes)
        return string

    return check


def any_string(value: object, pointer: str) -> str:
    """A string kept verbatim (event content, error messages): only its type is checked."""
    string = _string(value, pointer)
    _no_surrogates(string, pointer)
    return string
