"""`buzz-broker custodian FILE --recover PUBKEY`: bring a destroyed key back within its grace period.

Run beside a running custodian, under its uid, as its own process that exits when done
(custody/custodian/main.py imports this module only for `--recover`: the serving process
never loads it). The sealed copy destroy kept (custody/custodian/grace.py) is checked
through custody's one unseal door (it must open as PUBKEY under this token's KEK) and
sealed again under the active KEK before the keystore takes it back; the running
custodian sees the record again within its records' recheck, as any change by another
process.

The copy is left where it is, for the grace period's purge (or `keys rotate`, which
drops the copies of live keys) to delete: deleting it here would race a destroy the
running custodian answers meanwhile, whose own copy of the key it would delete.

It is a key change, so it is in the custodian's log as the server's are (changes.py
`logged_change`): an `intent` line (`for` recover, the `agent`) on disk before the
keystore is asked, then `recover` (`agent`, `intent`), or `failed` (a copy that does not
open as that agent: `UnsealFailed`). A run that asks nothing (no copy within the grace
period, the agent held) writes no line. The log's lock (ledger.py) keeps the serving
custodian's chain and these lines one chain.
"""

from __future__ import annotations

import functools
import logging
import sqlite3

from custody._errors import CustodyError, UnknownAgent
from buzzwire.nostr import is_hex64, require_pubkey
from custody._facade import Custody
from custody._keystore import Keystore
from custody._records import KeyRecord
from custody._sealed import seal, unseal
from custody.custodian.changes import logged_change, open_log
from custody.custodian.config import load
from custody.custodian.grace import Graveyard
from custody.custodian.main import UsageError

__all__ = ["check_named", "kept_copy", "recover", "revive_agent", "revive_tombstone"]

log = logging.getLogger("buzz_broker.custody")


def kept_copy(graveyard: Graveyard, pubkey: str) -> bytes | None:
    """The copy of `pubkey`'s sealed key, if still within its grace period. Read without
    the copies' lock: a copy is replaced whole (grace.py `keep`), never written in place."""
    path = graveyard.path(pubkey)
    try:
        if graveyard.clock() - path.stat().st_mtime > graveyard.grace:
            return None
        return path.read_bytes()
    except FileNotFoundError:
        return None


def revive_tombstone(keystore: Keystore, pubkey: str, sealed: bytes, now: int
                     ) -> KeyRecord | None:
    """Put a destroyed agent's sealed key back (the custodian's grace period, issue 26).
    None if no tombstone has that key, revived by another process meanwhile included:
    only the run whose update took it says it did. The caller has checked the blob."""
    try:
        with keystore.transaction() as db:
            revived = db.execute(
                "UPDATE keys SET sealed = ?, deleted_at = NULL, updated_at = ? "
                "WHERE pubkey = ? AND deleted_at IS NOT NULL", (sealed, now, pubkey)).rowcount
    except sqlite3.Error as exc:
        raise CustodyError(f"keystore write failed: {exc}") from None
    return keystore.get(pubkey) if revived == 1 else None


async def revive_agent(custody: Custody, pubkey: str, blob: bytes) -> KeyRecord:
    """Undo `Custody.destroy_agent` with the sealed blob `Custody.sealed_copy` gave before
    it: checked through the one unseal door (it must open as `pubkey` under this token's
    KEK) and stored sealed again under the active KEK: a copy kept before an interrupted
    rotation names the retiring KEK, which the rotation's rerun destroys.

    Raises:
        UnsealFailed: the blob does not open as that agent.
        UnknownAgent: no tombstone with that key (never held, or live).
    """
    custody._check_open()
    require_pubkey("agent", pubkey)

    def work() -> KeyRecord | None:
        with unseal(custody._token, blob, pubkey) as secret:  # compared to pubkey, wiped
            fresh = seal(custody._token, secret, pubkey)
        return revive_tombstone(custody._keystore, pubkey, fresh, custody._now())

    record = await custody._hop("import", work)
    if record is None:
        raise UnknownAgent(pubkey)
    log.info("revived the key of agent %s from its sealed copy", pubkey)
    return record


def check_named(pubkey: str) -> None:
    """Raises UsageError: `pubkey` is not one (main.py asks before FILE is read)."""
    # The key named is said only once it is known here: an unknown one may be a secret
    # pasted by mistake (64 hex too), and a path must never reach the copies' directory.
    if not is_hex64(pubkey):
        raise UsageError("custodian: the key named is not a pubkey (64 lowercase hex); not "
                         "shown; nothing was recovered")


async def recover(config_path: str, pubkey: str) -> None:
    check_named(pubkey)
    config = load(config_path)
    graveyard = Graveyard.beside(config.settings.log_path, config.settings.destroy_grace_seconds)
    blob = kept_copy(graveyard, pubkey)
    if blob is None:
        raise CustodyError("no sealed copy of the key named within the grace period (not "
                           "shown: it may be a secret pasted by mistake); nothing was recovered")
    async with await Custody.open(config.token, config.state_dir, config.cache) as custody:
        if custody.agent(pubkey) is not None:  # recovered already: the copy is left (above)
            raise CustodyError(f"agent {pubkey} is held: nothing to recover")
        log = open_log(config, "nothing was recovered")
        try:  # revive_agent looked up now: the tests' kill point replaces it
            await logged_change(log, {"for": "recover", "agent": pubkey},
                                functools.partial(revive_agent, custody, pubkey, blob),
                                lambda record, seq: [{"op": "recover", "agent": record.pubkey,
                                                      "intent": seq}])
        finally:
            log.close()
    print(f"custodian: agent {pubkey} recovered", flush=True)
