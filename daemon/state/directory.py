"""The public agent directory: names, creators, depth, renames, listing.

Custody holds secrets and the few public facts it needs to use them (each key's owner,
NIP-OA tag, mint reference, and when it was made and destroyed: `custody.KeyRecord`).
Everything else public about an agent is here, in `<state_dir>/directory.db`, written by
the daemon and the command line and never by custody. A directory record joins the two:
custody's key record and this file's row for the agent. The key records come from a
`KeySource`: in-process, `custody.KeyIndex` (the keystore file read-only, without the
token, no secret column); with a custodian, the pipeline's copy of the custodian's records
(`CustodianClient.records`, custody/custodian/records.py: the table's record lookups), so
the pipeline never opens the keystore file.

Who reads it: policy (requester, target by name, depth), agents.update's rename, the
minted-key lookup of a failed agents.create, the daemon's startup listing, `agent list`,
`status`, `credential issue`, `keys backup` (the public entry each agent is backed up
with) and `keys restore` (which writes it back).

Rules:
- Depth is derived, never stored, and the rule is stated once (`child_depth`): an agent
  whose owner is not held here (a person) is at depth 1; an agent whose owner is a key
  held here, live or since removed, sits one level below it. So an agent's depth never
  changes after it is made, and policy's limit, agents.create and `agent create`/`agent
  import` all read it from the owner chain custody keeps.
- A name is this file's row for the agent; else, for a state directory from before names
  left custody, the name custody's schema upgrade set aside (`KeyIndex.v1_names`, copied
  into this file when the file is made: by `open` over the keystore file, at once, so the
  names stay when the keystore later moves to a custodian, whose records carry none);
  else the first 12 hex digits of the pubkey (an agent imported without a name, or a key
  minted by an agents.create that crashed before its name was written: the identical
  retry writes it).
- Two writes, each one short transaction on its own connection (`_sqlite.open_private_db`:
  0600, WAL, synchronous=FULL, busy timeout; and secure_delete): `enroll` names a key that has no name here yet (a replayed
  agents.create never undoes a later rename), `rename` sets a live agent's name. Both
  refuse a key custody does not hold live, and answer None.
- A name stays while custody keeps the key's record, a removed agent's tombstone included:
  `agent list --all` lists it by name, and a custodian's `--recover` brings the key back
  under it. Names are not unique, so none is held against reuse. So the names are bounded
  as the records are, by `max_records` (`[custody]`, or the custodian's `[custodian]`):
  one row per record. A record can go without the daemon being told (a custodian's
  `--forget-destroyed`, under its own uid): `prune` drops the names of keys custody has no
  record of, when the daemon starts and after each destroy, so the bound holds there too.
- Reads go through one read-only connection, made when the file exists: a reader run as
  a user other than the state directory's (`agent list` as root) creates nothing; with
  no file yet, names come from the version-1 fallback alone.
- A file of a schema version this build does not know (a newer build's `PRAGMA
  user_version`) is refused by every read and write, in one line naming both versions:
  read, its rows would pass for this build's; written, it would be marked version 1 again.
- Faults are `DirectoryError`, whose message names the file and never a row's content.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from buzzwire.nostr import is_hex64
from custody import CustodyError, KeyIndex, KeyRecord
from daemon.state._sqlite import open_private_db, transaction

__all__ = ["AgentDirectory", "AgentRecord", "DirectoryError", "DIRECTORY_FILE",
           "HUMAN_OWNED_DEPTH", "KeySource", "PRUNE_AFTER_SECONDS", "check_name", "child_depth"]

T = TypeVar("T")

DIRECTORY_FILE = "directory.db"
#: An agent whose owner is not held on this host (a human) is at depth 1.
HUMAN_OWNED_DEPTH = 1
#: The longest name kept (a display name is at most 120; a restored backup's is bounded).
MAX_NAME_CHARS = 256


def check_name(name: object) -> None:
    """ValueError unless `name` is one the directory can keep (1 to MAX_NAME_CHARS
    characters, all of them storable): what a command checks before it makes the key the
    name is for.

    Storable: SQLite holds UTF-8, and a lone surrogate has no UTF-8 form. One reaches here
    from an argv byte that is not UTF-8 (Python decodes it as U+DC80-U+DCFF) or from a
    backup's JSON escape; refused here, not as a UnicodeEncodeError inside the write.
    """
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise ValueError(f"name must be 1 to {MAX_NAME_CHARS} characters")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("name must be text (a byte that is not UTF-8 cannot be stored)") from None


#: A name written this recently is never pruned: with a custodian the pipeline's copy of
#: its records (custody/custodian/records.py) may not have seen a key an operator's command
#: made a moment ago, and checks a few times a second, longer while the custodian does not
#: answer. An orphan that young goes at the next prune.
PRUNE_AFTER_SECONDS = 60
#: How many hex digits of its pubkey name an agent that was given no name.
DEFAULT_NAME_DIGITS = 12
#: `PRAGMA user_version` of the file this build writes (0: made, not yet marked).
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS names (
    pubkey     TEXT PRIMARY KEY,
    name       TEXT NOT NULL CHECK (length(name) > 0),
    creator    TEXT,
    updated_at INTEGER NOT NULL
) STRICT;
"""


