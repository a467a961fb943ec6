"""Each check `restore_backup` makes before it writes, proven one at a time (issue 22).

A backup is hostile input (anyone who knows a recipient can write one), so each test
writes its own age file in memory, the way an attacker would, and restores it into the
session's real SoftHSM token. Every refusal must leave the keystore as it was: a backup
with a good agent first and the bad one second would otherwise restore the first and fail
on the second, so "nothing restored" is what each test checks besides the refusal.

- L2: an ownership cycle, through the agents held here or inside the backup itself, is
  refused by the same function `agent import` asks (custody/_ownership.py).
- A mint reference another agent here already uses.
- The same pubkey twice in one backup.
- The same mint reference twice in one backup: the keystore refused the second only after
  sealing the first, and a rerun stopped at it again (2 of 3 agents restored, for good).
- A createdAt the keystore cannot hold (past 2**63 - 1): it failed in the middle of the
  restore with a raw OverflowError, the agents before it written.
- The plan checked again inside the token hop: an agent imported after the caller looked
  at the plan and before the hop ran.
- A restore that would take the keystore past `messages.MAX_RECORDS` records, tombstones
  included: past it the custodian's `agents` answer (one frame) could fail, and the daemon
  could then neither start nor refresh; before, every agent of the backup was sealed.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import coincurve
import pyrage
import pytest

from custody import Custody, CustodyError, open_backup, restore_backup, restore_plan
from custody._restore import BackupContents
from custody.custodian.messages import MAX_RECORDS

PERSON = coincurve.PrivateKey().public_key_xonly.format().hex()


def _key() -> tuple[str, str]:
    """A fresh (secret hex, x-only pubkey hex)."""
    secret = coincurve.PrivateKey()
    return secret.secret.hex(), secret.public_key_xonly.format().hex()


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _backup(entries: list[tuple[str, str, str, str | None]],
            created: dict[str, int] | None = None) -> BackupContents:
    """An age backup of (secret, pubkey, owner, mintRef) entries, opened with its identity;
    `created` gives an agent's createdAt (else 1)."""
    identity = pyrage.x25519.Identity.generate()
    lines = [b"buzz-broker-backup/v2 " + _canonical({"agents": len(entries), "createdAt": 1})]
    for secret, pubkey, owner, mint_ref in entries:
        record = {"authTag": None, "createdAt": (created or {}).get(pubkey, 1), "mintRef": mint_ref, "owner": owner,
                  "pubkey": pubkey, "public": {}}
        lines.append(secret.encode() + b" " + _canonical(record))
    ciphertext = pyrage.encrypt(b"\n".join(lines) + b"\n", [identity.to_public()])
    return open_backup(ciphertext, bytearray(str(identity).encode()))


async def _import(custody: Custody, secret: str, owner: str) -> None:
    await custody.import_agent(bytearray(secret.encode()), owner=owner)


def _held(custody: Custody) -> set[str]:
    return {record.pubkey for record in custody.agents()}


async def _refused_and_nothing_restored(custody: Custody, contents: BackupContents) -> None:
    before = _held(custody)
    with contents, pytest.raises(CustodyError, match="nothing restored"):
        await restore_backup(custody, contents)
    assert _held(custody) == before


async def test_restore_refuses_a_cycle_through_an_agent_held_here(custody: Custody) -> None:
    """Here: B owned by A (a key held elsewhere). The backup: A owned by B."""
    secret_a, pub_a = _key()
    secret_b, pub_b = _key()
    await _import(custody, secret_b, pub_a)
    # `agent import` refuses the same edge: the two doors agree.
    with pytest.raises(CustodyError, match="cycle"):
        await _import(custody, secret_a, pub_b)
    good_secret, good = _key()
    await _refused_and_nothing_restored(
        custody, _backup([(good_secret, good, PERSON, None), (secret_a, pub_a, pub_b, None)]))
    assert good not in _held(custody)


async def test_restore_refuses_a_cycle_inside_the_backup(custody: Custody) -> None:
    """Nothing held here; the backup holds A owned by B and B owned by A."""
    secret_a, pub_a = _key()
    secret_b, pub_b = _key()
    await _refused_and_nothing_restored(
        custody, _backup([(secret_a, pub_a, pub_b, None), (secret_b, pub_b, pub_a, None)]))


async def test_restore_accepts_a_chain_in_any_order(custody: Custody) -> None:
    """The check is no wider than a cycle: child before its owner in the file restores."""
    secret_a, pub_a = _key()
    secret_b, pub_b = _key()
    with _backup([(secret_b, pub_b, pub_a, None), (secret_a, pub_a, PERSON, None)]) as contents:
        result = await restore_backup(custody, contents)
    assert set(result.restored) == {pub_a, pub_b} == _held(custody)


