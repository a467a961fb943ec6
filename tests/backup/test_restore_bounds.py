"""What a hostile but well-formed backup can cost a restore: work linear in its agents.

A backup is hostile input (anyone who knows a recipient can write one), so each test
writes its own age file in memory, the way an attacker would. Nothing here times
anything: linear work is shown by counting the steps a restore takes (comparisons,
keystore lookups, owner lookups).

- `BackupContents.public`, asked once per agent by both restore commands, compares a
  pubkey with one stored pubkey, not with every agent before it.
- The plan's ownership-cycle check asks each pubkey's owner once, even for agents that
  each own the next (n walks up the chain each were n²/2 steps); it agrees with
  `_ownership.owned_through`, the rule `agent import` checks, on random owner graphs.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import coincurve
import pyrage
import pytest

from custody import Custody, open_backup, restore_plan
from custody import _restore
from custody._keystore import Keystore
from custody._ownership import owned_through

PERSON = coincurve.PrivateKey().public_key_xonly.format().hex()


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _agent(index: int, owner: str, public: object = None) -> tuple[bytes, str]:
    """A backup line for the agent whose secret is `index` + 1, and its pubkey."""
    secret = (index + 1).to_bytes(32, "big")
    pubkey = coincurve.PrivateKey(secret).public_key_xonly.format().hex()
    record = {"authTag": None, "createdAt": 1, "mintRef": None, "owner": owner,
              "pubkey": pubkey, "public": {} if public is None else public}
    return secret.hex().encode() + b" " + _canonical(record), pubkey


def _ciphertext(lines: list[bytes], header: bytes | None = None) -> tuple[bytes, bytearray]:
    """An age backup of `lines` (the header counting them, unless given), and its identity."""
    identity = pyrage.x25519.Identity.generate()
    if header is None:
        header = _canonical({"agents": len(lines), "createdAt": 1})
    plaintext = b"\n".join([b"buzz-broker-backup/v2 " + header, *lines]) + b"\n"
    return pyrage.encrypt(plaintext, [identity.to_public()]), bytearray(str(identity).encode())


def _chain(count: int, top: str) -> tuple[list[bytes], list[str]]:
    """`count` agents, the first owned by `top` and each of the others by the one before."""
    lines, pubkeys, owner = [], [], top
    for index in range(count):
        line, owner = _agent(index, owner)
        lines.append(line)
        pubkeys.append(owner)
    return lines, pubkeys


class _Probe(str):
    """A pubkey that counts the stored pubkeys it is compared with (a `str` subclass's
    `__eq__` runs first when it is either operand, so a scan and a dict both reach it)."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _Probe.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


@pytest.mark.token_independent
def test_public_compares_a_pubkey_with_one_stored_pubkey_not_each_agent() -> None:
    agents = 300
    lines, pubkeys = _chain(agents, PERSON)
    with open_backup(*_ciphertext(lines)) as contents:
        _Probe.compared = 0
        for pubkey in pubkeys:
            assert contents.public(_Probe(pubkey)) == {}
        # A scan of the agents compares the n-th pubkey n times: 45,150 for 300.
        assert _Probe.compared == agents


@pytest.mark.token_independent
def test_the_cycle_check_asks_each_owner_once_for_agents_owning_the_next() -> None:
    chain = [f"{index:064x}" for index in range(1, 2001)]
    owners = {agent: owner for owner, agent in zip([PERSON, *chain], chain)}
    asked: Counter[str] = Counter()

    def owner_of(pubkey: str) -> str | None:
        asked[pubkey] += 1
        return owners.get(pubkey)

    for order in (chain, list(reversed(chain))):
        asked.clear()
        assert _restore._owning_themselves(order, owner_of) == frozenset()
        # A walk up the chain from each agent asks n(n+1)/2 times: 2,001,000 here.
        assert set(asked) == {*chain, PERSON} and max(asked.values()) == 1


@pytest.mark.token_independent
def test_the_cycle_check_agrees_with_owned_through_on_random_owner_graphs() -> None:
    """The rule `agent import` checks (custody/_ownership.py), one agent at a time, and the
    plan's one pass must refuse the same agents: the two doors cannot disagree. The graphs
    hold cycles inside the backup, through agents held here, and loops held here (stored
    before cycles were refused) that backup agents run into."""
    rng = random.Random(22)
    refused = 0
    for _ in range(2000):
        keys = [f"{index:064x}" for index in range(rng.randint(2, 12))]
        owners = {key: rng.choice([*(k for k in keys if k != key), None]) for key in keys}
        # The backup's agents: some of those with an owner (a backup's agent always has
        # one); the others are held here, or people (no owner).
        agents = {key: owner for key, owner in owners.items()
                  if owner is not None and rng.random() < 0.6}
        expected = {agent for agent, owner in agents.items()
                    if owned_through(owner, agent, owners.get)}
        assert _restore._owning_themselves(agents, owners.get) == expected, (owners, agents)
        refused += bool(expected)
    assert 0 < refused < 2000  # both answers were asked for


async def test_the_plan_looks_each_pubkey_up_here_at_most_twice(
    custody: Custody, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agents each owning the next, under an agent held here: a walk up the chain from
    each agent reached the held one and its owner once per agent (2n keystore reads for n
    agents). Now each pubkey is read at most twice: once as a backup agent (is it held?),
    once as an owner outside the backup."""
    held_secret = coincurve.PrivateKey()
    held = held_secret.public_key_xonly.format().hex()
    await custody.import_agent(bytearray(held_secret.secret.hex().encode()), owner=PERSON)
    lines, pubkeys = _chain(200, held)
    reads: Counter[str] = Counter()
    keystore = type(custody._keystore)
    real_get = keystore.get

    def get(self: Keystore, pubkey: str) -> Any:
        reads[pubkey] += 1
        return real_get(self, pubkey)

    monkeypatch.setattr(keystore, "get", get)
    with open_backup(*_ciphertext(lines)) as contents:
        plan = restore_plan(custody, contents)
    assert plan.restored == tuple(pubkeys)
    assert reads[held] == 1 and reads[PERSON] == 1
    assert max(reads.values()) <= 2