@dataclass(frozen=True, slots=True)
class AgentRecord:
    """An agent's public record: custody's key facts and the directory's own."""

    pubkey: str
    owner: str
    name: str
    auth_tag: tuple[str, str, str, str] | None
    creator: str | None
    depth: int
    created_at: int
    deleted_at: int | None
    mint_ref: str | None = None

    @property
    def live(self) -> bool:
        return self.deleted_at is None

    def to_json_obj(self) -> dict[str, object]:
        return {
            "pubkey": self.pubkey,
            "owner": self.owner,
            "name": self.name,
            "authTag": list(self.auth_tag) if self.auth_tag else None,
            "creator": self.creator,
            "depth": self.depth,
            "createdAt": self.created_at,
            "deletedAt": self.deleted_at,
        }


class _Placed(Protocol):
    """What the depth rule reads of an owner's record (AgentRecord, policy's AgentView)."""

    @property
    def depth(self) -> int: ...


class KeySource(Protocol):
    """Custody's public key records, read-only (`custody.KeyIndex`, or with a custodian
    `CustodianClient.records`). Faults are `CustodyError`."""

    def get(self, pubkey: str) -> KeyRecord | None: ...
    def by_mint_ref(self, mint_ref: str) -> KeyRecord | None: ...
    def all(self, *, include_deleted: bool = False) -> list[KeyRecord]: ...
    def v1_names(self) -> dict[str, tuple[str, str | None]]: ...
    def close(self) -> None: ...


class DirectoryError(Exception):
    """The directory could not be read or written; the message names the file."""


def child_depth(owner: _Placed | None) -> int:
    """The depth of an agent owned by `owner`. `owner` is the owner's record when the owner
    is a key held here (live or removed), None when it is not (a person)."""
    return HUMAN_OWNED_DEPTH if owner is None else owner.depth + 1


def _depths(keys: Mapping[str, KeyRecord], wanted: Iterator[str]) -> dict[str, int]:
    """Each wanted agent's depth by `child_depth` along its owner chain in `keys`. A loop
    (stored by a version from before cycles were refused) ends the chain where it closes."""
    known: dict[str, int] = {}
    for start in wanted:
        chain: list[str] = []
        seen: set[str] = set()
        current = start
        while current in keys and current not in known and current not in seen:
            seen.add(current)
            chain.append(current)
            current = keys[current].owner
        # The chain ends at a key not held here (a person: depth 0 above depth 1), at one
        # already known, or where a loop closes (treated as a person).
        depth = known.get(current, HUMAN_OWNED_DEPTH - 1)
        for pubkey in reversed(chain):
            depth = depth + 1
            known[pubkey] = depth
    return known


