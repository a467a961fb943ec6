"""`buzz-broker custodian FILE keys init|rotate`: the KEK commands, from the custodian's own
configuration, with the custodian stopped (docs/custodian.md, "Commands run with the
custodian stopped").

- `keys init` makes the KEK from FILE's `[pkcs11]`; run again, it checks it.
- `keys rotate` reseals every agent: the custodian starts afterwards on the new KEK, the
  key signs, and the rotation is an intent and its outcome in the custodian's
  hash-chained log.
- While the custodian runs, `keys rotate` refuses (the state lock) and changes nothing.
- A word the command does not take is a usage line, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from buzzwire.nostr import verify_signed
from custody import Custody, CustodyError, UnsignedEvent, init_kek
from custody.custodian.verify import verify_chain
from tests.custody._sealing import HUMAN
from tests.custody.test_rotation import keystore_meta, second_token  # noqa: F401 (a fixture)
from tests.custody.test_rotation import token_objects
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
    # What docs/install.md ("Seal and KEK") shows: one line on stdout, and one on stderr
    # per key created (the daemon's `keys init` lines are not the custodian's).
    made = [token.kek_label] + [f"{token.kek_label}-mac"] * ("seal etm;" in first.stdout)
    said = re.escape(f"custodian: KEK {token.kek_label!r} in token {token.token_label!r}, ")
    assert re.fullmatch(rf"{said}seal (gcm|etm); keys created: {re.escape(', '.join(made))}\n",
                        first.stdout), first.stdout
    assert [line for line in first.stderr.splitlines() if "created key" in line] == [
        f"custodian: created key {label!r} in token {token.token_label!r}" for label in made]
    again = _keys(config, "init")
    assert again.returncode == 0, again.stderr
    assert again.stdout == (f"custodian: KEK {token.kek_label!r} in token "
                            f"{token.token_label!r}, seal {first.stdout.split('seal ')[1][:3]}; "
                            "keys created: none (present and checked)\n"), again.stdout
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
    assert [(line["op"], line.get("for")) for line in lines] == [("intent", "rotate"),
                                                                  ("rotate", None)]
    assert lines[1]["old_kek"] == token.kek_label != lines[1]["new_kek"]
    assert lines[1]["intent"] == lines[0]["seq"]
    assert verify_chain(log) == 2

    running.start()  # the custodian opens under the new KEK the keystore records
    running.stop()
    async with await Custody.open(token, state) as custody:  # and the resealed key signs
        signed = await custody.sign_event(agent, UnsignedEvent(agent, 1, 1, (), "after"))
    assert verify_signed(signed)


@pytest.mark.token_offers("GENERATE_KEY")  # the old code made the new KEK before refusing
async def test_rotate_with_a_mistyped_kek_label_refuses_and_changes_nothing(
        softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    """As the daemon's `keys rotate` (tests/custody/test_rotation.py): no plan recorded, no
    key made, one line and exit 1, when [pkcs11] kek_label names no KEK in the token."""
    token = softhsm_token.config(kek_label=f"custtypo-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    config = write_custodian_config(
        tmp_path / "custodian.toml", token=dataclasses.replace(token, kek_label="custtypo-x"),
        state_dir=state, socket=tmp_path / "c.sock", relay_url="ws://127.0.0.1:1")
    await init_kek(token)
    async with await Custody.open(token, state) as custody:
        await custody.import_agent(bytearray(SECRET.encode()), owner=HUMAN)
    objects, meta = await token_objects(token), keystore_meta(state)
    refused = _keys(config, "rotate")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert await token_objects(token) == objects
    assert keystore_meta(state) == meta
    assert "no KEK labelled 'custtypo-x' to rotate from" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_word_it_does_not_take_is_a_usage_line(tmp_path: Path) -> None:
    config = tmp_path / "custodian.toml"
    config.write_text('[custodian]\nsocket = "s"\nstate_dir = "st"\nrelay_url = "ws://x"\n'
                      '[pkcs11]\nmodule = "/nonexistent.so"\ntoken_label = "t"\n')
    for words in (("spin",), ("rotate", "--now", "1"), ("migrate",), ()):
        done = _keys(config, *words)
        assert done.returncode == 2 and "usage" in done.stderr, (words, done.stderr)
        assert "Traceback" not in done.stderr


def _recover(config: Path, pubkey: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("CREDENTIALS_DIRECTORY", None)
    return subprocess.run([sys.executable, "-m", "custody.custodian", str(config), "--recover",
                           pubkey], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.token_offers("GENERATE_KEY")
async def test_rotate_refuses_while_a_destroyed_key_is_recoverable_unless_given_up(
        softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    """A destroyed key's grace copy is sealed under the KEK a rotation destroys: rotating
    silently made every such destroy final. `rotate` (and `migrate`) refuse while one is
    held, naming both ways on; a key recovered first is resealed with the rest, and
    `--abandon-destroyed` gives the others up, counted in the custodian's log."""
    token = softhsm_token.config(kek_label=f"custgrace-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    config = write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state,
                                    socket=tmp_path / "c.sock", relay_url="ws://127.0.0.1:1")
    kept, given_up = _two_agents(config, tmp_path / "c.sock", destroyed=2)
    log = state / "custodian" / "signed.jsonl"
    refused = _keys(config, "rotate")
    assert refused.returncode == 1 and "2 destroyed key(s) can still be recovered" in refused.stderr
    assert "--recover PUBKEY" in refused.stderr and "--abandon-destroyed" in refused.stderr
    assert "rotate" not in log.read_text(), "refused before anything changed"
    assert _recover(config, kept).returncode == 0
    assert "1 destroyed key(s)" in _keys(config, "rotate").stderr
    rotated = _keys(config, "rotate", "--abandon-destroyed")
    assert rotated.returncode == 0, rotated.stderr
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["op"] == "rotate" and last["abandoned"] == 1 and last["agents"] == 1
    assert verify_chain(log) == len(log.read_text().splitlines())
    gone = _recover(config, given_up)
    assert gone.returncode == 1 and "no sealed copy" in gone.stderr, gone.stderr
    async with await Custody.open(token, state) as custody:  # the recovered key signs
        signed = await custody.sign_event(kept, UnsignedEvent(kept, 1, 1, (), "after"))
    assert verify_signed(signed)


