"""JSON values counted before json.loads allocates them (up to ~72 bytes a value): one count
for the custodian's frames, a backup's lines and the agent client's answers."""

from __future__ import annotations

import re
from typing import Final

__all__ = ["values_at_most"]

#: A string literal (one never closed runs to the end, a lone backslash last included: a
#: match that could fail would be tried again from every later quote), or one of `,:[{`.
_TOKEN: Final = re.compile(rb'"(?:[^"\\]++|\\.?)*+(?:"|\Z)|[,:\[{]', re.DOTALL)


def values_at_most(data: bytes | bytearray, recount_past: int, bound: int) -> int:
    """How many values and member names `data` holds (each but the first follows one of
    `,:[{`, and each string is one): counted in the raw bytes, and when those say more than
    `recount_past`, again outside strings (which may hold those characters), one match at
    a time (a `sub` without strings held 1.4 GiB for a frame of empty strings), stopping
    once past `bound`: then the figure is only known to be past it."""
    count = sum(map(data.count, b",:[{"))
    if count <= recount_past:
        return count + 1
    count, strings = 1, 0
    for match in _TOKEN.finditer(data):
        if data[match.start()] == 0x22:  # '"'
            strings += 1
        else:
            count += 1
        if max(count, strings) > bound:
            break
    return max(count, strings)
