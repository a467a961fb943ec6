"""A backup built field by field opens exactly when an independent statement of its checks
passes (with the records as written), and is otherwise refused with one `CustodyError`
line that quotes no secret; never another exception.

Beside tests/backup/test_backup_fuzz.py, which edits one valid version-2 file byte by byte
or swaps one field of its one record: here version 1 and 2 backups of up to three agents
are built whole (owners, NIP-OA tags that verify or not, mint references, v1's name,
creator and depth, v2's public entry), then broken in none, one or two ways: a field of
another value or type, dropped, added, a lone surrogate; a secret that does not derive
its pubkey; an agent or a mint reference twice; a header whose count does not match, or
of any shape; a format version this one does not know. `expected` states the checks of
custody/_restore.py's docstring again without reading its code. And an age file itself
hostile (bytes flipped, inserted or cut; a passphrase file; a header alone) is refused,
unless its bytes are the valid file's own. No token: opening checks, restoring seals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import coincurve
import pyrage
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from buzzwire.nostr import owner_tag_digest
from custody import CustodyError
from custody._restore import BackupContents, open_backup
from tests.adversarial import scaled
from tests.custody._secrets import PUB_1, PUB_2, PUB_3, SECRET_1, SECRET_2, SECRET_3
from tests.custody._secrets import assert_no_secrets

#: Examples for each fault: `make test`, and the long mode (tests/adversarial/__init__.py).
FUZZ = settings(max_examples=scaled(60, 1000), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

IDENTITY = pyrage.x25519.Identity.generate()
AGENTS = {PUB_1: SECRET_1, PUB_2: SECRET_2, PUB_3: SECRET_3}


def _owner_tag(agent: str, owner: str, conditions: str = "") -> list[str]:
    """`owner`'s validly signed NIP-OA tag for `agent`."""
    sig = coincurve.PrivateKey(bytes.fromhex(AGENTS[owner])).sign_schnorr(
        owner_tag_digest(agent, conditions))
    return ["auth", owner, conditions, sig.hex()]


#: (agent, owner) -> the owner's tag for the agent: the only tags here that verify.
TAGS = {(a, o): _owner_tag(a, o) for a in AGENTS for o in AGENTS if a != o}
FIELDS = {"authTag", "createdAt", "mintRef", "owner", "pubkey"}
EXTRA = {"1": {"name", "creator", "depth"}, "2": {"public"}}


# --- the checks, stated again ------------------------------------------------------------
def _lone_surrogate(value: object) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return any(map(_lone_surrogate, value))
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    return False


def _count(value: object) -> bool:
    """A non-negative integer (no bool), as the header and createdAt take."""
    return type(value) is int and value >= 0


def _hex64(value: object) -> bool:
    return type(value) is str and len(value) == 64 and set(value) <= set("0123456789abcdef")


def _a_key(value: object) -> bool:
    """64 lowercase hex digits that are a secp256k1 x-only public key."""
    if not _hex64(value):
        return False
    try:
        coincurve.PublicKeyXOnly(bytes.fromhex(str(value)))
    except ValueError:
        return False
    return True


def _public(version: str, record: dict[str, object]) -> dict[str, object] | None:
    """The public entry a record's fields give, or None if they break a rule."""
    if version == "1":
        name, creator, depth = record["name"], record["creator"], record["depth"]
        if not (type(name) is str and 1 <= len(name) <= 256 and (creator is None or _hex64(creator))
                and type(depth) is int and 1 <= depth <= 1000):
            return None
        return {"name": name, "creator": creator}
    public = record["public"]
    if not isinstance(public, dict) or len(json.dumps(
            public, sort_keys=True, separators=(",", ":")).encode()) > 4096:
        return None
    return public


Opened = list[tuple[tuple[object, ...], Mapping[str, object]]]