async def test_restore_refuses_a_mint_reference_another_agent_holds(custody: Custody) -> None:
    minted = await custody.mint_agent(owner=PERSON, mint_ref="owner/create-1")
    good_secret, good = _key()
    other_secret, other = _key()
    await _refused_and_nothing_restored(custody, _backup([
        (good_secret, good, PERSON, None),
        (other_secret, other, PERSON, "owner/create-1"),
    ]))
    assert custody._keystore.by_mint_ref("owner/create-1") == minted


@pytest.mark.parametrize("created_at", [2**63, 2**64])
async def test_a_created_at_past_the_keystores_integer_is_refused_at_open(
    custody: Custody, created_at: int
) -> None:
    good_secret, good = _key()
    late_secret, late = _key()
    with pytest.raises(CustodyError, match=f"backup entry 2: agent {late}: bad createdAt; nothing restored"):
        _backup([(good_secret, good, PERSON, None), (late_secret, late, PERSON, None)],
                created={late: created_at})
    assert _held(custody) == set()


async def test_a_backup_naming_one_pubkey_twice_is_refused_at_open(custody: Custody) -> None:
    secret, pubkey = _key()
    with pytest.raises(CustodyError, match="twice"):
        _backup([(secret, pubkey, PERSON, None), (secret, pubkey, PERSON, None)])
    assert _held(custody) == set()


async def test_a_backup_naming_one_mint_reference_twice_is_refused_before_any_write(
    custody: Custody
) -> None:
    first_secret, first = _key()
    between_secret, between = _key()
    second_secret, second = _key()
    with pytest.raises(CustodyError) as refused:
        _backup([(first_secret, first, PERSON, "m-dup"),
                 (between_secret, between, PERSON, None),
                 (second_secret, second, PERSON, "m-dup")])
    assert str(refused.value) == (
        f"backup entry 3: agent {second}: mint reference 'm-dup' appears twice (also agent "
        f"{first}); nothing restored")
    assert _held(custody) == set()


async def test_restore_checks_its_plan_again_inside_the_token_hop(
    custody: Custody, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan the caller saw is stale by the time the hop runs: an import of one of the
    backup's agents, for another owner, lands between them (as the daemon may mint or an
    operator import meanwhile). The hop's own plan refuses; nothing is written."""
    good_secret, good = _key()
    late_secret, late = _key()
    contents = _backup([(good_secret, good, PERSON, None), (late_secret, late, PERSON, None)])
    assert set(restore_plan(custody, contents).restored) == {good, late}

    other_owner = _key()[1]
    real_hop = Custody._hop

    async def hop(self: Custody, op: str, work: Callable[[], Any]) -> Any:
        if op == "restore":
            await _import(self, late_secret, other_owner)  # lands just before the hop
        return await real_hop(self, op, work)

    monkeypatch.setattr(Custody, "_hop", hop)
    before = {late}
    with contents, pytest.raises(CustodyError, match="another owner"):
        await restore_backup(custody, contents)
    assert _held(custody) == before
    record = custody.agent(late)
    assert record is not None and record.owner == other_owner


def tombstones(keystore: Path, count: int) -> None:
    """`count` destroyed agents' records written straight into `keystore` in one
    transaction: a tombstone holds no sealed key, so thousands need no token."""
    db = sqlite3.connect(keystore)
    try:
        with db:
            db.executemany("INSERT INTO keys (pubkey, owner, created_at, updated_at, deleted_at)"
                           " VALUES (?, ?, 1, 1, 1)", [(f"{n:064x}", PERSON) for n in range(count)])
    finally:
        db.close()


async def test_a_restore_past_max_records_is_refused_before_any_write(custody: Custody) -> None:
    """MAX_RECORDS is the most records the custodian's `agents` answer carries in its one
    frame; a keystore past it (measured: 40 more of the largest records) answers it
    `internal` and the pipeline's client cannot open. Up to it a restore is taken whatever
    `max_records` says; one more record and it is refused whole, naming the counts and the
    way out (the daemon's `keys restore` and the custodian's both plan here)."""
    tombstones(custody._keystore.path, MAX_RECORDS - 2)
    agents = [_key() for _ in range(3)]
    contents = _backup([(secret, pubkey, PERSON, None) for secret, pubkey in agents])
    with contents, pytest.raises(CustodyError) as refused:
        await restore_backup(custody, contents)
    message = str(refused.value)
    assert f"holds {MAX_RECORDS - 2} records" in message and "adds 3" in message
    assert str(MAX_RECORDS) in message and "--forget-destroyed" in message
    assert message.endswith("nothing restored") and "\n" not in message
    assert _held(custody) == set() and custody._index.count() == MAX_RECORDS - 2
    with _backup([(secret, pubkey, PERSON, None) for secret, pubkey in agents[:2]]) as fits:
        result = await restore_backup(custody, fits)
    assert set(result.restored) == {pubkey for _, pubkey in agents[:2]} == _held(custody)
    assert custody._index.count() == MAX_RECORDS
