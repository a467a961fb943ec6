"""Opening a backup (custody/_backup.py writes them) and restoring it. HAZARDOUS.

The mirror of the export: decrypt in memory, check everything, seal each secret under
this host's KEK, wipe. Version 1 (written before custody held only keys) is still read
(`_RECORD_READERS`): its record's `name` and `creator` become `public`, its `depth` is
dropped (the directory derives depth from the owner chain). Each secret is copied from the
decrypted buffer into a bytearray and decoded by `parse_secret_text` without a `str` of
it ever existing.

Rules:
- age authenticates nothing about who wrote a file: anyone who knows a recipient can make
  one. `open_backup` therefore treats the plaintext as hostile: bounded sizes, every field
  checked, each secret must derive its record's pubkey, each NIP-OA tag must verify against
  its owner, no pubkey and no mint reference twice (the keystore holds each once, so no
  backup it wrote repeats one). Any fault refuses the whole backup, naming the entry.
- The file's size does not bound its parsed JSON (`[{},{},…]` grows 25-fold), so before
  json.loads sees a line: it is no longer than any line a backup holds (MAX_LINE_BYTES),
  and the values of the lines so far, counted in the raw bytes (`values_at_most`), are no more
  than the largest legitimate backup holds (MAX_BACKUP_VALUES).
- Linear in the agents, even for a hostile backup: `public` and the plan's owner lookups
  go through a dict, and the plan finds ownership cycles in one walk that takes each
  owner step once (`_owning_themselves`), not a walk up the chain per agent.
- `restore_backup` refuses the whole restore (before writing anything) if an agent is held
  here under another owner, was removed here (its tombstone stays, the key cannot return),
  its mint reference names another agent, or it would close an ownership cycle (the rule
  `import_agent` checks with `_ownership.owned_through`, here for all the backup's agents
  at once). An agent already held with the same owner is left as it is ("already held").
  It refuses too a restore that would take the keystore past `MAX_RECORDS` records
  (custody/_records.py), destroyed ones included: past it the custodian's `agents` answer
  (every record in one frame) may not fit; the daemon could neither start nor refresh.
  `max_records` (the configured, softer bound on mints and imports) it does not ask.
- Errors are `CustodyError` with one line that never quotes a secret. pyrage's own error
  text is not passed on (only "does not decrypt with this identity").
- pyrage returns immutable `bytes`: the plaintext exists once as a `bytes` object, zeroed
  in place by `wipe_bytes` right after it is copied. The age identity passes through a
  `str` (the only form pyrage takes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING

import pyrage

from custody._backup import MAX_PUBLIC_BYTES, PREFIX, _canonical, _SECRET_HEX, _zero
from custody._errors import CustodyError
from buzzwire.jsonvalues import values_at_most
from custody._keystore import KeyRecord
from custody._secp256k1 import is_xonly_pubkey, xonly_pubkey
from custody._sealed import seal
from custody._secret import Secret, parse_secret_text, wipe_bytes
from custody._records import MAX_RECORDS, OWNER_TAG_CONDITIONS
from custody._signer import CONDITIONS_FAULT, owner_tag_fault
from buzzwire.nostr import is_hex64

if TYPE_CHECKING:
    from custody._facade import Custody

__all__ = ["BackupContents", "RestoreResult", "open_backup", "restore_backup", "restore_plan",
           "MAX_BACKUP_BYTES", "MAX_BACKUP_VALUES", "MAX_IDENTITY_BYTES", "MAX_LINE_BYTES"]

#: A backup's ciphertext is read whole into memory: 64 MiB holds well over 100,000 agents
#: (about 400 bytes each). It bounds the buffers, not the parsed JSON: `[{},{},…]` grows
#: 25-fold as objects (a 64 MiB header line took 1.6 GiB); MAX_LINE_BYTES and
#: MAX_BACKUP_VALUES bound those.
MAX_BACKUP_BYTES = 64 * 1024 * 1024
#: An identity file from `age-keygen` is about 200 bytes; a few identities fit easily.
MAX_IDENTITY_BYTES = 16 * 1024
#: Bounds on a record's public fields (a hostile backup must not smuggle megabytes in).
MAX_NAME_CHARS = 256
MAX_MINT_REF_CHARS = 512
MAX_DEPTH = 1_000
#: The largest `createdAt` the keystore stores (a SQLite integer); a larger one failed in
#: the middle of a restore, past the checks, with the earlier agents already written.
MAX_CREATED_AT = 2**63 - 1


def _line_bytes(record: dict[str, object]) -> int:
    return _SECRET_HEX + len(b" \n") + len(_canonical(record))


#: The character the writer's ASCII JSON spells longest: a surrogate pair, 12 bytes.
_WIDEST = "\U0001f600"
_LONGEST_KEY = {"authTag": ["auth", "0" * 64, OWNER_TAG_CONDITIONS, "0" * 128],
                "createdAt": MAX_CREATED_AT,
                "mintRef": _WIDEST * MAX_MINT_REF_CHARS, "owner": "0" * 64, "pubkey": "0" * 64}
#: The longest line a backup written here holds (10,733 bytes: v2 with a mint reference
#: and a public entry at their bounds; v1's longest is shorter). A longer one, the header
#: too, is refused unread: the strings pass of `values_at_most` and json.loads then see at most
#: this much at once.
MAX_LINE_BYTES = max(
    _line_bytes({**_LONGEST_KEY, "public": {"x": "a" * (MAX_PUBLIC_BYTES - len('{"x":""}'))}}),
    _line_bytes({**_LONGEST_KEY, "creator": "0" * 64, "depth": MAX_DEPTH,
                 "name": _WIDEST * MAX_NAME_CHARS}))
#: Values and member names a legitimate line holds at most past its first, each after
#: one of `,:[{`: the record's members (six; v1 eight), its NIP-OA tag's four strings, and
#: the public entry both writers make (name, creator).
_LINE_VALUES = 20
#: The shortest line: a record with no tag, mint reference or public entry (274 bytes).
_SHORTEST_LINE = _line_bytes({"authTag": None, "createdAt": 0, "mintRef": None,
                              "owner": "0" * 64, "pubkey": "0" * 64, "public": {}})
#: Values in the whole plaintext at most (4,898,440), counted before each line is parsed:
#: MAX_BACKUP_BYTES holds no more shortest lines, each with no more than _LINE_VALUES. It
#: bounds what the parsed lines hold together. Measured, open_backup's peak RSS rose by
#: 445 MiB for a hostile file at the bound (a 10 MiB one of public entries of nested
#: lists, the costliest shape, ~90 bytes a value), and by 314 MiB for a legitimate 64 MiB
#: backup (210,000 agents); before the bound, by 1.6 GiB for a 64 MiB header line.
MAX_BACKUP_VALUES = _LINE_VALUES * (MAX_BACKUP_BYTES // _SHORTEST_LINE)
_KEY_FIELDS = frozenset({"authTag", "createdAt", "mintRef", "owner", "pubkey"})


@dataclass(frozen=True, slots=True)
class _Entry:
    record: KeyRecord
    #: the caller's public entry, as exported (v1: the name and creator it held)
    public: Mapping[str, object]
    #: Where the entry's 64 secret hex digits start in the plaintext buffer.
    offset: int


class BackupContents:
    """A decrypted, checked backup: public records plus the plaintext buffer holding the
    secrets. Wipe it (`with` block, or `wipe()`) as soon as the restore is done.

    Only `open_backup` makes one.
    """

    __slots__ = ("_plaintext", "_entries", "_by_pubkey", "created_at")

    def __init__(self, plaintext: bytearray, entries: tuple[_Entry, ...], created_at: int,
                 *, _factory: object = None) -> None:
        if _factory is not _FACTORY:
            raise TypeError("use custody.open_backup(...)")
        self._plaintext = plaintext
        self._entries = entries
        # Both restore commands ask `public` once per agent: a scan each would be n².
        self._by_pubkey = {entry.record.pubkey: entry for entry in entries}
        self.created_at = created_at

    @property
    def records(self) -> tuple[KeyRecord, ...]:
        return tuple(entry.record for entry in self._entries)

    def public(self, pubkey: str) -> Mapping[str, object]:
        """The public entry exported with the agent (`{}` if none, or not in the backup)."""
        entry = self._by_pubkey.get(pubkey)
        return MappingProxyType({}) if entry is None else entry.public

    def _secrets(self) -> Iterator[tuple[KeyRecord, Secret]]:
        """Each entry's record and a fresh Secret the caller wipes (use `with`)."""
        for entry in self._entries:
            text = bytearray(_SECRET_HEX)
            text[:] = memoryview(self._plaintext)[entry.offset : entry.offset + _SECRET_HEX]
            yield entry.record, parse_secret_text(text)  # zeroes `text`

    def wipe(self) -> None:
        _zero(self._plaintext)

    def __enter__(self) -> BackupContents:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.wipe()

    def __repr__(self) -> str:
        return f"BackupContents(<{len(self._entries)} agents, secrets redacted>)"

    __str__ = __repr__

    def __reduce__(self) -> str:
        raise TypeError("a BackupContents cannot be pickled")


