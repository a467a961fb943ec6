"""What an agent's create and delete leave behind besides its key record, which
`max_records` bounds (tests/adversarial/test_record_bound.py), wherever the keys are held.

- Relay watermarks (daemon/state/sign_watermarks.py): the deleted agent's own kind 0 row
  and its owner's kind 30177 row about it, and its runtime (daemon/state/runtimes.py),
  go once its key cannot sign here again: with
  custody in the daemon at the destroy (agents.delete, `agent remove`), and at the next
  start for a key destroyed before; with a custodian, whose `--recover` may bring the key
  back, they stay while it keeps the record.
- Names (daemon/state/directory.py): a deleted agent is listed by its name while its
  record stays (one name per record, bounded as the records are); a record a custodian's
  `--forget-destroyed` drops loses its name at the daemon's next destroy.
- A key source that lists none of the keys the stores hold is taken for a wrong one (an
  empty custodian), not for every agent gone: nothing is pruned, and a warning says so.
"""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import coincurve
import pytest
import trio

from custody import Custody, TokenConfig
from daemon.config import load_config
from daemon.state import directory as directory_module
from daemon.state.directory import DIRECTORY_FILE
from daemon.state.runtimes import RUNTIMES_DB, RuntimeStore
from daemon.state.sign_watermarks import WATERMARKS_DB, SignWatermarks
from daemon.wiring import running
from tests.fixtures.broker import BrokerHarness, write_config
from tests.fixtures.custodian import CustodianProcess, running_custodian

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["custody", "custodian"])
def home(request: pytest.FixtureRequest, custody_state: tuple[TokenConfig, Path],
         local_relay: str, tmp_path: Path) -> Iterator[CustodianProcess | None]:
    """Who holds the `broker` fixture's keys: its own process (None), or this custodian."""
    if request.param == "custody":
        yield None
        return
    with running_custodian(custody_state, local_relay, tmp_path) as process:
        yield process


@pytest.fixture
def broker_custody(home: CustodianProcess | None) -> Mapping[str, Mapping[str, object]]:
    return {} if home is None else {"custody": {"custodian_socket": str(home.socket)}}


def _about(state_dir: Path, agent: str) -> list[tuple[str, int, str]]:
    """The watermark rows by `agent`, or about it (a 30177 whose d is it)."""
    db = sqlite3.connect(f"file:{state_dir / WATERMARKS_DB}?mode=ro", uri=True)
    try:
        return db.execute("SELECT agent, kind, d FROM watermarks WHERE agent = ? OR d = ? "
                          "ORDER BY agent, kind", (agent, agent)).fetchall()
    finally:
        db.close()


async def _created(broker: BrokerHarness, credential: str, channel: str, name: str) -> str:
    made = await broker.call(credential, "agents.create", {
        "channelId": channel, "displayName": name, "systemPrompt": "p", "runtime": "goose"})
    assert made["status"] == "succeeded", made
    return str(made["outcome"]["agentPubkey"])


def _runtimes(state_dir: Path) -> set[str]:
    db = sqlite3.connect(f"file:{state_dir / RUNTIMES_DB}?mode=ro", uri=True)
    try:
        return {pubkey for (pubkey,) in db.execute("SELECT pubkey FROM runtimes")}
    finally:
        db.close()


