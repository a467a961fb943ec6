"""`KeyIndex`: custody's public key facts read without custody open, for the daemon.

The daemon's directory (daemon/state/directory.py) and `agent list` read the keystore
file read-only through it when custody runs inside the daemon: no token, no secret column,
nothing created. Unlike `Custody`'s own reader (`_keystore.ReadIndex`, whose writer has
opened and so upgraded the file), it may meet a version-1 file not yet upgraded: that is
read through its old table, and the upgrade is seen at the next query; and it gives the
names a version-1 keystore held (`v1_names`) for the directory to take over. The
custodian never loads this module (it has no directory).
"""

from __future__ import annotations

from pathlib import Path

from custody._keystore import _PUBLIC_COLUMNS, KEYSTORE_FILE, V1_NAMES, V1_TABLE, ReadIndex, Row

__all__ = ["KeyIndex"]


class KeyIndex(ReadIndex):
    """Custody's public facts about every key, read-only (`ReadIndex`), from a state
    directory, a version-1 file included. Raises `CustodyError` as `ReadIndex` does."""

    __slots__ = ()

    @classmethod
    def open(cls, state_dir: Path | str) -> KeyIndex:
        return cls(Path(state_dir) / KEYSTORE_FILE)

    def _rows(self, where: str, args: tuple[object, ...] = ()) -> list[Row]:
        return self._first(tuple(f"SELECT {_PUBLIC_COLUMNS} FROM {table} {where}"
                                 for table in ("keys", V1_TABLE)), args)

    def v1_names(self) -> dict[str, tuple[str, str | None]]:
        """pubkey -> (name, creator) as a version-1 keystore held them (schema versions in
        custody/_keystore.py): public, for the daemon's directory to take over. Empty for
        a keystore made at version 2."""
        rows = self._first(tuple(f"SELECT pubkey, name, creator FROM {table}"
                                 for table in (V1_NAMES, V1_TABLE)))
        return {pubkey: (name, creator) for pubkey, name, creator in rows}