_FACTORY = object()


def _identities(identity_text: bytearray) -> list[pyrage.x25519.Identity]:
    """The `AGE-SECRET-KEY-1…` lines of an identity file (comments and blanks skipped)."""
    identities = []
    lines = identity_text.splitlines()  # bytearrays: zeroed below
    try:
        for line in lines:
            text = line.strip()
            try:
                if not text or text.startswith(b"#"):
                    continue
                identities.append(pyrage.x25519.Identity.from_str(text.decode("ascii")))
            except (pyrage.IdentityError, UnicodeDecodeError, ValueError):
                raise CustodyError("the identity file holds a line that is not an age "
                                   "X25519 identity (AGE-SECRET-KEY-1…)") from None
            finally:
                _zero(text)
    finally:
        for line in lines:
            _zero(line)
    if not identities:
        raise CustodyError("the identity file holds no age identity (AGE-SECRET-KEY-1…)")
    return identities


def open_backup(ciphertext: bytes, identity_text: bytearray) -> BackupContents:
    """Decrypt a backup with the identities in `identity_text` (zeroed here) and check it.

    Checks, every one refusing the whole backup: the format line; no line over
    MAX_LINE_BYTES and no more than MAX_BACKUP_VALUES JSON values, both before a line is
    parsed; each entry's shape and bounds; its secret derives its `pubkey`; its owner is
    a curve point and not the agent; its NIP-OA tag (if any) is by its owner and
    verifies; no pubkey and no mint reference appears twice; the header's count matches.

    Raises:
        CustodyError: too large, does not decrypt with these identities (wrong identity,
            a damaged or altered file), a line too long, too many values, or the first
            entry that fails a check (by number and pubkey; never a secret).
    """
    try:
        if len(ciphertext) > MAX_BACKUP_BYTES:
            raise CustodyError(f"the backup is larger than {MAX_BACKUP_BYTES} bytes")
        identities = _identities(identity_text)
    finally:
        _zero(identity_text)
    try:
        decrypted = pyrage.decrypt(ciphertext, identities)
    except pyrage.DecryptError:
        raise CustodyError("the backup does not decrypt with this identity (wrong identity, "
                           "or the file is damaged, altered or not an age file)") from None
    plaintext = bytearray(decrypted)
    wipe_bytes(decrypted)
    try:
        entries, created_at = _parse(plaintext)
    except BaseException:
        _zero(plaintext)
        raise
    return BackupContents(plaintext, entries, created_at, _factory=_FACTORY)