def expected(version: str, header: object, lines: list[tuple[str, object]]) -> Opened | None:
    """Each agent's (pubkey, owner, authTag, createdAt, mintRef) and public entry, in the
    backup's order, if the backup opens; None if it is refused."""
    if version not in EXTRA or not isinstance(header, dict):
        return None
    if not (_count(header.get("agents")) and _count(header.get("createdAt"))):
        return None
    opened: Opened = []
    mint_refs: set[str] = set()
    for secret, record in lines:
        if not isinstance(record, dict) or record.keys() != FIELDS | EXTRA[version]:
            return None
        if _lone_surrogate(record):
            return None
        pubkey, owner, tag = record["pubkey"], record["owner"], record["authTag"]
        created_at, mint_ref = record["createdAt"], record["mintRef"]
        if type(pubkey) is not str or AGENTS.get(pubkey) != secret:
            return None
        if not isinstance(owner, str) or not _a_key(owner) or owner == pubkey:
            return None
        if tag is not None and tag != TAGS.get((pubkey, owner)):
            return None
        if not (type(created_at) is int and 0 <= created_at <= 2**63 - 1):
            return None
        if mint_ref is not None and not (type(mint_ref) is str and 1 <= len(mint_ref) <= 512):
            return None
        public = _public(version, record)
        if public is None or pubkey in {o[0][0] for o in opened} or mint_ref in mint_refs:
            return None
        if mint_ref is not None:
            mint_refs.add(mint_ref)
        opened.append(((pubkey, owner, None if tag is None else tuple(tag), created_at,
                        mint_ref), public))
    return opened if len(opened) == header["agents"] else None


# --- backups built field by field --------------------------------------------------------
OTHERS = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=8)
    | st.sampled_from([PUB_1, PUB_2, PUB_1.upper(), "", "\ud800", 10**4299, 2**63]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)
#: Per field, values that break it or sit at its bound (and any value at all).
HOSTILE: Mapping[str, st.SearchStrategy[object]] = {
    "pubkey": st.sampled_from([PUB_1.upper(), PUB_1[:-1], "0" * 64]),
    "owner": st.sampled_from([PUB_1, PUB_2, PUB_3, PUB_2.upper(), "0" * 64, "f" * 64, "0x" + PUB_2[2:]]),
    "authTag": st.sampled_from([*TAGS.values(), _owner_tag(PUB_1, PUB_2, "kind=1"),
                                ["auth", PUB_2, ""], TAGS[PUB_1, PUB_2][:3] + ["0" * 128], []]),
    "createdAt": st.sampled_from([0, 2**63 - 1, 2**63, -1, True, 1.5, "1", 10**4299]),
    "mintRef": st.sampled_from(["", "m" * 512, "m" * 513, "x\ud800", 7]),
    "name": st.sampled_from(["", "n" * 256, "n" * 257, "\udfff", 1]),
    "creator": st.sampled_from([PUB_2, PUB_2.upper(), "", "0" * 64]),
    "depth": st.sampled_from([0, 1, 1000, 1001, True, 2.0]),
    "public": st.sampled_from([{"x": "a" * 4088}, {"x": "a" * 4089}, {"\ud800": 1}, [], "p"]),
}
BAD_SECRETS = st.sampled_from(["g" * 64, "0" * 64, "F" * 64, " " * 64, SECRET_3, SECRET_1[:-1] + "9"])


@st.composite
def _record(draw: st.DrawFn, version: str, pubkey: str, mint_ref: str | None
            ) -> dict[str, object]:
    owner = draw(st.sampled_from([o for o in AGENTS if o != pubkey]))
    record: dict[str, object] = {
        "pubkey": pubkey, "owner": owner, "mintRef": mint_ref,
        "authTag": draw(st.sampled_from([None, TAGS[pubkey, owner]])),
        "createdAt": draw(st.integers(0, 2**63 - 1)),
    }
    if version == "1":
        record |= {"name": draw(st.text(min_size=1, max_size=8)),
                   "creator": draw(st.sampled_from([None, PUB_3, owner])),
                   "depth": draw(st.integers(1, 1000))}
    else:
        record["public"] = draw(st.dictionaries(st.text(max_size=6), OTHERS, max_size=3))
    return record


