"""Fuzz for the one file the custody side parses from outside: a backup (issue 26 item 2).

age authenticates nothing about who wrote a file, so a backup's plaintext is hostile
(custody/_restore.py). Whatever plaintext anyone who knows a recipient encrypts,
`open_backup` either opens it (every check passed) or refuses it with one `CustodyError`
line that quotes no secret; nothing else escapes, however deep or broken the JSON. No
token is needed: opening checks, restoring seals.
"""

from __future__ import annotations

import json

import pyrage
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from custody import CustodyError
from custody._restore import MAX_BACKUP_BYTES, BackupContents, open_backup
from tests.custody._secrets import PUB_1, PUB_2, SECRET_1, assert_no_secrets

IDENTITY = pyrage.x25519.Identity.generate()
RECORD = {"authTag": None, "createdAt": 1_700_000_000, "mintRef": None, "owner": PUB_2,
          "public": {"name": "fuzz", "creator": None}, "pubkey": PUB_1}


def _line(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


#: A backup that opens: the format line, one agent.
VALID = (b"buzz-broker-backup/v2 " + _line({"agents": 1, "createdAt": 1_700_000_000})
         + b"\n" + SECRET_1.encode() + b" " + _line(RECORD) + b"\n")


def _opened_or_refused(plaintext: bytes) -> BackupContents | None:
    ciphertext = pyrage.encrypt(plaintext, [IDENTITY.to_public()])
    identity = bytearray(str(IDENTITY).encode())
    try:
        return open_backup(ciphertext, identity)
    except CustodyError as exc:
        text = str(exc)
        assert "\n" not in text and text
        assert_no_secrets(text.encode(), (SECRET_1,))
        return None


@pytest.mark.parametrize("where", ["name", "key"])
def test_a_lone_surrogate_anywhere_in_a_record_is_refused(where: str) -> None:
    # json.loads takes the escape; a name holding it would break every UTF-8 writer after.
    public = ({"name": "\ud800", "creator": None} if where == "name"
              else {"name": "ok", "creator": None, "\udfff": 1})
    plaintext = VALID.replace(_line(RECORD["public"]), _line(public))
    assert plaintext != VALID
    assert _opened_or_refused(plaintext) is None


def test_the_valid_backup_opens() -> None:
    contents = _opened_or_refused(VALID)
    assert contents is not None and [r.pubkey for r in contents.records] == [PUB_1]
    contents.wipe()


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_any_edit_of_a_valid_backup_opens_or_is_refused(data: st.DataObject) -> None:
    plaintext = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(plaintext)))
        edit = data.draw(st.sampled_from(["flip", "insert", "cut"]))
        if edit == "flip" and at < len(plaintext):
            plaintext[at] ^= data.draw(st.integers(1, 255))
        elif edit == "insert":
            plaintext[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del plaintext[at:at + data.draw(st.integers(1, 16))]
    contents = _opened_or_refused(bytes(plaintext))
    if contents is not None:
        contents.wipe()


json_leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                           max_leaves=12)


@given(field=st.sampled_from(sorted(RECORD)), value=json_values)
@settings(max_examples=300, deadline=None)
def test_any_value_in_any_record_field_opens_or_is_refused(field: str, value: object) -> None:
    record = {**RECORD, field: value}
    plaintext = VALID.split(b"\n")[0] + b"\n" + SECRET_1.encode() + b" " + _line(record) + b"\n"
    contents = _opened_or_refused(plaintext)
    if contents is not None:
        contents.wipe()


@pytest.mark.parametrize("where", ["header", "record", "public"])
def test_json_nested_past_the_interpreters_depth_is_refused(where: str) -> None:
    """json raises RecursionError, not ValueError, for deep nesting: it is refused too."""
    deep = "[" * 100_000 + "]" * 100_000
    header = _line({"agents": 1, "createdAt": 1})
    record = _line(RECORD)
    if where == "header":
        header = deep.encode()
    elif where == "record":
        record = deep.encode()
    else:
        record = record.replace(b'{"creator":null,"name":"fuzz"}', deep.encode())
    plaintext = b"buzz-broker-backup/v2 " + header + b"\n" + SECRET_1.encode() + b" " + record + b"\n"
    assert _opened_or_refused(plaintext) is None


def test_a_file_over_the_bound_is_refused_before_decrypting() -> None:
    with pytest.raises(CustodyError, match="larger than"):
        open_backup(b"\0" * (MAX_BACKUP_BYTES + 1), bytearray(str(IDENTITY).encode()))


@pytest.mark.parametrize(("count", "said"), [
    (2, "says 2 agents"), (2**64, f"says {2**64} agents"),
    (10**4299, "says a 4300-digit number of agents"),  # json's int() stops at 4,300 digits
])
def test_a_header_count_that_does_not_match_is_quoted_short(count: int, said: str) -> None:
    """The refusal quotes the hostile file's count only as far as 64 bits go; past them it
    says how long the number is (before, all 4,300 digits of it went into the line)."""
    plaintext = VALID.replace(b'"agents":1', b'"agents":%d' % count)
    with pytest.raises(CustodyError) as refused:
        open_backup(pyrage.encrypt(plaintext, [IDENTITY.to_public()]),
                    bytearray(str(IDENTITY).encode()))
    assert str(refused.value) == f"the backup {said} but holds 1"
