"""`buzz-broker custodian FILE --recover PUBKEY`: bring a destroyed key back within its grace period.

Run beside a running custodian, under its uid, as its own process that exits when done
(custody/custodian/main.py imports this module only for `--recover`: the serving process
never loads it). The sealed copy destroy kept (custody/custodian/grace.py) is checked
through custody's one unseal door (it must open as PUBKEY under this token's KEK) before
the keystore takes it back; the running custodian sees the record again within its
records' recheck, as any change by another process.
"""

from __future__ import annotations

import logging

from custody._errors import CustodyError, UnknownAgent
from buzzwire.nostr import require_pubkey
from custody._facade import Custody
from custody._records import KeyRecord
from custody._sealed import unseal
from custody.custodian.config import load
from custody.custodian.grace import Graveyard

__all__ = ["recover", "revive_agent"]

log = logging.getLogger("buzz_broker.custody")


async def revive_agent(custody: Custody, pubkey: str, blob: bytes) -> KeyRecord:
    """Undo `Custody.destroy_agent` with the sealed blob `Custody.sealed_copy` gave before
    it: checked through the one unseal door (it must open as `pubkey` under this token's
    KEK) before it is stored again.

    Raises:
        UnsealFailed: the blob does not open as that agent.
        UnknownAgent: no tombstone with that key (never held, or live).
    """
    custody._check_open()
    require_pubkey("agent", pubkey)

    def work() -> KeyRecord | None:
        with unseal(custody._token, blob, pubkey):
            pass  # opened, re-derived and compared to pubkey; wiped on exit
        return custody._keystore.revive(pubkey, blob, custody._now())

    record = await custody._hop("import", work)
    if record is None:
        raise UnknownAgent(pubkey)
    log.info("revived the key of agent %s from its sealed copy", pubkey)
    return record


async def recover(config_path: str, pubkey: str) -> None:
    config = load(config_path)
    graveyard = Graveyard.beside(config.settings.log_path, config.settings.destroy_grace_seconds)
    blob = graveyard.take(pubkey)
    if blob is None:
        raise CustodyError(f"no sealed copy of {pubkey} within the grace period")
    async with await Custody.open(config.token, config.state_dir, config.cache) as custody:
        await revive_agent(custody, pubkey, blob)
    graveyard.forget(pubkey)
    print(f"custodian: agent {pubkey} recovered", flush=True)