#: Ways a backup breaks a check (or, by chance, still fits): a field of a record made
#: hostile is named by its field ("field:depth"); "none" leaves the backup fitting.
FAULTS = (*(f"field:{name}" for name in sorted(FIELDS | EXTRA["1"] | EXTRA["2"])),
          "none", "dropped", "added", "secret", "agent twice", "mint twice", "count",
          "created", "header", "version")


@st.composite
def backups(draw: st.DrawFn, fault: str) -> tuple[str, object, list[tuple[str, object]]]:
    """(format version, header, [(secret text, record)]): fitting, then broken by `fault`
    and, a fourth of the time, one more."""
    field = fault.removeprefix("field:") if fault.startswith("field:") else None
    version = draw(st.sampled_from([v for v, extra in EXTRA.items()
                                    if field in extra or field not in EXTRA["1"] | EXTRA["2"]]))
    pubkeys = draw(st.lists(st.sampled_from(sorted(AGENTS)), unique=True,
                            min_size=0 if fault in ("none", "count", "header") else 1, max_size=3))
    refs = draw(st.lists(st.text(min_size=1, max_size=6), unique=True,
                         min_size=len(pubkeys), max_size=len(pubkeys)))
    lines: list[tuple[str, object]] = [
        (AGENTS[pk], draw(_record(version, pk, draw(st.sampled_from([None, ref])))))
        for pk, ref in zip(pubkeys, refs)]
    header: object = {"agents": len(lines), "createdAt": draw(st.integers(0, 2**40))}
    faults = [fault] + draw(st.sampled_from([[], [], [], [draw(st.sampled_from(FAULTS))]]))
    for fault in faults:
        at = draw(st.integers(0, max(len(lines) - 1, 0)))
        record = lines[at][1] if lines else None
        if fault.startswith("field:") and isinstance(record, dict):
            field = fault.removeprefix("field:")
            if field in record:
                record[field] = draw(HOSTILE[field] | OTHERS)
        elif fault == "dropped" and isinstance(record, dict):
            record.pop(draw(st.sampled_from(sorted(record))))
        elif fault == "added" and isinstance(record, dict):  # the other version's, or none's
            record[draw(st.sampled_from(["public", "name", "depth", "secret", ""]))] = 1
        elif fault == "secret" and lines:
            lines[at] = (draw(BAD_SECRETS), lines[at][1])
        elif fault == "agent twice" and lines:
            lines.append((lines[at][0], json.loads(json.dumps(lines[at][1]))))
        elif fault == "mint twice" and len(lines) > 1 and isinstance(record, dict):
            other = lines[at - 1][1]
            assert isinstance(other, dict)
            record["mintRef"] = other["mintRef"] = draw(st.text(min_size=1, max_size=6))
        elif fault == "count" and isinstance(header, dict):
            header["agents"] = draw(st.sampled_from(
                [len(lines) + 1, len(lines) - 1, 2**64, 10**4299, True, "1", None]))
        elif fault == "created" and isinstance(header, dict):
            header["createdAt"] = draw(st.sampled_from([-5, 1.5, None, 10**4299, "1", True]))
        elif fault == "header":
            header = draw(OTHERS)
        elif fault == "version":
            version = draw(st.sampled_from(["0", "3", "10", "02", ""]))
    return version, header, lines


def _line(value: object, ascii_only: bool) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=ascii_only,
                      allow_nan=True).encode("utf-8", "surrogatepass")


def _opened_or_refused(ciphertext: bytes) -> BackupContents | None:
    try:
        return open_backup(ciphertext, bytearray(str(IDENTITY).encode()))
    except CustodyError as exc:
        text = str(exc)
        # One short line: the longest here quote two pubkeys and a short mint reference
        # (a header's count once went into it whole, all 4,300 digits).
        assert text and "\n" not in text and len(text) < 1200, text[:300]
        assert_no_secrets(text.encode(), tuple(AGENTS.values()))
        return None


