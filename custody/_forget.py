"""Forgetting destroyed key records: the way back under the record bound
(custody/_records.py `RecordBound`), which counts them.

A destroyed key's record is kept as a tombstone so the key cannot return (an import or a
restore of it is refused). So a host that creates and removes agents, or a credential
looping agents.create and agents.delete, reaches the bound, and then every mint and import
is refused until the operator raises it or forgets records. Forgetting is the operator's
alone, never a request's: the custodian's `custodian FILE --forget-destroyed`
(custody/custodian/forget.py, which logs it) and, with custody in the daemon,
`buzz-broker agent forget PUBKEY ...` (`forget_removed`). It needs no token: a destroyed
record holds no sealed key.

Rules (both homes): never a live record; never one a record kept names as owner (an
agent's depth and ownership chain go through its owner's record), so a chain of them
goes leaves first; all the named ones go in one transaction, or none (`NotForgotten`,
naming each that stays and why). What it gives up: the host no longer knows the key was
held, so an import or a restore of it is no longer refused as a removed key's.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from custody._errors import CustodyError
from custody._keystore import KEYSTORE_FILE, Keystore
from custody._statelock import StateLock

__all__ = ["STAYS", "NotForgotten", "forget_destroyed", "forget_named", "forget_removed"]

#: A record goes once nothing kept names it as owner: leaves first, up the chains.
_LEAVES = """DELETE FROM keys WHERE deleted_at IS NOT NULL AND deleted_at <= ?
              AND pubkey NOT IN (SELECT owner FROM keys) RETURNING pubkey"""
#: The named records that may go: destroyed (at any time), and no record names them as owner.
_NAMED_LEAVES = """DELETE FROM keys WHERE deleted_at IS NOT NULL
                   AND pubkey IN (SELECT value FROM json_each(?))
                   AND pubkey NOT IN (SELECT owner FROM keys) RETURNING pubkey"""
#: A named record that stays: why, by what the keystore holds for it.
_WHY = """SELECT CASE WHEN deleted_at IS NULL THEN 'live' ELSE 'owner' END
          FROM keys WHERE pubkey = ?"""

#: Why a named record cannot go -> how it is said.
STAYS = {
    "unknown": "no record of this key here",
    "live": "a live key: only a destroyed one is forgotten (remove it first)",
    "owner": "a record kept here names it as owner (name that one too, once destroyed)",
}


class NotForgotten(CustodyError):
    """Named records that cannot go (`stays`: pubkey -> a key of STAYS); nothing went."""

    def __init__(self, stays: dict[str, str]) -> None:
        super().__init__(f"nothing was forgotten: {len(stays)} of the keys named cannot go")
        self.stays = stays

    def why(self, pubkey: str) -> str:
        """How the reason `pubkey` stays is said (STAYS)."""
        return STAYS[self.stays[pubkey]]


def forget_named(keystore: Keystore, pubkeys: Sequence[str], *, commit: bool = True) -> list[str]:
    """Delete the destroyed records `pubkeys` names, whatever their age, leaves first; the
    pubkeys that went. One transaction: all of them or none (NotForgotten, naming each that
    stays and why). `commit=False`: the same look, rolled back whatever it finds.

    Raises:
        NotForgotten: a named record is unknown, live, or a kept record's owner.
        CustodyError: the keystore write failed.
    """
    named = sorted(set(pubkeys))
    forgotten: list[str] = []
    try:
        with keystore.transaction() as db:
            db.execute("SAVEPOINT look")
            while gone := [p for (p,) in db.execute(_NAMED_LEAVES, (json.dumps(named),))]:
                forgotten += gone
            stays: dict[str, str] = {}
            for pubkey in (p for p in named if p not in forgotten):
                row = db.execute(_WHY, (pubkey,)).fetchone()
                stays[pubkey] = row[0] if row else "unknown"
            if stays or not commit:
                db.execute("ROLLBACK TO look")
            db.execute("RELEASE look")
    except sqlite3.Error as exc:
        raise CustodyError(f"keystore write failed: {exc}") from None
    if stays:
        raise NotForgotten(stays)
    return forgotten


def forget_destroyed(keystore: Keystore, destroyed_before: int) -> list[str]:
    """Delete every record destroyed at or before `destroyed_before` that no remaining
    record names as owner; the pubkeys that went. One transaction: all of them or none."""
    forgotten: list[str] = []
    try:
        with keystore.transaction() as db:
            while gone := [pubkey for (pubkey,) in db.execute(_LEAVES, (destroyed_before,))]:
                forgotten += gone
    except sqlite3.Error as exc:
        raise CustodyError(f"keystore write failed: {exc}") from None
    return forgotten


def forget_removed(state_dir: Path, pubkeys: Sequence[str]) -> list[str]:
    """`forget_named` on the keystore in `state_dir`, beside a running daemon or not (its
    lock taken shared: never during a rotation); the pubkeys that went.

    Raises:
        NotForgotten: a named record is unknown, live, or a kept record's owner.
        CustodyError: no keystore, a rotation under way, or the keystore write failed.
    """
    if not (Path(state_dir) / KEYSTORE_FILE).is_file():
        raise CustodyError(f"no keystore in {state_dir}: nothing to forget")
    lock = StateLock.shared(Path(state_dir))
    try:
        keystore = Keystore.open(Path(state_dir))
        try:
            return forget_named(keystore, pubkeys)
        finally:
            keystore.close()
    finally:
        lock.release()
