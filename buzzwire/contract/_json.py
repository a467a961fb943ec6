"""The strict JSON reader: raw body bytes in, a plain JSON value plus its first fault out.

Rules (spec I6, §Request, issue 2):
- Syntax faults make the document unreadable and raise `JsonSyntaxError`: invalid UTF-8
  (including a BOM and UTF-8-encoded surrogates), any token outside RFC 8259 (NaN,
  Infinity, comments, single quotes, control characters in strings), trailing bytes, and
  nesting deeper than `MAX_NESTING`.
- Strictness faults leave a readable document and are reported as `(pointer, Rule)` for
  the FIRST one met: `null` anywhere, a key repeated in any object, a number with a
  fraction or exponent (`1.0`, `1e0`; the protocol has no non-integers), an integer
  outside signed 64 bits, and a lone surrogate escape (`"\\ud800"`) in a key or string.
  Keeping the document readable is what lets the envelope layer still correlate a request
  whose requestId is fine but whose args hold a `null`.

Theory of operation (measured: see benchmarks/contract.py). The C decoder does the
parsing. A fast decoder's hooks raise `_Slow` the moment they see a repeated key, a
non-integer or a 19+ digit integer, and two byte searches decide whether a walk is needed
at all (no b"null", no surrogate escape -> the value is clean without visiting it). Only when
something suspicious shows up do we re-parse with a marking decoder and walk the tree in
document order to name the first fault. Nesting is bounded before the C decoder runs, so
a 10,000-deep body is refused after a count and a short scan, never by RecursionError.

"First" means first in a depth-first walk in document order; a repeated key is reported
when its object is reached, before that object's members are visited.

WARNING: `_Repeated`, `_NonInteger` and `_OutOfRange` are markers only the slow path
creates; `first_fault` must recognise every marker that decoder can return.
"""

from __future__ import annotations

import json
import re
from typing import TypeAlias, TypeGuard

from ._limits import MAX_JSON_INT, MAX_NESTING, MIN_JSON_INT
from ._rules import Rule

__all__ = ["JsonSyntaxError", "parse", "first_fault", "escape_token", "is_object", "repeated_keys"]


class JsonSyntaxError(Exception):
    """The bytes are not one strict JSON document (operator detail in args[0])."""


class _Slow(Exception):
    """Raised by a fast-path hook: this document needs the marking decoder and a walk."""


class _BadConstant(Exception):
    """NaN / Infinity / -Infinity: not JSON."""


class _NonInteger:
    """A number written with a fraction or an exponent."""

    __slots__ = ()


class _OutOfRange:
    """An integer outside signed 64 bits."""

    __slots__ = ()


#: What either decoder can hand back: JSON's values with `null` still in (strictness is
#: judged afterwards), plus the slow path's markers (a `_Repeated` is a dict).
_Decoded: TypeAlias = (
    "str | int | bool | None | _NonInteger | _OutOfRange | list[_Decoded] | dict[str, _Decoded]"
)


class _Repeated(dict[str, _Decoded]):
    """An object in which at least one key appeared more than once."""

    __slots__ = ("repeated",)
    repeated: tuple[str, ...]


_NON_INTEGER = _NonInteger()
_OUT_OF_RANGE = _OutOfRange()


def _fast_pairs(pairs: list[tuple[str, _Decoded]]) -> dict[str, _Decoded]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Slow
    return obj


def _fast_float(_text: str) -> object:
    raise _Slow


def _constant(text: str) -> object:
    raise _BadConstant(text)


def _fast_int(text: str) -> int:
    # 18 digits always fit in 64 bits; anything longer is range-checked on the slow path.
    if len(text) > 18:
        raise _Slow
    return int(text)


def _slow_pairs(pairs: list[tuple[str, _Decoded]]) -> dict[str, _Decoded]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    repeated: list[str] = []
    for key, _ in pairs:
        if key in seen and key not in repeated:
            repeated.append(key)
        seen.add(key)
    # dict(pairs) keeps the first position and the last value; either way the object is
    # faulty, and the marker names the keys so correlation can refuse a repeated requestId.
    marked = _Repeated(obj)
    marked.repeated = tuple(repeated)
    return marked


def _slow_float(_text: str) -> _NonInteger:
    return _NON_INTEGER


def _slow_int(text: str) -> int | _OutOfRange:
    # 20 characters hold every signed 64-bit value with its sign; a longer literal is out of
    # range and is never handed to int() (which refuses > 4300 digits with a ValueError).
    if len(text) > 20:
        return _OUT_OF_RANGE
    value = int(text)
    if MIN_JSON_INT <= value <= MAX_JSON_INT:
        return value
    return _OUT_OF_RANGE


