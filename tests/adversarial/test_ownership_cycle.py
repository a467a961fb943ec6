"""Ownership cycles and the per-agent lock order (issue 13, item 7).

Attack: import two agents that own each other (A owns B, then B is imported as A's owner).
Each can then act for the other, and agents.update takes the requester's lock and then
its target's: A updating B and B updating A at once each held one lock and waited for the
other's, forever (both requests hung, and every later read-merge-write of either agent
queued behind them).

Proven here:
- `agent import` refuses a cycle, direct or through a chain, through custody and through
  the CLI, and imports nothing;
- with a cycle already in the keystore (an older version let it in; written here straight
  into the keystore database), the two crossed agents.update requests both finish: locks
  are taken in one global order. The window between taking the first lock and asking for
  the second is widened to make the crossing certain on the old code (it hung there).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import coincurve
import pytest
import trio

from custody import Custody, CustodyError, TokenConfig
from daemon.pipeline import broker as broker_module
from tests.fixtures.broker import BrokerHarness, write_config
from tests.json_lines import json_lines

CHANNEL = str(uuid.uuid4())


def _key() -> tuple[bytearray, str]:
    secret = coincurve.PrivateKey()
    return bytearray(secret.secret.hex().encode("ascii")), secret.public_key_xonly.format().hex()


async def test_import_refuses_an_ownership_cycle(custody: Custody) -> None:
    human = _key()[1]
    (a_secret, a), (b_secret, b), (c_secret, c) = _key(), _key(), _key()
    # b owned by a (a not held yet), c owned by b: a chain c -> b -> a.
    await custody.import_agent(b_secret, owner=a)
    await custody.import_agent(c_secret, owner=b)
    # a owned by c would close it through the chain; a owned by b, directly.
    for owner in (c, b):
        secret = bytearray(a_secret)  # import zeroes what it is given
        with pytest.raises(CustodyError, match="ownership cycle"):
            await custody.import_agent(secret, owner=owner)
        assert custody.agent(a, include_deleted=True) is None
    # A tree is fine: a owned by a human.
    assert (await custody.import_agent(a_secret, owner=human)).pubkey == a


def test_agent_import_cli_refuses_an_ownership_cycle(
    custody_state: tuple[TokenConfig, Path], tmp_path: Path
) -> None:
    token, state_dir = custody_state
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state_dir,
                          socket=tmp_path / "b.sock", relay_url="ws://127.0.0.1:9")
    (a_secret, a), (b_secret, b) = _key(), _key()

    def cli(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config),
                               "agent", *args], input=stdin, capture_output=True, text=True,
                              timeout=60, env=dict(os.environ))
        assert "Traceback" not in done.stderr
        return done

    assert cli("import", "--owner", a, stdin=b_secret.decode()).returncode == 0
    refused = cli("import", "--owner", b, stdin=a_secret.decode())
    assert refused.returncode != 0 and "ownership cycle" in refused.stderr
    assert refused.stdout == ""
    held = {r["pubkey"] for r in json_lines(cli("list", "--all", "--json", stdin="").stdout)}
    assert held == {b}


# The models the crossed updates name, declared: a host refuses one it does not offer.
@pytest.mark.broker_config(policy={"models": ["a-updates-b", "b-updates-a"]})
async def test_crossed_agents_updates_in_a_cycle_do_not_deadlock(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await broker.human_owned_agent("a")
    b = (await broker.custody.import_agent(_key()[0], owner=a)).pubkey
    # The cycle an older version let in: a is now owned by b (and b by a).
    db = sqlite3.connect(broker.state_dir / "keystore.db")
    with db:
        db.execute("UPDATE keys SET owner = ? WHERE pubkey = ?", (b, a))
    db.close()
    assert broker.custody.agent(a).owner == b  # type: ignore[union-attr]
    cred_a, cred_b = broker.credential(a, [CHANNEL]), broker.credential(b, [CHANNEL])

    real_hold = broker_module._AgentLocks.hold

    @asynccontextmanager
    async def slow_hold(self: broker_module._AgentLocks, agent: str) -> AsyncIterator[None]:
        async with real_hold(self, agent):
            await trio.sleep(0.3)  # both requests hold their first lock before either asks on
            yield

    monkeypatch.setattr(broker_module._AgentLocks, "hold", slow_hold)
    answers: dict[str, dict[str, object]] = {}

    async def update(credential: str, target: str, label: str) -> None:
        answers[label] = await broker.call(credential, "agents.update",
                                           {"target": {"pubkey": target}, "model": label})

    with trio.move_on_after(20) as timer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(update, cred_a, b, "a-updates-b")
            nursery.start_soon(update, cred_b, a, "b-updates-a")
    assert not timer.cancelled_caught, "the crossed updates deadlocked"
    assert {k: v["status"] for k, v in answers.items()} == {
        "a-updates-b": "succeeded", "b-updates-a": "succeeded"}, answers
