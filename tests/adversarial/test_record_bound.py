"""A credential holding agents.create and agents.delete cannot grow the keystore without end:
past `max_records` key records, destroyed ones included, a mint or an import is refused,
wherever the keys are held (docs/custodian.md, "Records are bounded").

- Custody in the daemon (`[custody] max_records`) and a custodian (`[custodian]
  max_records`) answer the loop's agents.create alike, `failed` + `internal` (a custody
  fault, its text for the operator's log only), and the operator's `agent create` and
  `agent import` say one line naming the key of the file that rules.
- The rule is custody's (`Custody.room`): destroyed records count; a mint reference made
  before is answered again at the bound (a retry is no new record); and two mints racing
  for the last place in one process get one record between them (it is asked again inside
  the token hop, where this process's mints pass one at a time).
"""

from __future__ import annotations

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
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.custodian import running_custodian

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
def broker_custody(request: pytest.FixtureRequest, custody_state: tuple[TokenConfig, Path],
                   local_relay: str, tmp_path: Path
                   ) -> Iterator[Mapping[str, Mapping[str, object]]]:
    """The `broker` fixture's keys held in its own process, bounded by [custody]
    max_records, or by a custodian bounded by its [custodian] max_records."""
    if request.param == "custody":
        yield {"custody": {"max_records": BOUND}}
        return
    with running_custodian(custody_state, local_relay, tmp_path,
                           settings={"max_records": BOUND}) as process:
        yield {"custody": {"custodian_socket": str(process.socket)}}


def _cli(config: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config), *args],
                          cwd=REPO, input=stdin, capture_output=True, text=True, timeout=120)


@pytest.mark.broker_config(limits={"enabled": False})
async def test_a_create_delete_loop_stops_at_max_records_answered_alike_in_both_homes(
        broker: BrokerHarness, request: pytest.FixtureRequest) -> None:
    home = request.node.callspec.params["broker_custody"]
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    credential = broker.credential(owner, [channel], actions=["agents.create", "agents.delete"])
    for n in range(BOUND - 1):
        made = await broker.call(credential, "agents.create", {
            "channelId": channel, "displayName": f"k{n}", "systemPrompt": "p"})
        assert made["status"] == "succeeded", made
        gone = await broker.call(credential, "agents.delete",
                                 {"target": {"pubkey": made["outcome"]["agentPubkey"]}})
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
        assert f"[{home}] max_records" in line and f"max_records ({BOUND})" in line, line
    assert _records(broker.state_dir) == BOUND


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
