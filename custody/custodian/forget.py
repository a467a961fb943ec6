"""`buzz-broker custodian FILE --forget-destroyed`: drop the records of keys destroyed past
their grace period, so a long-lived host stays under `[custodian] max_records`.

Why a command: destroyed records count toward `max_records` (a compromised pipeline's
mint-destroy loop must stop somewhere, docs/custodian.md), so a host that creates and
removes agents for years reaches it. Forgetting is the operator's, never the message
table's: run under the custodian's uid, as its own process, beside a running custodian
(which sees the change within its records' recheck) or with it stopped. It needs no
token: a destroyed record holds no sealed key.

What is forgotten: a record destroyed longer ago than `destroy_grace_seconds` (its sealed
copy is gone too, custody/custodian/grace.py), unless a record kept here names it as owner
(an agent's depth and ownership chain go through its owner's record, live or destroyed).
What forgetting gives up, said where the operator runs it (docs/custodian.md): this host
no longer knows the key was held, so an `import` or a restore of that key from an old
backup is no longer refused as a destroyed one.

It changes the keystore, so it is in the custodian's log (changes.py `logged_change`): an
`intent` line (`for` forget, `before`: the destroy time at or before which a record may
go) on disk before the transaction, then one `forget` line per record forgotten (`agent`)
and one with the count (`agents`, `intent`), or `failed`. A run that forgets nothing
writes its intent and a count of 0: whether any would go is known only inside the
transaction.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from custody._errors import CustodyError
from custody._keystore import KEYSTORE_FILE, Keystore
from custody._statelock import StateLock
from custody.custodian.changes import logged_change, open_log
from custody.custodian.config import load
from custody.custodian.grace import Graveyard

__all__ = ["forget", "forget_destroyed"]

#: A record goes once nothing kept names it as owner: leaves first, up the chains.
_LEAVES = """DELETE FROM keys WHERE deleted_at IS NOT NULL AND deleted_at <= ?
              AND pubkey NOT IN (SELECT owner FROM keys) RETURNING pubkey"""


def forget_destroyed(keystore: Keystore, destroyed_before: int) -> list[str]:
    """Delete every record destroyed at or before `destroyed_before` that no remaining
    record names as owner; the pubkeys that went. One transaction: all of them or none."""
    forgotten: list[str] = []
    try:
        with keystore._transaction() as db:
            while gone := [pubkey for (pubkey,) in db.execute(_LEAVES, (destroyed_before,))]:
                forgotten += gone
    except sqlite3.Error as exc:
        raise CustodyError(f"keystore write failed: {exc}") from None
    return forgotten


def _lines(forgotten: list[str], intent: int) -> list[dict[str, object]]:
    # One line per record: one naming thousands would outgrow the log's tail read.
    lines: list[dict[str, object]] = [{"op": "forget", "agent": p} for p in forgotten]
    return [*lines, {"op": "forget", "agents": len(forgotten), "intent": intent}]


async def forget(config_path: str) -> None:
    config = load(config_path)
    grace = config.settings.destroy_grace_seconds
    if not (Path(config.state_dir) / KEYSTORE_FILE).is_file():  # a host with none yet
        raise CustodyError(f"no keystore in {config.state_dir}: nothing to forget")
    Graveyard.beside(config.settings.log_path, grace)  # purges past-grace copies
    lock = StateLock.shared(Path(config.state_dir))  # never during a rotation
    try:
        keystore = Keystore.open(Path(config.state_dir))
        try:
            log = open_log(config, "nothing was forgotten")
            try:
                before = int(time.time()) - grace

                async def change() -> list[str]:
                    return forget_destroyed(keystore, before)

                forgotten = await logged_change(log, {"for": "forget", "before": before},
                                                change, _lines)
            finally:
                log.close()
        finally:
            keystore.close()
    finally:
        lock.release()
    print(f"custodian: forgot {len(forgotten)} records of keys destroyed more than {grace} s "
          "ago", flush=True)
