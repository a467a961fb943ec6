"""Text rules every scalar shares: trimming, the characters a name may not hold, and the one
escape that shows agent-chosen text to an operator.

Rules (NIP-BA "Wire and normalization"; docs/protocol.md "Text an operator reads"):
- Trimming removes exactly the 25 code points of Unicode's `White_Space` property from both
  ends (`WHITE_SPACE`), as NIP-BA and Buzz's Rust SDK do. Python's `str.strip()` and
  `str.isspace()` also take U+001C-U+001F (the information separators), which are not
  `White_Space`: a name "\\u001cBob" is not "Bob", and content made of U+001C is not blank.
- Which characters a trimmed scalar may not hold is a table keyed by `TextKind`:
  `LINE` (a name, runtime/provider/model, picture, reaction: read by an operator as one
  line) refuses every C0 and C1 control and DEL, the line and paragraph separators, and the
  bidi embeddings, overrides and isolates (U+202A-202E, U+2066-2069: they reorder the rest
  of the line they are printed on). `PROSE` (systemPrompt, about) keeps TAB, LF and CR and
  the bidi controls (prose has lines, and right-to-left authors use embeddings) and refuses
  the other controls: ESC, BEL and CSI have no place in prose and are the bytes a terminal
  acts on. Other format characters (ZWJ, ZWNJ, LRM/RLM, soft hyphen, BOM) are kept: emoji
  sequences and Persian or Indic names need ZWJ/ZWNJ, and none of them can move the cursor,
  end a line or reorder text beyond their own neighbours.
- Text published exactly as written (message content, memory values, observer payloads)
  is not refused anything; wherever it is shown, it is escaped.
- `printable` is the one escape for showing agent text (names from any store, relay
  reasons, details) on a terminal: every character of `_ESCAPED` (the controls, the line
  separators, the bidi controls and lone surrogates) becomes `\\xNN` or `\\uNNNN`, and a
  backslash is doubled so the escape cannot be forged. `printable_json` is the same escape
  inside JSON text: `json.dumps` escapes C0 already, the rest become `\\uNNNN`, which keeps
  the document valid and its value unchanged (`printable_json_text` does the same to JSON
  text already written, such as a daemon's response, and drops the TAB, LF and CR a
  pretty-printer puts between tokens: escaped there they would not be JSON).

WARNING: the three character sets are one fact each; docs/protocol.md lists them in words.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from typing import Final

__all__ = ["WHITE_SPACE", "TextKind", "trim", "is_blank", "refused_in", "scrub_line",
           "printable", "printable_json", "printable_json_text"]

#: Unicode's White_Space property (PropList.txt), all 25 code points: TAB, LF, VT, FF, CR,
#: space, NEL, NBSP, OGHAM SPACE MARK, U+2000-200A, LINE and PARAGRAPH SEPARATOR, NNBSP,
#: MMSP, IDEOGRAPHIC SPACE. Stable since Unicode 6.3 (U+180E left it then).
WHITE_SPACE: Final = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)


class TextKind(enum.Enum):
    #: read as one line: names, runtime/provider/model, picture, reaction
    LINE = "line"
    #: multi-line prose: systemPrompt, about
    PROSE = "prose"


#: Character classes, as regular-expression ranges.
_C0_BUT_TAB_LF_CR = "\x00-\x08\x0b\x0c\x0e-\x1f"
_TAB_LF_CR = "\t\n\r"
_DEL_AND_C1 = "\x7f-\x9f"
_LINE_SEPARATORS = "\u2028\u2029"
#: LRE, RLE, PDF, LRO, RLO; LRI, RLI, FSI, PDI (Unicode UAX #9; "Trojan Source").
_BIDI_CONTROLS = "\u202a-\u202e\u2066-\u2069"
_SURROGATES = "\ud800-\udfff"

#: TextKind -> the characters a trimmed scalar of that kind may not hold.
_REFUSED: Final[dict[TextKind, re.Pattern[str]]] = {
    TextKind.LINE: re.compile(
        f"[{_C0_BUT_TAB_LF_CR}{_TAB_LF_CR}{_DEL_AND_C1}{_LINE_SEPARATORS}{_BIDI_CONTROLS}]"),
    TextKind.PROSE: re.compile(f"[{_C0_BUT_TAB_LF_CR}{_DEL_AND_C1}]"),
}
#: What `printable` escapes: everything a terminal (or a log viewer) could act on.
_ESCAPED: Final = re.compile(
    f"[{_C0_BUT_TAB_LF_CR}{_TAB_LF_CR}{_DEL_AND_C1}{_LINE_SEPARATORS}{_BIDI_CONTROLS}{_SURROGATES}]")
_ESCAPED_OR_BACKSLASH: Final = re.compile(rf"\\|{_ESCAPED.pattern}")
#: `str.translate` table deleting the JSON whitespace `_ESCAPED` holds (TAB, LF, CR).
_FORMATTING_WHITESPACE: Final = dict.fromkeys(map(ord, _TAB_LF_CR))
#: What `scrub_line` puts in place of a refused character.
_REPLACEMENT = "\ufffd"


def trim(value: str) -> str:
    """`value` without leading and trailing White_Space (and nothing else)."""
    return value.strip(WHITE_SPACE)


def is_blank(value: str) -> bool:
    """True when `value` holds no character outside White_Space (the empty string too)."""
    return not value.strip(WHITE_SPACE)


def refused_in(value: str, kind: TextKind) -> bool:
    """True when `value` holds a character a scalar of `kind` may not hold."""
    return _REFUSED[kind].search(value) is not None


def scrub_line(value: str) -> str:
    """`value` with each character `LINE` text refuses replaced by U+FFFD.

    For a name read from a record this host did not validate (another client's kind 30177,
    a restored directory) that must still go out in an outcome, which holds only valid names.
    """
    return _REFUSED[TextKind.LINE].sub(_REPLACEMENT, value)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: str) -> str:
    """`value` safe to write to a terminal: see the module docstring."""
    return _ESCAPED_OR_BACKSLASH.sub(_escape, value)


def _escape_json(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def printable_json(value: object, *, compact: bool = False,
                   default: Callable[[object], object] | None = None) -> str:
    """`value` as JSON text (non-ASCII kept) with every `_ESCAPED` character escaped.

    Raises:
        TypeError: `value` holds something JSON cannot carry and `default` is None.
    """
    separators = (",", ":") if compact else None
    return printable_json_text(
        json.dumps(value, ensure_ascii=False, separators=separators, default=default))


def printable_json_text(text: str) -> str:
    """Valid JSON text (a daemon's response, a log line) as one line with every `_ESCAPED`
    character written as `\\uNNNN`: the same JSON value, safe to write to a terminal.

    Formatting whitespace (TAB, LF, CR between tokens) is dropped, not escaped: outside a
    string `\\u000a` is not JSON."""
    # In valid JSON a raw TAB, LF or CR can only be whitespace between tokens (a string
    # must escape them), and no two tokens need it to stay apart, so dropping them keeps
    # the value. Every other `_ESCAPED` character can only stand inside a string, where
    # `\\uNNNN` is the same character; every backslash there starts an escape, so the
    # characters replaced stand alone and the result is still valid JSON.
    return _ESCAPED.sub(_escape_json, text.translate(_FORMATTING_WHITESPACE))