@pytest.mark.parametrize("fault", FAULTS)
@FUZZ
@given(data=st.data())
def test_a_backup_opens_exactly_when_its_checks_pass(fault: str, data: st.DataObject) -> None:
    """Fault by fault, each check on its own (a record's fields one by one)."""
    version, header, lines = data.draw(backups(fault))
    ascii_only = data.draw(st.booleans())
    plaintext = b"buzz-broker-backup/v" + version.encode() + b" " + _line(header, ascii_only) + b"\n"
    for secret, record in lines:
        plaintext += secret.encode() + b" " + _line(record, ascii_only) + b"\n"
    want = expected(version, header, lines)
    contents = _opened_or_refused(pyrage.encrypt(plaintext, [IDENTITY.to_public()]))
    event("opened" if contents is not None else "refused")
    if contents is None:
        assert want is None, f"refused, but every check passes: {plaintext[:400]!r}"
        return
    try:
        assert want is not None, f"opened, but a check fails: {plaintext[:400]!r}"
        got = [((r.pubkey, r.owner, r.auth_tag, r.created_at, r.mint_ref),
                dict(contents.public(r.pubkey))) for r in contents.records]
        # Public entries compared as JSON: a NaN in one equals no NaN but its own.
        assert [(k, _line(p, True)) for k, p in got] == [(k, _line(p, True)) for k, p in want]
    finally:
        contents.wipe()


VALID = pyrage.encrypt(b'buzz-broker-backup/v2 {"agents":0,"createdAt":1}\n',
                       [IDENTITY.to_public()])
#: `pyrage.passphrase.encrypt(b"x", "pw")`, written once: making one runs scrypt (1.6 s).
PASSPHRASE_FILE = (
    b"age-encryption.org/v1\n-> scrypt 4kYaMtvYv8rBaZfdOnkgWg 19\n"
    b"6JwefSm3ECLx3HDbV4Xxi2LrZScQru0N/K0crYqpOYI\n"
    b"--- CnznbKCLT8nrW7sBSDfiLdBWsK5MY5Nyofk/4VXXdHU\n"
    b"\xc3\n]b\xe4\xf4\xa7\xb6\xd5\\\xc2\n\xa9\xe7n\xb5\xf4\xfbu\xd3|G\x00\x1f!%#\xf4\xa2q\xb1\xc2+")


@settings(FUZZ, max_examples=scaled(300, 5000))
@given(data=st.data())
def test_a_hostile_age_file_is_refused_unless_it_is_the_valid_one(data: st.DataObject) -> None:
    """age authenticates its header (a MAC) and payload (STREAM): any change refuses."""
    base = bytearray(data.draw(st.sampled_from([
        VALID, PASSPHRASE_FILE, VALID.split(b"\n---")[0],
        b"age-encryption.org/v1\n", b"-----BEGIN AGE ENCRYPTED FILE-----\n", b""])))
    for _ in range(data.draw(st.integers(0, 4))):
        at = data.draw(st.integers(0, len(base)))
        edit = data.draw(st.sampled_from(["flip", "stanza", "insert", "cut"]))
        if edit == "flip" and at < len(base):
            base[at] ^= data.draw(st.integers(1, 255))
        elif edit == "stanza":
            base[at:at] = data.draw(st.sampled_from([
                b"\n-> X25519 AAAA\n", b"\n-> scrypt AAAA 99\n", b"-> " + b"a" * 5000 + b"\n",
                b"\x00" * 8]))
        elif edit == "insert":
            base[at:at] = data.draw(st.binary(max_size=16))
        else:
            del base[at:at + data.draw(st.integers(1, 32))]
    contents = _opened_or_refused(bytes(base))
    if contents is not None:
        contents.wipe()
    assert (contents is not None) == (bytes(base) == VALID)
