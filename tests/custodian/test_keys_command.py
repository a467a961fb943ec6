"""`buzz-broker custodian FILE keys init|rotate`: the KEK commands, from the custodian's own
configuration, with the custodian stopped (docs/custodian.md, "Commands run with the
custodian stopped").

- `keys init` makes the KEK from FILE's `[pkcs11]`; run again, it checks it.
- `keys rotate` reseals every agent: the custodian starts afterwards on the new KEK, the
  key signs, and the rotation is a line of the custodian's hash-chained log.
- While the custodian runs, `keys rotate` refuses (the state lock) and changes nothing.
- A word the command does not take is a usage line, exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from buzzwire.nostr import verify_signed
from custody import Custody, UnsignedEvent
from custody.custodian.ledger import verify_chain
from tests.custody._sealing import HUMAN
from tests.fixtures.custodian import CustodianProcess, write_custodian_config
from tests.fixtures.token import SoftHsmToken

REPO = Path(__file__).resolve().parents[2]
SECRET = "00000000000000000000000000000000000000000000000000000000000000a5"


def _keys(config: Path, *words: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("CREDENTIALS_DIRECTORY", None)
    return subprocess.run([sys.executable, "-m", "custody.custodian", str(config), "keys",
                           *words], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.token_offers("GENERATE_KEY")  # init and rotate make keys in the token
async def test_init_then_rotate_from_the_custodians_file(
        softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    token = softhsm_token.config(kek_label=f"custkeys-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    config = write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state,
                                    socket=tmp_path / "c.sock", relay_url="ws://127.0.0.1:1")
    first = _keys(config, "init")
    assert first.returncode == 0, first.stderr
    again = _keys(config, "init")
    assert again.returncode == 0 and "present and checked" in again.stdout, again.stdout
    async with await Custody.open(token, state) as custody:
        agent = (await custody.import_agent(bytearray(SECRET.encode()), owner=HUMAN)).pubkey

    running = CustodianProcess(config, tmp_path / "c.sock")
    running.start()
    try:
        refused = _keys(config, "rotate")
        assert refused.returncode == 1 and "in use" in refused.stderr, refused.stderr
    finally:
        running.stop()

    rotated = _keys(config, "rotate")
    assert rotated.returncode == 0, rotated.stderr
    assert "1 agents under KEK" in rotated.stdout and token.kek_label in rotated.stdout
    log = state / "custodian" / "signed.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["op"] for line in lines] == ["rotate"]
    assert lines[0]["old_kek"] == token.kek_label != lines[0]["new_kek"]
    assert verify_chain(log) == 1

    running.start()  # the custodian opens under the new KEK the keystore records
    running.stop()
    async with await Custody.open(token, state) as custody:  # and the resealed key signs
        signed = await custody.sign_event(agent, UnsignedEvent(agent, 1, 1, (), "after"))
    assert verify_signed(signed)


def test_a_word_it_does_not_take_is_a_usage_line(tmp_path: Path) -> None:
    config = tmp_path / "custodian.toml"
    config.write_text('[custodian]\nsocket = "s"\nstate_dir = "st"\nrelay_url = "ws://x"\n'
                      '[pkcs11]\nmodule = "/nonexistent.so"\ntoken_label = "t"\n')
    for words in (("spin",), ("rotate", "--now", "1"), ("migrate",), ()):
        done = _keys(config, *words)
        assert done.returncode in (1, 2) and "usage" in done.stderr, (words, done.stderr)
        assert "Traceback" not in done.stderr
