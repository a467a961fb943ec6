"""`buzz-broker custodian FILE --forget-destroyed [PUBKEY ...]`: drop the records of keys
destroyed past their grace period, or those named, so a host stays under `[custodian]
max_records`.

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

Named (`--forget-destroyed PUBKEY ...`): exactly those records go, whatever their age, so an
operator who destroyed an intruder's mints gets under `max_records` now rather than a
grace period later, without giving up legitimate keys' grace copies. The same rule holds
(never a live record; never one a kept record names as owner; a chain of named ones goes
leaves first), and all of them go or none: each named one that cannot go is said on
stderr, one line each (`STAYS`), and nothing is forgotten. That is looked at before the
intent line (a refused run writes none) and held again inside the transaction (the
running custodian may change a record between). Their sealed copies (grace.py) are
deleted once the transaction commits, before the count line: the copy of a key with no
record could only be misread later. Deleting them first was the other order; it would
lose a copy whenever the transaction then refused. A copy the disk refuses to delete
leaves the forget standing (its records are gone): said on stderr after its lines, and
deleted by the grace period's purge.

It changes the keystore, so it is in the custodian's log (changes.py `logged_change`): an
`intent` line (`for` forget, `before`: the destroy time at or before which a record may
go; or `named`: the keys named, at most MAX_NAMED) on disk before the transaction, then
one `forget` line per record forgotten (`agent`) and one with the count (`agents`,
`intent`), or `failed`. A run that forgets nothing writes its intent and a count of 0:
whether any would go is known only inside the transaction.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from buzzwire.nostr import is_hex64
from custody._errors import CustodyError
from custody._forget import STAYS, NotForgotten, forget_destroyed, forget_named
from custody._keystore import KEYSTORE_FILE, Keystore
from custody._statelock import StateLock
from custody.custodian.changes import logged_change, open_log
from custody.custodian.config import load
from custody.custodian.grace import Graveyard
from custody.custodian.ledger import fault_name
from custody.custodian.main import UsageError

__all__ = ["MAX_NAMED", "STAYS", "NotForgotten", "check_named", "forget", "forget_copy",
           "forget_destroyed", "forget_named"]

#: Keys one named run takes: its intent line names them all (write-ahead: a run killed
#: before its count leaves the keystore to say which went), 256 of 67 bytes is ~17 KiB, far
#: under the 64 KiB a line of the log must stay under (ledger.py `_cut_torn_tail`). More:
#: run it again for the rest.
MAX_NAMED = 256


def _lines(forgotten: list[str], intent: int) -> list[dict[str, object]]:
    # One line per record: one naming thousands would outgrow the log's tail read.
    lines: list[dict[str, object]] = [{"op": "forget", "agent": p} for p in forgotten]
    return [*lines, {"op": "forget", "agents": len(forgotten), "intent": intent}]


def check_named(pubkeys: Sequence[str]) -> None:
    """Raises UsageError: one of `pubkeys` is not one (main.py asks before FILE is read)."""
    for number, text in enumerate(pubkeys, 1):
        if not is_hex64(text):  # never echoed: a secret key pasted by mistake is hex too
            raise UsageError(f"custodian: key {number} named is not a pubkey (64 lowercase "
                             "hex); not shown; nothing was forgotten")


def forget_copy(graveyard: Graveyard, pubkey: str) -> None:
    """Delete `pubkey`'s grace copy, if any, under the copies' lock (grace.py `locked`);
    the commands' alone: this one's named forget and `keys rotate`'s abandoned keys."""
    with graveyard.locked():
        graveyard.path(pubkey).unlink(missing_ok=True)


async def forget(config_path: str, pubkeys: Sequence[str] = ()) -> None:
    """Forget past the grace period, or exactly `pubkeys` (named); prints what went."""
    check_named(pubkeys)
    if len(set(pubkeys)) > MAX_NAMED:
        raise CustodyError(f"at most {MAX_NAMED} keys named in one run (its intent line names "
                           "them all); name the rest in another; nothing was forgotten")
    config = load(config_path)
    grace = config.settings.destroy_grace_seconds
    if not (Path(config.state_dir) / KEYSTORE_FILE).is_file():  # a host with none yet
        raise CustodyError(f"no keystore in {config.state_dir}: nothing to forget")
    graveyard = Graveyard.beside(config.settings.log_path, grace)  # purges past-grace copies
    lock = StateLock.shared(Path(config.state_dir))  # never during a rotation
    try:
        keystore = Keystore.open(Path(config.state_dir))
        try:
            intent: dict[str, object]
            stuck: dict[str, str] = {}  # a named key's copy not deleted -> the fault's name
            if pubkeys:
                forget_named(keystore, pubkeys, commit=False)  # a refusal writes no line
                intent = {"for": "forget", "named": sorted(set(pubkeys))}

                async def change() -> list[str]:
                    gone = forget_named(keystore, pubkeys)
                    for pubkey in gone:
                        try:
                            forget_copy(graveyard, pubkey)
                        except OSError as exc:  # the records are gone: the change stands
                            stuck[pubkey] = fault_name(exc)
                    return gone
            else:
                before = int(time.time()) - grace
                intent = {"for": "forget", "before": before}

                async def change() -> list[str]:
                    return forget_destroyed(keystore, before)

            log = open_log(config, "nothing was forgotten")
            try:
                forgotten = await logged_change(log, intent, change, _lines)
            finally:
                log.close()
        finally:
            keystore.close()
    except NotForgotten as exc:
        for pubkey, why in exc.stays.items():
            # A key with no record here may be a secret pasted by mistake (64 hex too): said
            # by its place among those named, never by its value.
            who = pubkey if why != "unknown" else \
                f"key {list(pubkeys).index(pubkey) + 1} named (not shown)"
            print(f"custodian: {who}: not forgotten: {STAYS[why]}", file=sys.stderr)
        raise
    finally:
        lock.release()
    what = "named (their sealed copies deleted)" if pubkeys else \
        f"of keys destroyed more than {grace} s ago"
    print(f"custodian: forgot {len(forgotten)} records {what}", flush=True)
    for pubkey, fault in stuck.items():  # said after the lines: the forget is done
        print(f"custodian: {pubkey}: its sealed copy stays ({fault}); the grace period's "
              "purge deletes it", file=sys.stderr)