def _fault(number: int, what: str) -> CustodyError:
    return CustodyError(f"backup entry {number}: {what}; nothing restored")


def _counted(data: bytes, total: int) -> int:
    """`total` and the values of `data`, a line about to be parsed, past its first (counted
    again without strings past what a legitimate line holds), if within the bound."""
    total += values_at_most(data, _LINE_VALUES, MAX_BACKUP_VALUES - total + 1) - 1
    if total > MAX_BACKUP_VALUES:
        raise CustodyError(f"the backup holds more than {MAX_BACKUP_VALUES} JSON values, "
                           "more than any backup written here; nothing restored")
    return total


def _parse(plaintext: bytearray) -> tuple[tuple[_Entry, ...], int]:
    view = memoryview(plaintext)
    end = plaintext.find(b"\n")
    space = plaintext.find(b" ", 0, end)
    if not plaintext.startswith(PREFIX) or end < 0 or space < 0:
        raise CustodyError("not a buzz-broker backup (format line missing)")
    reader = _RECORD_READERS.get(bytes(view[len(PREFIX) : space]))
    if reader is None:
        raise CustodyError("a buzz-broker backup of a format this version does not know")
    if end > MAX_LINE_BYTES:
        raise CustodyError(f"not a buzz-broker backup (a header line over {MAX_LINE_BYTES} "
                           "bytes)")
    text = bytes(view[space + 1 : end])
    values = _counted(text, 0)
    try:
        header = json.loads(text)
        count, created_at = header["agents"], header["createdAt"]
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: deep nesting
        raise CustodyError("not a buzz-broker backup (header unreadable)") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in (count, created_at)):
        raise CustodyError("not a buzz-broker backup (header unreadable)")
    entries: list[_Entry] = []
    seen: set[str] = set()
    mint_refs: dict[str, str] = {}  # mint reference -> the agent holding it
    position = end + 1
    while position < len(plaintext):
        number = len(entries) + 1
        end = plaintext.find(b"\n", position)
        if end < 0 or end - position < _SECRET_HEX + 2 or plaintext[position + _SECRET_HEX] != 0x20:
            raise _fault(number, "malformed line")
        if end - position > MAX_LINE_BYTES:
            raise _fault(number, f"a line over {MAX_LINE_BYTES} bytes, longer than any backup's")
        text = bytes(view[position + _SECRET_HEX + 1 : end])
        values = _counted(text, values)
        record, public = _record(text, number, reader)
        if record.pubkey in seen:
            raise _fault(number, f"agent {record.pubkey} appears twice")
        seen.add(record.pubkey)
        if record.mint_ref is not None:
            # Found here, not when sealing: the keystore refuses the second one after the
            # first is sealed, and every rerun would stop at it again.
            other = mint_refs.setdefault(record.mint_ref, record.pubkey)
            if other != record.pubkey:
                raise _fault(number, f"agent {record.pubkey}: mint reference "
                                     f"{record.mint_ref!r} appears twice (also agent {other})")
        entry = _Entry(record=record, public=public, offset=position)
        _check_secret(plaintext, entry, number)
        entries.append(entry)
        position = end + 1
    if len(entries) != count:
        raise CustodyError(f"the backup says {_said(count)} agents but holds {len(entries)}")
    return tuple(entries), created_at