def _two_agents(config: Path, socket: Path, *, destroyed: int) -> tuple[str, str]:
    """`keys init`, then a custodian that imports two agents and destroys the last
    `destroyed` of them (each kept as a grace copy), stopped again: their pubkeys."""
    from tests.custodian.test_refusals import ask

    assert _keys(config, "init").returncode == 0
    running = CustodianProcess(config, socket)
    running.start()
    try:
        agents = []
        for n in range(2):
            ok, record = ask(running.socket, "import", tail=f"{n + 1:064x}".encode(),
                             secret_bytes=64, owner=HUMAN, auth_tag=None)
            assert ok, record
            agents.append(str(record["pubkey"]))  # type: ignore[index]
        for pubkey in agents[2 - destroyed:]:
            assert ask(running.socket, "destroy", pubkey=pubkey)[0]
    finally:
        running.stop()
    return agents[0], agents[1]


@pytest.mark.token_offers("GENERATE_KEY")  # the migration makes its KEK in the target
async def test_migrate_refuses_while_a_destroyed_key_is_recoverable_unless_given_up(
        softhsm_token: SoftHsmToken, second_token: str, tmp_path: Path  # noqa: F811
) -> None:
    """`migrate` destroys the source token's KEK, which a grace copy is sealed under, as
    `rotate` does: it refuses the same way, changes nothing, and `--abandon-destroyed`
    gives the copy up, counted in its log line, while the live key moves and signs."""
    token = softhsm_token.config(kek_label=f"custmig-{tmp_path.name}"[:50])
    state = tmp_path / "state"
    config = write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state,
                                    socket=tmp_path / "c.sock", relay_url="ws://127.0.0.1:1")
    moved = dataclasses.replace(token, token_label=second_token)
    target = write_custodian_config(tmp_path / "target.toml", token=moved, state_dir=state,
                                    socket=tmp_path / "c.sock", relay_url="ws://127.0.0.1:1")
    live, destroyed = _two_agents(config, tmp_path / "c.sock", destroyed=1)
    log = state / "custodian" / "signed.jsonl"
    before = log.read_text()
    refused = _keys(config, "migrate", "--to-config", str(target))
    assert refused.returncode == 1, refused.stderr
    assert "1 destroyed key(s) can still be recovered" in refused.stderr, refused.stderr
    assert "--abandon-destroyed" in refused.stderr
    assert log.read_text() == before, "refused before anything changed"
    migrated = _keys(config, "migrate", "--to-config", str(target), "--abandon-destroyed")
    assert migrated.returncode == 0, migrated.stderr
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["op"] == "migrate" and last["abandoned"] == 1 and last["agents"] == 1
    assert last["new_token"] == second_token
    assert verify_chain(log) == len(log.read_text().splitlines())
    gone = _recover(target, destroyed)
    assert gone.returncode == 1 and "no sealed copy" in gone.stderr, gone.stderr
    async with await Custody.open(moved, state) as custody:  # the live key signs there
        signed = await custody.sign_event(live, UnsignedEvent(live, 1, 1, (), "moved"))
    assert verify_signed(signed)


