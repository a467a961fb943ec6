"""What a hostile but well-formed backup can cost a restore: work linear in its agents,
and memory bounded before any JSON is parsed.

A backup is hostile input (anyone who knows a recipient can write one), so each test
writes its own age file in memory, the way an attacker would. Nothing here times
anything: linear work is shown by counting the steps a restore takes (comparisons,
keystore lookups, owner lookups), bounded memory by what reaches json.loads.

- `BackupContents.public`, asked once per agent by both restore commands, compares a
  pubkey with one stored pubkey, not with every agent before it.
- The plan's ownership-cycle check asks each pubkey's owner once, even for agents that
  each own the next (n walks up the chain each were n²/2 steps); it agrees with
  `_ownership.owned_through`, the rule `agent import` checks, on random owner graphs.
- A line longer than any backup line, or values past MAX_BACKUP_VALUES, are refused
  before json.loads sees them; strings (a name full of commas) are not counted.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import coincurve
import pyrage
import pytest

from custody import Custody, CustodyError, open_backup, restore_plan
from custody import _restore
from custody._keystore import Keystore
from custody._ownership import owned_through
from custody._restore import MAX_BACKUP_VALUES, MAX_LINE_BYTES, BackupContents

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


def _loads_spy(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every text json.loads is given from now on, in order."""
    parsed: list[bytes] = []
    real_loads: Callable[..., Any] = json.loads

    def loads(text: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(bytes(text) if isinstance(text, (bytes, bytearray)) else text.encode())
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", loads)
    return parsed


@pytest.mark.token_independent
def test_a_header_longer_than_any_backup_line_is_refused_unparsed(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reviewer's file in small: `[{},{},…]` as the header, which json.loads made 25
    times larger (64 MiB of it: 1.6 GiB) before refusing it as unreadable."""
    header = b"[" + b"{}," * (MAX_LINE_BYTES // 3) + b"{}]"
    ciphertext, identity = _ciphertext([], header=header)
    parsed = _loads_spy(monkeypatch)
    with pytest.raises(CustodyError, match=f"a header line over {MAX_LINE_BYTES} bytes"):
        open_backup(ciphertext, identity)
    assert parsed == []


@pytest.mark.token_independent
def test_a_record_line_longer_than_any_backup_line_is_refused_unparsed(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    line, _ = _agent(0, PERSON, public={"x": [[]] * (MAX_LINE_BYTES // 3)})
    ciphertext, identity = _ciphertext([line])
    parsed = _loads_spy(monkeypatch)
    with pytest.raises(CustodyError, match=f"backup entry 1: a line over {MAX_LINE_BYTES}"):
        open_backup(ciphertext, identity)
    assert len(parsed) == 1  # the header only


@pytest.mark.token_independent
def test_values_past_the_bound_are_refused_before_their_line_is_parsed(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines each within MAX_LINE_BYTES whose public entries (opaque, up to 4 KiB each)
    hold 2,000 values apiece: past MAX_BACKUP_VALUES together, the line that crosses it
    never reaches json.loads."""
    lines: list[bytes] = []
    total = len("{::,")  # the header's
    while total <= MAX_BACKUP_VALUES:
        line, _ = _agent(len(lines), PERSON, public={"x": [0] * 2000})
        total += sum(map(line.count, b",:[{"))
        lines.append(line)
    ciphertext, identity = _ciphertext(lines)
    parsed = _loads_spy(monkeypatch)
    with pytest.raises(CustodyError, match=f"more than {MAX_BACKUP_VALUES} JSON values"):
        open_backup(ciphertext, identity)
    assert len(parsed) == len(lines)  # the header and every line but the last
    assert parsed[-1] == lines[-2][65:]


@pytest.mark.token_independent
def test_json_punctuation_inside_strings_is_not_counted_as_values(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names may hold `,:[{`: counted raw, two such agents would pass a bound set just
    above what their JSON holds; without their strings they fit it."""
    name = ",:[{" * 60
    lines = [_agent(index, PERSON, public={"name": name, "creator": None})[0]
             for index in range(2)]
    values = len("{::,") + 2 * len("{::::::,,,,,{::,")  # the header's, each record's
    monkeypatch.setattr(_restore, "MAX_BACKUP_VALUES", values)
    with open_backup(*_ciphertext(lines)) as contents:
        assert isinstance(contents, BackupContents) and len(contents.records) == 2
    monkeypatch.setattr(_restore, "MAX_BACKUP_VALUES", values - 1)
    with pytest.raises(CustodyError, match="JSON values"):
        open_backup(*_ciphertext(lines))