@pytest.mark.broker_config(limits={"enabled": False})
async def test_a_deleted_agents_watermarks_and_runtime_go_unless_a_custodian_may_bring_it_back(
        broker: BrokerHarness, home: CustodianProcess | None) -> None:
    in_process = home is None
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    credential = broker.credential(owner, [channel], actions=["agents.create", "agents.delete"])
    deleted = await _created(broker, credential, channel, "deleted")
    removed = await _created(broker, credential, channel, "removed")
    kept = await _created(broker, credential, channel, "kept")
    rows = {a: _about(broker.state_dir, a) for a in (deleted, removed, kept)}
    for agent, held in rows.items():
        assert held == sorted([(agent, 0, ""), (owner, 30177, agent)]), held
    assert _runtimes(broker.state_dir) == {deleted, removed, kept}

    gone = await broker.call(credential, "agents.delete", {"target": {"pubkey": deleted}})
    assert gone["status"] == "succeeded", gone
    done = subprocess.run([sys.executable, "-m", "daemon.cli", "--config",
                           str(broker.config_path), "agent", "remove", removed, "--yes"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for agent in (deleted, removed):
        assert _about(broker.state_dir, agent) == ([] if in_process else rows[agent])
    assert _about(broker.state_dir, kept) == rows[kept]
    assert _runtimes(broker.state_dir) == (
        {kept} if in_process else {deleted, removed, kept})


@pytest.mark.parametrize("home", ["custodian"], indirect=True)
@pytest.mark.broker_config(limits={"enabled": False})
async def test_a_deleted_agents_watermarks_and_runtime_go_once_the_custodian_forgets_its_record(
        broker: BrokerHarness, home: CustodianProcess) -> None:
    """The other half of the custodian's case: kept while its `--recover` could bring the
    key back, the rows go at the daemon's next destroy once `--forget-destroyed` has
    dropped the record."""
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    credential = broker.credential(owner, [channel], actions=["agents.create", "agents.delete"])
    deleted = await _created(broker, credential, channel, "deleted")
    later = await _created(broker, credential, channel, "later")
    gone = await broker.call(credential, "agents.delete", {"target": {"pubkey": deleted}})
    assert gone["status"] == "succeeded", gone
    assert _about(broker.state_dir, deleted) == sorted([(deleted, 0, ""), (owner, 30177, deleted)])
    forgot = subprocess.run([sys.executable, "-m", "daemon.cli", "custodian", str(home.config),
                             "--forget-destroyed", deleted], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert forgot.returncode == 0, forgot.stderr
    gone = await broker.call(credential, "agents.delete", {"target": {"pubkey": later}})
    assert gone["status"] == "succeeded", gone
    assert _about(broker.state_dir, deleted) == []
    assert _about(broker.state_dir, later) == sorted([(later, 0, ""), (owner, 30177, later)])
    assert _runtimes(broker.state_dir) == {later}


async def test_a_start_drops_the_watermarks_and_runtime_a_destroy_left_before(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A state directory from before this version: a destroyed key's rows, left then, go
    when the daemon starts; a live key's stay."""
    token, state_dir = custody_state
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    async with await Custody.open(token, state_dir) as custody:
        live = (await custody.mint_agent(owner=owner)).pubkey
        destroyed = (await custody.mint_agent(owner=live)).pubkey
        await custody.destroy_agent(destroyed)
    store = SignWatermarks.open(state_dir)
    for agent in (live, destroyed):
        store.record(agent, 0, "", 1, "1" * 64)
    store.record(live, 30177, destroyed, 1, "2" * 64)
    store.close()
    runtimes = RuntimeStore.open(state_dir)
    for agent in (live, destroyed):
        runtimes.set(agent, "goose", 1)
    runtimes.close()
    config = load_config(str(write_config(tmp_path / "broker.toml", token=token,
                                          state_dir=state_dir, socket=tmp_path / "b.sock",
                                          relay_url=local_relay)))
    caplog.set_level(logging.INFO, logger="buzz_broker.leftovers")
    async with running(config):
        assert _about(state_dir, destroyed) == []
        assert _about(state_dir, live) == [(live, 0, "")]
        assert _runtimes(state_dir) == {live}
    # What went is said, counted per store (no pubkey: the rows are the agents' business).
    assert _logged(caplog, "leftovers.pruned") == [
        (logging.INFO, {"names": 0, "watermarks": 2, "runtimes": 1})]


def _logged(caplog: pytest.LogCaptureFixture, name: str) -> list[tuple[int, dict[str, object]]]:
    """The level and fields of each `name` line logged (daemon/log.py `log_event`)."""
    return [(r.levelno, getattr(r, "buzz_fields")) for r in caplog.records
            if getattr(r, "buzz_event", None) == name]


async def test_a_key_source_holding_none_of_the_agents_prunes_nothing_and_says_so(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A daemon started against a custodian whose keystore is empty (a rebuilt host's new
    custodian before its `keys restore`): before, its start dropped every agent's name,
    watermarks and runtime, and said nothing."""
    token, state_dir = custody_state
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    async with await Custody.open(token, state_dir) as custody:
        agent = (await custody.mint_agent(owner=owner)).pubkey
    directory = directory_module.AgentDirectory.open(state_dir)
    directory.enroll(agent, "payments-bot", now=1)  # long past the custodian-lag grace
    directory.close()
    store = SignWatermarks.open(state_dir)
    store.record(agent, 0, "", 1, "1" * 64)
    store.close()
    runtimes = RuntimeStore.open(state_dir)
    runtimes.set(agent, "goose", 1)
    runtimes.close()
    (tmp_path / "custodian").mkdir()
    caplog.set_level(logging.INFO, logger="buzz_broker.leftovers")
    with running_custodian((token, tmp_path / "empty"), local_relay,
                           tmp_path / "custodian") as empty:
        config = load_config(str(write_config(
            tmp_path / "broker.toml", token=token, state_dir=state_dir,
            socket=tmp_path / "b.sock", relay_url=local_relay,
            sections={"custody": {"custodian_socket": str(empty.socket)}})))
        async with running(config):
            pass
    assert _named(state_dir) == {agent}
    assert _about(state_dir, agent) == [(agent, 0, "")]
    assert _runtimes(state_dir) == {agent}
    [(level, warned)] = _logged(caplog, "leftovers.unmatched")
    assert (level, warned["agents"], warned["records"]) == (logging.WARNING, 1, 0)
    assert "holds none of the agents" in str(warned["detail"])
    assert "nothing was pruned" in str(warned["detail"])
    assert _logged(caplog, "leftovers.pruned") == []


def _named(state_dir: Path) -> set[str]:
    db = sqlite3.connect(f"file:{state_dir / DIRECTORY_FILE}?mode=ro", uri=True)
    try:
        return {pubkey for (pubkey,) in db.execute("SELECT pubkey FROM names")}
    finally:
        db.close()


@pytest.mark.broker_config(limits={"enabled": False})
async def test_a_deleted_agents_name_stays_with_its_record_and_goes_once_it_is_forgotten(
        broker: BrokerHarness, home: CustodianProcess | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A name is kept from pruning for a minute (a custodian's records may lag an operator's
    # command); here the test's own names are old enough once a second has passed.
    monkeypatch.setattr(directory_module, "PRUNE_AFTER_SECONDS", 0)
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    credential = broker.credential(owner, [channel], actions=["agents.create", "agents.delete"])
    first = await _created(broker, credential, channel, "first")
    gone = await broker.call(credential, "agents.delete", {"target": {"pubkey": first}})
    assert gone["status"] == "succeeded", gone
    listed = broker.app.directory.get(first)
    assert listed is not None and not listed.live and listed.name == "first"
    assert _named(broker.state_dir) == {owner, first}
    if home is None:
        # Custody in the daemon: `agent forget` drops the record, and the name with it.
        forgot = subprocess.run([sys.executable, "-m", "daemon.cli", "--config",
                                 str(broker.config_path), "agent", "forget", first], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert forgot.returncode == 0, forgot.stderr
        assert _named(broker.state_dir) == {owner}
        assert broker.app.directory.get(first) is None
        return
    forgot = subprocess.run([sys.executable, "-m", "daemon.cli", "custodian", str(home.config),
                             "--forget-destroyed", first], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert forgot.returncode == 0, forgot.stderr
    await trio.sleep(1.1)
    second = await _created(broker, credential, channel, "second")
    gone = await broker.call(credential, "agents.delete", {"target": {"pubkey": second}})
    assert gone["status"] == "succeeded", gone
    assert _named(broker.state_dir) == {owner, second}