@pytest.mark.token_offers("GENERATE_KEY")  # rotate makes its KEK
async def test_abandoned_copies_are_forgotten_before_the_rotation_line(
        softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    """The copies `--abandon-destroyed` gives up are sealed under the KEK the rotation has
    destroyed: forgotten before its outcome line, so a line the disk cannot take leaves no
    copy a later run would call recoverable (a review: forgotten after it, the next
    rotate refused, naming a `--recover` that could no longer open them)."""
    import errno

    from custody.custodian import keys as key_commands
    from custody.custodian.config import load
    from custody.custodian.ledger import SignLog

    token = softhsm_token.config(kek_label=f"custowed-{tmp_path.name}"[:50])
    config = write_custodian_config(tmp_path / "custodian.toml", token=token,
                                    state_dir=tmp_path / "state", socket=tmp_path / "c.sock",
                                    relay_url="ws://127.0.0.1:1")
    _, destroyed = _two_agents(config, tmp_path / "c.sock", destroyed=1)
    append = SignLog.append

    def full_for_the_outcome(self: SignLog, entries: list[dict[str, object]],
                             **kw: bool) -> int:
        if entries and entries[0]["op"] == "rotate":
            raise OSError(errno.ENOSPC, "No space left on device")
        return append(self, entries, **kw)

    SignLog.append = full_for_the_outcome  # type: ignore[method-assign]
    try:
        with pytest.raises(CustodyError, match="is done, and its intent line stands"):
            await key_commands.run(load(str(config)), ["rotate", "--abandon-destroyed"])
    finally:
        SignLog.append = append  # type: ignore[method-assign]
    again = _keys(config, "rotate")
    assert again.returncode == 0 and "can still be recovered" not in again.stderr, again.stderr
    gone = _recover(config, destroyed)
    assert gone.returncode == 1 and "no sealed copy" in gone.stderr, gone.stderr


def test_words_after_recovers_pubkey_are_a_usage_line_not_ignored(tmp_path: Path) -> None:
    """`custodian FILE --recover PUBKEY keys rotate` (two commands run together) is a
    usage error, exit 2, nothing run: never a recover that silently drops the rest."""
    config = tmp_path / "custodian.toml"
    config.write_text('[custodian]\nsocket = "s"\nstate_dir = "st"\nrelay_url = "ws://x"\n'
                      '[pkcs11]\nmodule = "/nonexistent.so"\ntoken_label = "t"\n')
    for extra in (["keys", "rotate"], ["extra"]):
        done = subprocess.run([sys.executable, "-m", "custody.custodian", str(config),
                               "--recover", "ab" * 32, *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "usage" in done.stderr, (extra, done.stderr)
        assert not (tmp_path / "st").exists()  # nothing read or made
