"""A credential holding agents.create and agents.delete cannot grow the keystore without end:
past `max_records` key records, destroyed ones included, a mint or an import is refused,
wherever the keys are held (docs/custodian.md, "Records are bounded").

- Custody in the daemon (`[custody] max_records`) and a custodian (`[custodian]
  max_records`) answer the loop's agents.create alike, `failed` + `internal` (a custody
  fault, its text for the operator's log only), and the operator's `agent create` and
  `agent import` say one line naming the key of the file that rules. The way back it
  names: the removed agents' records forgotten, by `agent forget` in the daemon's home,
  by the custodian's `--forget-destroyed` in its (where `agent forget` names that one).
- The rule is custody's (`Custody.room`): destroyed records count; a mint reference made
  before is answered again at the bound (a retry is no new record); and two mints racing
  for the last place in one process get one record between them (it is asked again inside
  the token hop, where this process's mints pass one at a time).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import coincurve
import pytest
import trio

from custody import Custody, CustodyError, RecordBound, TokenConfig
from custody._keystore import KEYSTORE_FILE
from daemon.state.directory import DIRECTORY_FILE
from tests.backup.test_backup import key_events
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.custodian import CustodianProcess, running_custodian

REPO = Path(__file__).resolve().parents[2]
#: Records the tests allow: the first agent's, and two more.
BOUND = 3


def _human() -> str:
    return coincurve.PrivateKey().public_key_xonly.format().hex()


def _records(state_dir: Path) -> int:
    db = sqlite3.connect(f"file:{state_dir / KEYSTORE_FILE}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT count(*) FROM keys").fetchone()[0])
    finally:
        db.close()


@pytest.fixture(params=["custody", "custodian"])
def home(request: pytest.FixtureRequest, custody_state: tuple[TokenConfig, Path],
         local_relay: str, tmp_path: Path) -> Iterator[CustodianProcess | None]:
    """Who holds the `broker` fixture's keys: its own process (None), or this custodian,
    each bounded at BOUND records."""
    if request.param == "custody":
        yield None
        return
    with running_custodian(custody_state, local_relay, tmp_path,
                           settings={"max_records": BOUND}) as process:
        yield process


@pytest.fixture
def broker_custody(home: CustodianProcess | None) -> Mapping[str, Mapping[str, object]]:
    if home is None:
        return {"custody": {"max_records": BOUND}}
    return {"custody": {"custodian_socket": str(home.socket)}}


def _cli(config: Path, *args: str, stdin: str = "", custodian: bool = False
         ) -> subprocess.CompletedProcess[str]:
    """`buzz-broker --config FILE ...`, or with `custodian` `buzz-broker custodian FILE ...`."""
    words = ["custodian", str(config)] if custodian else ["--config", str(config)]
    return subprocess.run([sys.executable, "-m", "daemon.cli", *words, *args],
                          cwd=REPO, input=stdin, capture_output=True, text=True, timeout=120)


@pytest.mark.broker_config(limits={"enabled": False})
async def test_a_create_delete_loop_stops_at_max_records_answered_alike_in_both_homes(
        broker: BrokerHarness, home: CustodianProcess | None) -> None:
    table = "custody" if home is None else "custodian"
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    credential = broker.credential(owner, [channel], actions=["agents.create", "agents.delete"])
    removed = []
    for n in range(BOUND - 1):
        made = await broker.call(credential, "agents.create", {
            "channelId": channel, "displayName": f"k{n}", "systemPrompt": "p"})
        assert made["status"] == "succeeded", made
        removed.append(made["outcome"]["agentPubkey"])
        gone = await broker.call(credential, "agents.delete", {"target": {"pubkey": removed[-1]}})
        assert gone["status"] == "succeeded", gone
    assert _records(broker.state_dir) == BOUND  # one live agent, the rest tombstones
    refused = await broker.call(credential, "agents.create", {
        "channelId": channel, "displayName": "one too many", "systemPrompt": "p"})
    assert (refused["status"], refused["error"]["code"]) == ("failed", "internal"), refused
    assert _records(broker.state_dir) == BOUND
    # The operator's commands: one line, naming the key of the file that rules here.
    for args, stdin in ((("agent", "create", "--owner", _human(), "--name", "x"), ""),
                        (("agent", "import", "--owner", _human()),
                         coincurve.PrivateKey().secret.hex() + "\n")):
        done = _cli(broker.config_path, *args, stdin=stdin)
        line = done.stderr.strip()
        assert (done.returncode, done.stdout, line.count("\n")) == (1, "", 0), done
        assert f"[{table}] max_records" in line and f"max_records ({BOUND})" in line, line
        assert ("buzz-broker agent forget" if home is None else "--forget-destroyed") in line
    assert _records(broker.state_dir) == BOUND
    # The way back the refusal names: the removed agents' records forgotten by the operator.
    done = _cli(broker.config_path, "agent", "forget", *removed)
    if home is None:
        assert done.returncode == 0, done.stderr
        assert "forgot 2 removed agents' records" in done.stderr, done.stderr
    else:  # the custodian's records are its own: its command, under its uid
        assert done.returncode == 2 and "--forget-destroyed" in done.stderr, done
        assert _records(broker.state_dir) == BOUND
        done = _cli(home.config, "--forget-destroyed", *removed, custodian=True)
        assert done.returncode == 0, done.stderr
    assert _records(broker.state_dir) == 1
    made = await broker.call(credential, "agents.create", {
        "channelId": channel, "displayName": "room again", "systemPrompt": "p"})
    assert made["status"] == "succeeded", made


async def test_destroyed_records_count_and_a_mint_ref_made_before_is_answered_at_the_bound(
        custody_state: tuple[TokenConfig, Path]) -> None:
    token, state_dir = custody_state
    owner = _human()
    bound = RecordBound(2, remedy="raise it")
    async with await Custody.open(token, state_dir, records=bound) as custody:
        first = await custody.mint_agent(owner=owner, mint_ref="a")
        await custody.destroy_agent(first.pubkey)
        second = await custody.mint_agent(owner=owner, mint_ref="b")
        with pytest.raises(CustodyError, match=r"max_records \(2\) records, destroyed ones "
                                               r"included: raise it"):
            await custody.mint_agent(owner=owner, mint_ref="c")
        with pytest.raises(CustodyError, match=r"max_records \(2\)"):
            await custody.import_agent(bytearray(coincurve.PrivateKey().secret.hex().encode()),
                                       owner=owner)
        assert await custody.mint_agent(owner=owner, mint_ref="b") == second
        assert {r.pubkey for r in custody.agents(include_deleted=True)} == {first.pubkey,
                                                                             second.pubkey}


async def test_two_mints_racing_for_the_last_place_make_one_record(
        custody_state: tuple[TokenConfig, Path]) -> None:
    token, state_dir = custody_state
    owner = _human()
    async with await Custody.open(token, state_dir, records=RecordBound(2)) as custody:
        await custody.mint_agent(owner=owner)
        outcomes: list[str] = []

        async def mint() -> None:
            try:
                await custody.mint_agent(owner=owner)
                outcomes.append("made")
            except CustodyError:
                outcomes.append("refused")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(mint)
            nursery.start_soon(mint)
        assert sorted(outcomes) == ["made", "refused"]
        assert len(custody.agents(include_deleted=True)) == 2


@pytest.mark.parametrize("home", ["custody"], indirect=True)
async def test_agent_forget_forgets_all_the_named_or_none_and_echoes_no_malformed_key(
        broker: BrokerHarness, home: None) -> None:
    owner = await broker.human_owned_agent("owner")
    removed = (await broker.custody.mint_agent(owner=owner)).pubkey
    await broker.custody.destroy_agent(removed)
    nsec = "nsec1" + "q" * 58
    done = _cli(broker.config_path, "agent", "forget", removed, nsec)
    assert done.returncode == 2 and nsec not in done.stderr, done
    assert "key 2 named is not a pubkey" in done.stderr
    # A secret key is 64 hex too: one named by mistake has no record, and is not echoed.
    secret = coincurve.PrivateKey().secret.hex()
    done = _cli(broker.config_path, "agent", "forget", removed, owner, secret)
    assert done.returncode == 1 and secret not in done.stderr, done
    assert f"{owner}: not forgotten: a live key" in done.stderr
    assert "key 3 named (not shown): not forgotten: no record" in done.stderr
    assert _records(broker.state_dir) == 2  # all or none: the removed one stays too
    assert _cli(broker.config_path, "agent", "forget", removed).returncode == 0
    assert _records(broker.state_dir) == 1


@pytest.mark.parametrize("home", ["custody"], indirect=True)
async def test_forget_then_reimport_takes_the_new_name(broker: BrokerHarness, home: None) -> None:
    """`agent forget` drops the name of each key it forgot at once, one written a moment
    ago too (the prune's minute of grace is for a custodian's lagging records): before,
    the name stayed, and a re-import (whose name write keeps a name already set) kept it."""
    human, secret = _human(), coincurve.PrivateKey()
    pubkey = secret.public_key_xonly.format().hex()
    done = _cli(broker.config_path, "agent", "import", "--owner", human, "--name", "old-name",
                stdin=secret.secret.hex() + "\n")
    assert done.returncode == 0, done.stderr
    assert _cli(broker.config_path, "agent", "remove", pubkey, "--yes").returncode == 0
    done = _cli(broker.config_path, "agent", "forget", pubkey)
    assert done.returncode == 0, done.stderr
    assert _names(broker.state_dir, pubkey) == []
    done = _cli(broker.config_path, "agent", "import", "--owner", human, "--name", "new-name",
                stdin=secret.secret.hex() + "\n")
    assert done.returncode == 0, done.stderr
    listed = _cli(broker.config_path, "agent", "list", "--json")
    assert [row["name"] for row in map(json.loads, listed.stdout.splitlines())
            if row["pubkey"] == pubkey] == ["new-name"]


@pytest.mark.parametrize("home", ["custody"], indirect=True)
async def test_agent_forget_is_recorded_in_the_key_event_log(broker: BrokerHarness,
                                                             home: None) -> None:
    """As a custodian's `--forget-destroyed` is in its signed log: an intent, then the
    records that went, or the refusal's line (before, nothing was written)."""
    owner = await broker.human_owned_agent("owner")
    removed = (await broker.custody.mint_agent(owner=owner)).pubkey
    await broker.custody.destroy_agent(removed)
    assert _cli(broker.config_path, "agent", "forget", removed, owner).returncode == 1
    assert _cli(broker.config_path, "agent", "forget", removed).returncode == 0
    events = key_events(broker.state_dir)  # its chain verified whole
    assert [(e["event"], e["stage"], e["agents"], e["pubkeys"]) for e in events] == [
        ("forget", "intent", None, []),
        ("forget", "failed", None, []),
        ("forget", "intent", None, []),
        ("forget", "done", 1, [removed])]
    assert events[0]["op"] == events[1]["op"] != events[2]["op"] == events[3]["op"]
    assert "nothing was forgotten" in str(events[1]["fault"])


def _names(state_dir: Path, pubkey: str) -> list[str]:
    db = sqlite3.connect(f"file:{state_dir / DIRECTORY_FILE}?mode=ro", uri=True)
    try:
        return [name for (name,) in db.execute("SELECT name FROM names WHERE pubkey = ?",
                                                (pubkey,))]
    finally:
        db.close()