class AgentDirectory:
    """Every agent's public record. `AgentDirectory.open(state_dir)`; thread-safe."""

    __slots__ = ("_path", "_keys", "_db", "_lock")

    def __init__(self, path: Path, keys: KeySource) -> None:
        self._path = path
        self._keys = keys
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, state_dir: Path | str, keys: KeySource | None = None) -> AgentDirectory:
        """The directory of `state_dir`; its key records from `keys` (a custodian's), else
        from the keystore file in `state_dir`, whose version-1 names are then taken into
        this file at once (`_take_v1_names`).

        Raises:
            DirectoryError: the version-1 names could not be read or written.
        """
        directory = cls(Path(state_dir) / DIRECTORY_FILE,
                        KeyIndex.open(state_dir) if keys is None else keys)
        if keys is None:
            try:
                directory._take_v1_names()
            except BaseException:
                directory.close()
                raise
        return directory

    def _take_v1_names(self) -> None:
        """Make this file now, the version-1 names copied in (`_writer`), when the keystore
        holds some and the file is not there yet. Left to the first name written, they were
        lost when the keystore moved to a custodian first (docs/install.md 6b), whose
        records carry none. Only where this user makes the state directory's files: run as
        another (root's `agent list` on the daemon's directory), a reader creates nothing."""
        state_dir = self._path.parent
        if self._path.exists() or not _ours(state_dir) or not _call(self._keys.v1_names):
            return
        with self._writer():
            pass

    # --- reads ---------------------------------------------------------------------

    def get(self, pubkey: str) -> AgentRecord | None:
        """The record, tombstones included; None if never held (or not a pubkey)."""
        if not is_hex64(pubkey):
            return None
        chain = self._chain(pubkey)
        if not chain:
            return None
        return self._join(chain[0], self._names(pubkey), _depths(
            {k.pubkey: k for k in chain}, iter([pubkey]))[pubkey])

    def agent(self, pubkey: str) -> AgentRecord | None:
        """The live agent's record; None if unknown or removed."""
        record = self.get(pubkey)
        return record if record is not None and record.live else None

    def by_mint_ref(self, mint_ref: str) -> AgentRecord | None:
        key = _call(lambda: self._keys.by_mint_ref(mint_ref))
        return self.get(key.pubkey) if key is not None else None

    def agents(self, *, include_deleted: bool = False) -> list[AgentRecord]:
        """Every live agent (and every removed one, with include_deleted), oldest first."""
        every = _call(lambda: self._keys.all(include_deleted=True))
        keys = {k.pubkey: k for k in every}
        listed = [k for k in every if include_deleted or k.live]
        depths = _depths(keys, (k.pubkey for k in listed))
        names = self._names(None)
        return [self._join(k, names, depths[k.pubkey]) for k in listed]

    def named(self) -> set[str]:
        """The pubkeys this file has a name for, whether or not custody has their record
        (what `leftovers.prune` matches against custody's records)."""
        return {pubkey for pubkey, _, _ in self._read(None) or ()}

    def _chain(self, pubkey: str) -> list[KeyRecord]:
        """The key and its owners held here, nearest first; stops at a loop."""
        chain: list[KeyRecord] = []
        seen: set[str] = set()
        current = pubkey
        while current not in seen:
            seen.add(current)
            key = _call(lambda: self._keys.get(current))
            if key is None:
                break
            chain.append(key)
            current = key.owner
        return chain

    def _join(self, key: KeyRecord, names: Mapping[str, tuple[str, str | None]],
              depth: int) -> AgentRecord:
        name, creator = names.get(key.pubkey, (key.pubkey[:DEFAULT_NAME_DIGITS], None))
        return AgentRecord(pubkey=key.pubkey, owner=key.owner, name=name,
                           auth_tag=key.auth_tag, creator=creator, depth=depth,
                           created_at=key.created_at, deleted_at=key.deleted_at,
                           mint_ref=key.mint_ref)

    def _names(self, only: str | None) -> dict[str, tuple[str, str | None]]:
        """pubkey -> (name, creator) for every agent, or for the one pubkey `only`: this
        file's rows, or the version-1 fallback."""
        rows = self._read(only)
        if rows is None:
            names = _call(self._keys.v1_names)
            if only is None:
                return names
            return {only: names[only]} if only in names else {}
        return {pubkey: (name, creator) for pubkey, name, creator in rows}

    def _read(self, only: str | None) -> list[tuple[str, str, str | None]] | None:
        """This file's rows (None if the file does not exist yet)."""
        where, args = ("", ()) if only is None else ("WHERE pubkey = ?", (only,))
        with self._lock:
            if self._db is None:
                if not self._path.exists():
                    return None
                try:
                    db = sqlite3.connect(f"file:{self._path}?mode=ro", uri=True,
                                         check_same_thread=False)
                    try:
                        _readable_version(db, self._path)
                    except BaseException:
                        db.close()
                        raise
                except sqlite3.Error as exc:
                    raise DirectoryError(f"cannot open {self._path}: {exc}") from None
                self._db = db
            try:
                return self._db.execute(
                    f"SELECT pubkey, name, creator FROM names {where}", args).fetchall()
            except sqlite3.Error as exc:
                if "no such table" in str(exc):  # made by a writer that has not finished
                    return []
                raise DirectoryError(f"cannot read {self._path}: {exc}") from None

    # --- writes --------------------------------------------------------------------

    def enroll(self, pubkey: str, name: str, creator: str | None = None,
               now: int | None = None) -> AgentRecord | None:
        """Name a live key that has no name here yet (a name already set is kept).
        None if custody holds no live key `pubkey`.

        Raises:
            ValueError: an empty, overlong or unstorable name (`check_name`), a malformed
                pubkey or creator.
            DirectoryError: the file could not be written.
        """
        return self._write(pubkey, name, creator, now, " ON CONFLICT (pubkey) DO NOTHING")

    def rename(self, pubkey: str, name: str, now: int | None = None) -> AgentRecord | None:
        """Set a live agent's public name. None if no live agent has that key.

        Raises:
            ValueError: an empty, overlong or unstorable name (`check_name`), or a
                malformed pubkey.
            DirectoryError: the file could not be written.
        """
        return self._write(pubkey, name, None, now, " ON CONFLICT (pubkey) DO UPDATE SET"
                           " name = excluded.name, updated_at = excluded.updated_at")

    def _write(self, pubkey: str, name: str, creator: str | None, now: int | None,
               conflict: str) -> AgentRecord | None:
        if not is_hex64(pubkey):
            raise ValueError("agent must be 64 lowercase hex characters")
        check_name(name)
        if creator is not None and not is_hex64(creator):
            raise ValueError("creator must be 64 lowercase hex characters or None")
        if self.agent(pubkey) is None:
            return None
        stamp = int(time.time()) if now is None else now
        with self._writer() as db:
            db.execute("INSERT INTO names (pubkey, name, creator, updated_at)"
                       " VALUES (?, ?, ?, ?)" + conflict, (pubkey, name, creator, stamp))
        return self.agent(pubkey)

    def prune(self, now: int | None = None) -> int:
        """Delete the names of keys custody has no record of (module docstring), but those
        written in the last PRUNE_AFTER_SECONDS; how many went. The records are read inside
        the write transaction: no name can be enrolled meanwhile.

        Raises:
            DirectoryError: the file could not be written, or custody's records read.
        """
        stamp = int(time.time()) if now is None else now
        if not self._path.exists():
            return 0  # no names yet: nothing made here
        with self._writer() as db:
            held = json.dumps(sorted(k.pubkey for k in _call(
                lambda: self._keys.all(include_deleted=True))))
            return db.execute("DELETE FROM names WHERE updated_at < ? AND pubkey NOT IN "
                              "(SELECT value FROM json_each(?))",
                              (stamp - PRUNE_AFTER_SECONDS, held)).rowcount

    def forget(self, pubkeys: Collection[str]) -> int:
        """Delete the names of `pubkeys`, whose records custody has just deleted (`agent
        forget`), however recently written: the PRUNE_AFTER_SECONDS grace is for a
        custodian's records, which may lag; these are known gone. How many went.

        Raises:
            DirectoryError: the file could not be written.
        """
        if not self._path.exists():
            return 0
        with self._writer() as db:
            return db.execute("DELETE FROM names WHERE pubkey IN (SELECT value FROM "
                              "json_each(?))", (json.dumps(sorted(pubkeys)),)).rowcount

    @contextmanager
    def _writer(self) -> Iterator[sqlite3.Connection]:
        """One transaction on a short read-write connection. The file's first writer also
        copies in the version-1 names, in the transaction that marks them copied."""
        try:
            # The schema only once the version is known: never a table into a newer file.
            db = open_private_db(self._path, "")
            try:
                db.execute("PRAGMA secure_delete=ON")
                with transaction(db):
                    version = _readable_version(db, self._path)
                    db.execute(_SCHEMA)
                    if version != SCHEMA_VERSION:
                        db.executemany(
                            "INSERT OR IGNORE INTO names (pubkey, name, creator, updated_at)"
                            " VALUES (?, ?, ?, 0)",
                            [(p, n, c) for p, (n, c) in _call(self._keys.v1_names).items()])
                        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                    yield db
            finally:
                db.close()
        except sqlite3.Error as exc:
            raise DirectoryError(f"cannot write {self._path}: {exc}") from None
        except OSError as exc:
            raise DirectoryError(f"cannot write {self._path}: {exc.strerror}") from None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
        self._keys.close()


def _readable_version(db: sqlite3.Connection, path: Path) -> int:
    """The file's schema version; DirectoryError if this build does not read it. A newer
    build's file would otherwise be read as this one's, and its first write here would
    copy the version-1 names in again and mark it version 1 (the keystore's openers refuse
    a newer keystore alike: custody/_keystore.py)."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version not in (0, SCHEMA_VERSION):
        raise DirectoryError(f"directory {path} has schema version {version}; this build reads "
                             f"up to {SCHEMA_VERSION} (a newer build's directory needs that build)")
    return version


def _ours(state_dir: Path) -> bool:
    """Whether this user owns `state_dir`: files it makes there are the daemon's to open."""
    try:
        return state_dir.stat().st_uid == os.geteuid()
    except OSError:
        return False


def _call(read: Callable[[], T]) -> T:
    """A read of custody's key index, its fault re-raised as the directory's."""
    try:
        return read()
    except CustodyError as exc:
        raise DirectoryError(str(exc)) from None
