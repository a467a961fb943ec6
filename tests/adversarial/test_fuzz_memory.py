"""Fuzz for the memory actions' two readers/writers of bodies (issue 23).

- NIP-BA's compact-encoding rule, written out here from its text (escapes `\\"` `\\\\`
  `\\b` `\\t` `\\n` `\\f` `\\r`, `\\u00xx` for other controls, literal non-ASCII, `/` as is),
  measures exactly what the contract's `compact_json` writes, so storage.put's 65,535-byte
  bound is the spec's for every string.
- NIP-AE's body reader never raises on any plaintext a relay (or another writer) could
  produce, refuses duplicate members at any depth, and tolerates unknown members.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from buzzwire.contract import StoragePutArgs, compact_json
from daemon.operations._memory import read_body

_SHORT = {'"': 2, "\\": 2, "\b": 2, "\t": 2, "\n": 2, "\f": 2, "\r": 2}


def nip_ba_size(text: str) -> int:
    """The encoded size of a JSON string's characters, by NIP-BA's rule (no quotes)."""
    return sum(_SHORT.get(c, 6 if ord(c) < 0x20 else len(c.encode("utf-8"))) for c in text)


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


@given(slug=st.sampled_from(["core", "mem/a", "mem/x/y_z-1"]), value=texts)
@settings(max_examples=400, deadline=None)
def test_compact_body_size_is_nip_bas_rule(slug: str, value: str) -> None:
    member = "profile" if slug == "core" else "value"
    expected = len(f'{{"slug":"{slug}","{member}":"'.encode()) + nip_ba_size(value) + 2
    assert len(compact_json({"slug": slug, member: value})) == expected
    if value.strip():
        assert len(StoragePutArgs(slug=slug, value=value).body()) == expected


@given(st.binary(max_size=300))
@settings(max_examples=400, deadline=None)
def test_any_plaintext_reads_or_is_invalid(blob: bytes) -> None:
    result = read_body(blob, "mem/a")
    assert result is None or isinstance(result, tuple)


json_leaf = st.none() | st.booleans() | st.integers() | texts
json_values = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(texts, inner, max_size=3), max_leaves=10)


@given(extra=st.dictionaries(texts.filter(lambda k: k not in ("slug", "value")), json_values,
                             max_size=4), value=texts)
@settings(max_examples=300, deadline=None)
def test_unknown_members_are_tolerated(extra: dict[str, object], value: str) -> None:
    body = json.dumps({**extra, "slug": "mem/a", "value": value}, ensure_ascii=False)
    assert read_body(body.encode(), "mem/a") == (value,)


@given(depth=st.integers(0, 4), key=st.sampled_from(["slug", "value", "k"]))
@settings(max_examples=60, deadline=None)
def test_a_duplicate_member_anywhere_is_invalid(depth: int, key: str) -> None:
    inner = f'{{"{key}":1,"{key}":2}}'
    for _ in range(depth):
        inner = f'{{"n":[{inner}]}}'
    body = f'{{"slug":"mem/a","value":"v","deep":{inner}}}' if depth or key == "k" else (
        f'{{"slug":"mem/a","value":"v",{inner[1:-1]}}}')
    assert read_body(body.encode(), "mem/a") is None


def test_tombstone_core_and_hostile_bodies() -> None:
    assert read_body(b'{"slug":"mem/a","value":null}', "mem/a") == (None,)
    assert read_body(b'{"slug":"core","profile":null}', "core") is None  # core has no tombstone
    assert read_body(b'{"slug":"core","profile":"p"}', "core") == ("p",)
    assert read_body(b'{"slug":"mem/a","value":"\\ud800"}', "mem/a") is None  # lone surrogate
    assert read_body(b'{"slug":"mem/a","value":NaN}', "mem/a") is None
    assert read_body(b"[" * 100_000, "mem/a") is None  # nesting past the recursion limit
    assert read_body(b'\xef\xbb\xbf{"slug":"mem/a","value":"v"}', "mem/a") is None  # BOM
    # An unknown member is ignored (NIP-AE), however many digits it holds; an integer
    # value is still no string.
    assert read_body(b'{"slug":"mem/a","value":"v","n":' + b"1" * 5000 + b"}", "mem/a") == ("v",)
    assert read_body(b'{"slug":"mem/a","value":5}', "mem/a") is None
