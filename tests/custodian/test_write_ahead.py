"""Every change to the keys has a line in the custodian's log, whatever instant the process
dies at (docs/custodian.md, "A change's lines"): an `intent` line on disk before the
change, then its outcome naming the intent's seq.

- `test_a_change_killed_on_either_side_of_the_keystore_keeps_its_line`: mint, import,
  destroy and attach_auth, SIGKILLed once the intent is on disk (before custody is
  asked) and once custody's change returned (before the outcome line); then restarted
  and the request retried, as the pipeline does. (A review: killed after a destroy, the
  retry answered the tombstone and wrote no line, and the chain still verified: the
  destroy had no line, ever.)
"""

from __future__ import annotations

import json
from pathlib import Path

import coincurve
import pytest

from buzzwire.nostr import owner_tag_digest
from custody import CustodyError, TokenConfig
from custody.custodian.client import CustodianClient, CustodianUnavailable
from custody.custodian.ledger import verify_chain
from custody.custodian.server import record_obj
from tests.custodian.test_refusals import ask
from tests.custody._sealing import HUMAN
from tests.fixtures.custodian import CustodianProcess, write_custodian_config


def _lines(state: Path) -> list[dict[str, object]]:
    log = state / "custodian" / "signed.jsonl"
    text = log.read_text()
    assert verify_chain(log) == len(text.splitlines())
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("point", ["intent", "changed"])
@pytest.mark.parametrize("op", ["mint", "import", "destroy", "attach_auth"])
async def test_a_change_killed_on_either_side_of_the_keystore_keeps_its_line(
        op: str, point: str, custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    token, state = custody_state
    socket = tmp_path / "c.sock"
    custodian = CustodianProcess(write_custodian_config(
        tmp_path / "custodian.toml", token=token, state_dir=state, socket=socket,
        relay_url="ws://127.0.0.1:1"), socket)
    custodian.start()
    client = CustodianClient(socket)
    owner = coincurve.PrivateKey()
    secret = coincurve.PrivateKey()
    agent = secret.public_key_xonly.format().hex()
    if op != "import":  # the key the destroy and attach_auth act on
        assert (await client.import_agent(bytearray(secret.secret.hex().encode()),
                                          owner=owner.public_key_xonly.format().hex())).live
    tag = ["auth", owner.public_key_xonly.format().hex(), "",
           owner.sign_schnorr(owner_tag_digest(agent, "")).hex()]
    requests = {  # each as the pipeline sends it, and again as its retry
        "mint": lambda: client.mint_agent(owner=HUMAN, mint_ref="create-1"),
        "import": lambda: client.import_agent(bytearray(secret.secret.hex().encode()),
                                              owner=HUMAN),
        "destroy": lambda: client.destroy_agent(agent),
        "attach_auth": lambda: client.attach_auth_tag(agent, tag),
    }
    before = len(_lines(state)) if op != "import" else 0
    try:
        custodian.start(kill_after=f"{op}:{point}")
        with pytest.raises(CustodianUnavailable):
            await requests[op]()
        assert f"custodian.kill step={op}:{point}" in custodian.stderr.read_text()
        custodian.start()  # what systemd does
        if (op, point) == ("import", "changed"):  # the key is in: the retry is refused
            with pytest.raises(CustodyError, match="already held"):
                await requests[op]()
            record = client.agent(agent)
        else:
            record = await requests[op]()
        assert record is not None
        await client.aclose()
    finally:
        custodian.stop()

    # The keystore holds the change, made by the killed request or by its retry.
    done = {"mint": record.live and record.mint_ref == "create-1",
            "import": record.live and record.pubkey == agent,
            "destroy": record.deleted_at is not None,
            "attach_auth": record.auth_tag == tuple(tag)}
    assert done[op], record_obj(record)
    lines = _lines(state)[before:]
    killed, *retried = [e for e in lines if e["op"] == "intent" and e["for"] == op]
    outcomes = {e["intent"]: e["op"] for e in lines if "intent" in e}
    assert killed["seq"] not in outcomes  # "attempted; the keystore says whether it was made"
    if point == "intent":  # nothing made: the retry makes it, under an intent of its own
        assert [outcomes[e["seq"]] for e in retried] == [op]
    else:  # made: the retry changes nothing, so no line says it made it (import's: refused)
        assert [outcomes[e["seq"]] for e in retried] == (["failed"] if op == "import" else [])
    assert [e["op"] for e in lines].count(op) == (1 if point == "intent" else 0)