_FAST = json.JSONDecoder(
    object_pairs_hook=_fast_pairs, parse_float=_fast_float, parse_int=_fast_int,
    parse_constant=_constant,
)
_MARKING = json.JSONDecoder(
    object_pairs_hook=_slow_pairs,
    parse_float=_slow_float,
    parse_int=_slow_int,
    parse_constant=_constant,
)

# A complete JSON string token (unrolled loop: linear, no backtracking blow-up).
_STRING_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
# An escape of a UTF-16 surrogate; pairs are legal, so these only trigger the walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_OPEN = (0x5B, 0x7B)


def _too_deep(body: bytes) -> bool:
    # Cheap bound first: nesting can never exceed the number of opening brackets.
    if body.count(b"[") + body.count(b"{") <= MAX_NESTING:
        return False
    brackets = _STRING_TOKEN.sub(b"", body).translate(None, _NOT_BRACKET)
    depth = 0
    for byte in brackets:
        if byte in _OPEN:
            depth += 1
            if depth > MAX_NESTING:
                return True
        else:
            depth -= 1
    return False


def escape_token(token: str) -> str:
    """One RFC 6901 reference token (`~` -> `~0`, `/` -> `~1`)."""
    if "~" in token or "/" in token:
        return token.replace("~", "~0").replace("/", "~1")
    return token


def is_object(value: object) -> TypeGuard[dict[str, object]]:
    """True for a JSON object as this module returns it (including a faulty one)."""
    return type(value) is dict or type(value) is _Repeated


def repeated_keys(value: object) -> tuple[str, ...]:
    """Keys that appeared more than once in this object (empty for a clean one)."""
    return value.repeated if type(value) is _Repeated else ()


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def first_fault(value: object) -> tuple[str, Rule] | None:
    """The first strictness fault in document order, as (JSON pointer, the rule broken)."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        pointer, item = stack.pop()
        if isinstance(item, str):
            if _has_lone_surrogate(item):
                return pointer, Rule.LONE_SURROGATE
        elif isinstance(item, _Repeated):
            return f"{pointer}/{escape_token(item.repeated[0])}", Rule.REPEATED_MEMBER
        elif isinstance(item, dict):
            children: list[tuple[str, object]] = []
            for key, child in item.items():
                if _has_lone_surrogate(key):
                    return pointer, Rule.MEMBER_NAME_SURROGATE
                children.append((f"{pointer}/{escape_token(key)}", child))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((f"{pointer}/{index}", item[index]) for index in range(len(item) - 1, -1, -1))
        elif item is None:
            return pointer, Rule.NULL
        elif item is _NON_INTEGER:
            return pointer, Rule.NOT_INTEGER
        elif item is _OUT_OF_RANGE:
            return pointer, Rule.INTEGER_PAST_64_BITS
        elif isinstance(item, int) and not MIN_JSON_INT <= item <= MAX_JSON_INT:
            return pointer, Rule.INTEGER_PAST_64_BITS
    return None


def parse(body: bytes) -> tuple[object, tuple[str, Rule] | None]:
    """Parse one strict JSON document.

    Args:
        body: the raw bytes, whole.

    Returns:
        (value, fault): the decoded value (objects are dicts, arrays lists) and the first
        strictness fault as (pointer, rule), or None when the document is clean. When a
        fault is reported the value may contain private markers; do not use it beyond
        reading the top level.

    Raises:
        JsonSyntaxError: the bytes are not a JSON document at all.
        TypeError: `body` is not bytes (our bug).
    """
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError("parse() takes bytes")
    body = bytes(body)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonSyntaxError(f"invalid UTF-8 at byte {exc.start}") from None
    if _too_deep(body):
        raise JsonSyntaxError(f"nesting deeper than {MAX_NESTING}")
    try:
        value = _FAST.decode(text)
    except _Slow:
        return _parse_marking(text)
    except _BadConstant as exc:
        raise JsonSyntaxError(f"{exc.args[0]} is not JSON") from None
    except json.JSONDecodeError as exc:
        raise JsonSyntaxError(f"{exc.msg} at character {exc.pos}") from None
    except RecursionError:  # pragma: no cover - _too_deep bounds nesting first
        raise JsonSyntaxError("nesting too deep") from None
    if b"null" in body or (b"\\u" in body and _SURROGATE_ESCAPE.search(body)):
        return value, first_fault(value)
    return value, None


def _parse_marking(text: str) -> tuple[object, tuple[str, Rule] | None]:
    try:
        value = _MARKING.decode(text)
    except _BadConstant as exc:
        raise JsonSyntaxError(f"{exc.args[0]} is not JSON") from None
    except json.JSONDecodeError as exc:
        raise JsonSyntaxError(f"{exc.msg} at character {exc.pos}") from None
    except (ValueError, RecursionError):  # pragma: no cover - defensive
        raise JsonSyntaxError("unreadable number or nesting") from None
    return value, first_fault(value)