#: Digits of a header's count a refusal quotes, at most: a 64-bit count's. A hostile
#: file's count runs to 4,300 (json's int() bound), and the refusal is one line.
_QUOTED_DIGITS = 20


def _said(count: int) -> str:
    """`count`, the header's, as a refusal quotes it: past 64 bits only its length."""
    digits = str(count)
    return digits if len(digits) <= _QUOTED_DIGITS else f"a {len(digits)}-digit number of"


def _check_secret(plaintext: bytearray, entry: _Entry, number: int) -> None:
    text = bytearray(_SECRET_HEX)
    text[:] = memoryview(plaintext)[entry.offset : entry.offset + _SECRET_HEX]
    try:
        with parse_secret_text(text) as secret:
            derived = xonly_pubkey(secret).hex()
    except CustodyError:
        raise _fault(number, "the secret key is malformed") from None
    if derived != entry.record.pubkey:
        raise _fault(number, f"the secret key does not derive pubkey {entry.record.pubkey}")


def _optional_hex(value: object) -> bool:
    return value is None or is_hex64(value)


def _public_v1(obj: dict[str, object], number: int, pubkey: str) -> dict[str, object]:
    """A version-1 record's name, creator and depth, checked; name and creator kept."""
    name, creator, depth = obj["name"], obj["creator"], obj["depth"]
    if not _optional_hex(creator):
        raise _fault(number, "a pubkey is not 64 lowercase hex")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise _fault(number, f"agent {pubkey}: bad name")
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DEPTH:
        raise _fault(number, f"agent {pubkey}: bad depth")
    return {"name": name, "creator": creator}


