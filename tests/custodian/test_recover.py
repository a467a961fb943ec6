"""`--recover` beside a custodian that may be told to destroy the key again, and within an
interrupted rotation (a review's two ways to lose a key the docs said could come back).

- A destroy the running custodian answers while `--recover` runs keeps its own copy, which
  `--recover` no longer deletes afterwards: the key can come back again.
- A key recovered while a rotation is interrupted after its swap is sealed again under the
  active KEK, so the rotation's rerun, which destroys the retiring KEK, leaves it usable.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from buzzwire.nostr import verify_signed
from custody import Custody, UnsignedEvent, init_kek
from custody._keys import rotate_keys
from custody.custodian import recover as command
from custody.custodian.client import CustodianClient
from tests.custodian.test_refusals import ask, held, human
from tests.custody._sealing import HUMAN
from tests.fixtures.custodian import CustodianProcess
from tests.fixtures.token import SoftHsmToken


def _recover(config: Path, pubkey: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "custody.custodian", str(config), "--recover",
                           pubkey], capture_output=True, text=True, timeout=120)


async def test_a_destroy_answered_while_recover_runs_keeps_its_copy(
        custodian: CustodianProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    client = await CustodianClient.open(custodian.socket)
    agent = await held(client, human())
    await client.aclose()
    assert ask(custodian.socket, "destroy", pubkey=agent)[0]
    revive = command.revive_agent

    async def revived_then_destroyed(custody: Custody, pubkey: str, blob: bytes) -> object:
        record = await revive(custody, pubkey, blob)
        # The pipeline's destroy, answered between the revive and the end of `--recover`:
        # the custodian keeps its copy first, as for any destroy.
        assert ask(custodian.socket, "destroy", pubkey=pubkey)[0]
        return record

    monkeypatch.setattr(command, "revive_agent", revived_then_destroyed)
    await command.recover(str(custodian.config), agent)
    monkeypatch.undo()
    again = _recover(custodian.config, agent)  # before: "no sealed copy", the key lost
    assert again.returncode == 0, again.stderr
    assert ask(custodian.socket, "sign", events=[{
        "signer": agent, "kind": 9, "created_at": 1_700_000_000, "tags": [["h", "c"]],
        "content": "back"}])[0]


@pytest.mark.token_offers("GENERATE_KEY")  # the rotation makes a KEK in the token
async def test_a_key_recovered_within_an_interrupted_rotation_survives_its_rerun(
        softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    token = softhsm_token.config(kek_label=f"recrot-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    await init_kek(token)
    async with await Custody.open(token, state) as custody:
        kept = (await custody.import_agent(bytearray(b"a5".rjust(64, b"0")), owner=HUMAN)).pubkey
        gone = (await custody.import_agent(bytearray(b"b6".rjust(64, b"0")), owner=HUMAN)).pubkey
        copy = await custody.sealed_copy(gone)  # what the custodian keeps, under this KEK
        await custody.destroy_agent(gone)

    class Killed(Exception):
        pass

    def killed_after_the_swap(step: str) -> None:
        if step == "swapped":
            raise Killed(step)

    with pytest.raises(Killed):
        await rotate_keys(token, state, checkpoint=killed_after_the_swap)
    async with await Custody.open(token, state) as custody:
        await command.revive_agent(custody, gone, copy)
    finished = await rotate_keys(token, state)  # destroys the retiring KEK the copy named
    assert finished.outcome == "finished" and finished.destroyed
    async with await Custody.open(token, state) as custody:
        for agent in (kept, gone):  # before: `gone` failed to unseal, its KEK destroyed
            signed = await custody.sign_event(agent, UnsignedEvent(agent, 1, 1, (), "after"))
            assert verify_signed(signed)