def _public_v2(obj: dict[str, object], number: int, pubkey: str) -> dict[str, object]:
    public = obj["public"]
    if not isinstance(public, dict):
        raise _fault(number, f"agent {pubkey}: bad public entry")
    try:
        fits = len(_canonical(public)) <= MAX_PUBLIC_BYTES
    except RecursionError:  # nested deeper than json.dumps goes
        fits = False
    if not fits:
        raise _fault(number, f"agent {pubkey}: bad public entry")
    return public


@dataclass(frozen=True, slots=True)
class _RecordReader:
    """One format version's record: the fields beyond the key's, and how they become the
    public entry."""

    extra: frozenset[str]
    public: Callable[[dict[str, object], int, str], dict[str, object]]


#: format version (as written on the format line) -> its record reader
_RECORD_READERS: Mapping[bytes, _RecordReader] = {
    b"1": _RecordReader(frozenset({"creator", "depth", "name"}), _public_v1),
    b"2": _RecordReader(frozenset({"public"}), _public_v2),
}


def _record(data: bytes, number: int, reader: _RecordReader
            ) -> tuple[KeyRecord, Mapping[str, object]]:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):  # json refuses deep nesting with RecursionError
        raise _fault(number, "the record is not JSON") from None
    try:
        # "\ud800" parses to a lone surrogate: no text, and a name holding one would break
        # whatever later writes it as UTF-8 (the directory, a --names-out file).
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        raise _fault(number, "the record holds a lone surrogate escape, not text") from None
    if not isinstance(obj, dict) or set(obj) != _KEY_FIELDS | reader.extra:
        raise _fault(number, "the record's fields are not the expected ones")
    pubkey, owner, tag = obj["pubkey"], obj["owner"], obj["authTag"]
    created_at, mint_ref = obj["createdAt"], obj["mintRef"]
    if not is_hex64(pubkey) or not is_hex64(owner):
        raise _fault(number, "a pubkey is not 64 lowercase hex")
    if owner == pubkey or not is_xonly_pubkey(bytes.fromhex(owner)):
        raise _fault(number, f"agent {pubkey}: its owner is not a valid owner key")
    public = reader.public(obj, number, pubkey)
    if (not isinstance(created_at, int) or isinstance(created_at, bool)
            or not 0 <= created_at <= MAX_CREATED_AT):
        raise _fault(number, f"agent {pubkey}: bad createdAt")
    if mint_ref is not None and (not isinstance(mint_ref, str)
                                 or not 0 < len(mint_ref) <= MAX_MINT_REF_CHARS):
        raise _fault(number, f"agent {pubkey}: bad mintRef")
    auth_tag: tuple[str, str, str, str] | None = None
    if tag is not None:
        if not isinstance(tag, list) or not all(isinstance(t, str) for t in tag):
            raise _fault(number, f"agent {pubkey}: its NIP-OA tag does not verify against its owner")
        fault = owner_tag_fault(tag, agent=pubkey, owner=owner)  # conditions too (issue 22 L5)
        if fault is not None:
            raise _fault(number, f"agent {pubkey}: " + (
                fault if fault == CONDITIONS_FAULT
                else "its NIP-OA tag does not verify against its owner"))
        auth_tag = (tag[0], tag[1], tag[2], tag[3])
    record = KeyRecord(pubkey=pubkey, owner=owner, auth_tag=auth_tag, created_at=created_at,
                       deleted_at=None, mint_ref=mint_ref)
    return record, MappingProxyType(public)


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """Public keys restored (sealed here now) and those already held unchanged."""

    restored: tuple[str, ...]
    already_held: tuple[str, ...]


def restore_plan(custody: Custody, contents: BackupContents) -> RestoreResult:
    """What `restore_backup` would do, from public records only (no token call).

    Raises:
        CustodyError: an agent held here under another owner, removed here, a mint
            reference used by another agent here, an ownership cycle (with the agents
            held here and the backup's others together: the check `import_agent` makes),
            or more records than MAX_RECORDS once restored.
    """
    in_backup = contents._by_pubkey

    def owner_of(pubkey: str) -> str | None:
        # The graph as it would be after the restore. A held agent's owner is the same
        # in both (a different one is refused below), so the backup's answer is right.
        entry = in_backup.get(pubkey)
        if entry is not None:
            return entry.record.owner
        existing = custody._keystore.get(pubkey)
        return None if existing is None else existing.owner

    cyclic = _owning_themselves(in_backup, owner_of)
    restored, held = [], []
    for record in contents.records:
        existing = custody._keystore.get(record.pubkey)
        if existing is not None and not existing.live:
            raise CustodyError(f"agent {record.pubkey} was removed on this host; its tombstone "
                               "is kept and it cannot return; nothing restored")
        if existing is not None and existing.owner != record.owner:
            raise CustodyError(f"agent {record.pubkey} is held here for another owner "
                               f"({existing.owner}); refusing to overwrite; nothing restored")
        if existing is not None:
            held.append(record.pubkey)
            continue
        if record.mint_ref is not None:
            other = custody._keystore.by_mint_ref(record.mint_ref)
            if other is not None:
                raise CustodyError(f"agent {record.pubkey}: its mint reference is used here by "
                                   f"agent {other.pubkey}; refusing to overwrite; nothing restored")
        if record.pubkey in cyclic:
            raise CustodyError(f"agent {record.pubkey}: ownership cycle: it would own its own "
                               f"owner {record.owner}, directly or through its agents; "
                               "nothing restored")
        restored.append(record.pubkey)
    records = custody._index.count()  # destroyed ones included, as the `agents` answer
    if restored and records + len(restored) > MAX_RECORDS:
        raise CustodyError(
            f"the keystore holds {records} records, destroyed ones included, and the backup "
            f"adds {len(restored)}: past {MAX_RECORDS}, the most the custodian's `agents` "
            "answer carries; forget destroyed agents' records first (`buzz-broker custodian "
            "FILE --forget-destroyed`; custody in the daemon: `buzz-broker agent forget "
            "PUBKEY ...`); nothing restored")
    return RestoreResult(restored=tuple(restored), already_held=tuple(held))


def _owning_themselves(agents: Collection[str], owner_of: Callable[[str], str | None]
                       ) -> frozenset[str]:
    """Those of `agents` that own themselves through `owner_of`'s chain: those for which
    `_ownership.owned_through(owner_of(agent), agent, owner_of)` is true.

    Why not that call per agent: each climbs the whole chain above its agent, so n agents
    each owning the next cost n²/2 steps (20,000 took 44 s). Here each pubkey's owner is
    asked once: a walk stops at a pubkey an earlier walk settled, whose answer it cannot
    change (its chain never returns into this walk's pubkeys, all unsettled). An agent
    whose chain runs into a loop not through it (one stored before cycles were refused)
    is not in the answer, as `owned_through` says too.
    """
    on_loop: dict[str, bool] = {}  # settled pubkey -> its chain comes back to it
    for start in agents:
        path: dict[str, int] = {}  # this walk's pubkeys, by step
        current: str | None = start
        while current is not None and current not in on_loop and current not in path:
            path[current] = len(path)
            current = owner_of(current)
        loop_from = path.get(current, len(path)) if current is not None else len(path)
        for pubkey, step in path.items():
            on_loop[pubkey] = step >= loop_from
    return frozenset(agent for agent in agents if on_loop[agent])


async def restore_backup(custody: Custody, contents: BackupContents) -> RestoreResult:
    """Seal every agent of `contents` not already held under this host's KEK, in one hop.

    The plan is checked again inside the hop (the daemon may have minted meanwhile); every
    agent is sealed and inserted with its backed-up key record (same pubkey, owner, NIP-OA
    tag, mint reference); its public entry is the caller's to write (`contents.public`). Each agent is one keystore transaction: a crash midway
    leaves some restored, and running the restore again finishes the rest.

    Raises:
        CustodyError: as `restore_plan`; token or keystore faults.
    """
    def work() -> RestoreResult:
        plan = restore_plan(custody, contents)
        wanted = set(plan.restored)
        now = int(time.time())
        for record, secret in contents._secrets():
            with secret:
                if record.pubkey in wanted:
                    custody._keystore.insert(record, seal(custody._token, secret, record.pubkey), now)
        return plan

    return await custody._hop("restore", work)
