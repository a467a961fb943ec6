"""`custodian FILE --forget-destroyed` (custody/custodian/forget.py): a long-lived host's
way back under `[custodian] max_records`, which counts destroyed records.

Against a running custodian: records destroyed past the grace period go, unless a kept
record names them as owner (a chain of them goes leaves first); a record destroyed within
the grace period stays; the running custodian's answers and its bound see the change; and
what forgetting gives up (the key is no longer refused as a destroyed one) is shown. Each
run is in the custodian's log (its intent, a line per record forgotten, the count), and
the custodian's own lines go on after it in one chain.

Named (`--forget-destroyed PUBKEY ...`), the way back from a compromised pipeline's mints
that filled `max_records`: exactly the named destroyed records go at once, within their
grace period, with their sealed copies; a legitimate key's copy stays; a mint then
succeeds. A live, unknown, malformed or still-owning key named is said, and nothing is
forgotten, no line written.
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import coincurve
import pytest

from custody import Custody, CustodyError, TokenConfig
from custody._keystore import Keystore
from custody._statelock import StateLock
from custody.custodian import forget as command
from custody.custodian.client import CustodianClient
from custody.custodian.forget import MAX_NAMED, NotForgotten, forget_destroyed, forget_named
from custody.custodian.grace import Graveyard
from custody.custodian.main import EXIT_USAGE
from custody.custodian.verify import verify_chain
from tests.custodian.test_refusals import ask, human, intent
from tests.custody._sealing import HUMAN
from tests.fixtures.custodian import running_custodian, write_custodian_config

REPO = Path(__file__).resolve().parents[2]
#: Long enough that a destroy made just before the command is surely within it (records
#: carry whole seconds), short enough to wait out once.
GRACE = 3
#: The first test's grace: its key destroyed last must still be within it at the
#: second run, two command starts later, which a loaded machine took past 3 s.
LONG_GRACE = 6


def _forget(config: Path, *named: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", "custodian", str(config),
                           "--forget-destroyed", *named], capture_output=True, text=True,
                          timeout=60)


def _listed(socket: Path) -> dict[str, bool]:
    ok, records = ask(socket, "agents", include_deleted=True)
    assert ok and isinstance(records, list)
    return {r["pubkey"]: r["deleted_at"] is None for r in records}


async def test_forget_destroyed_drops_what_no_kept_record_needs(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with running_custodian(custody_state, local_relay, tmp_path,
                           settings={"destroy_grace_seconds": LONG_GRACE, "log_dir": str(log_dir),
                                     "max_records": 6}) as process:
        client = await CustodianClient.open(process.socket)
        alone_secret = coincurve.PrivateKey()
        alone = (await client.import_agent(
            bytearray(alone_secret.secret.hex().encode()), owner=human())).pubkey
        parent = (await client.mint_agent(owner=human())).pubkey
        child = (await client.mint_agent(owner=parent)).pubkey  # lives on: parent stays
        top = (await client.mint_agent(owner=human())).pubkey
        below = (await client.mint_agent(owner=top)).pubkey  # a chain of two, both destroyed
        for pubkey in (alone, parent, below, top):
            await client.destroy_agent(pubkey)
        ok, refusal = _import(process.socket, alone_secret)  # known here as destroyed
        assert not ok and "cannot be imported again" in str(refusal)
        time.sleep(LONG_GRACE + 1.5)
        recent = (await client.mint_agent(owner=human())).pubkey
        await client.destroy_agent(recent)  # within its grace when the command runs
        assert len(_listed(process.socket)) == 6
        assert not (await _mint_ok(process.socket))  # at max_records

        done = _forget(process.config)
        assert done.returncode == 0, done.stderr
        assert "forgot 3 records" in done.stdout
        # In the custodian's log, beside the lines it writes: before, none at all.
        began, *gone, counted = _lines(log_dir)[-5:]
        assert (began["op"], began["for"], counted["op"], counted["agents"]) == (
            "intent", "forget", "forget", 3)
        assert counted["intent"] == began["seq"] and began["before"] <= time.time() - LONG_GRACE
        assert sorted(e["agent"] for e in gone) == sorted([alone, top, below])

        assert _listed(process.socket) == {parent: False, child: True, recent: False}
        assert sorted(p.name for p in log_dir.glob("**/*.sealed")) == [f"{recent}.sealed"]
        assert await _mint_ok(process.socket)  # back under the bound (5 records now)
        # What it gives up: the key is no longer known here as destroyed, so an import of
        # it is taken again.
        assert _import(process.socket, alone_secret)[0]
        assert _listed(process.socket)[alone]
        # Run again, nothing more goes: the rest are kept or within their grace.
        assert "forgot 0 records" in _forget(process.config).stdout
        assert await _mint_ok(process.socket)  # the custodian's lines go on after it
        await client.aclose()
    *_, began, counted, intent, minted = _lines(log_dir)
    assert (began["for"], counted["agents"], counted["intent"]) == ("forget", 0, began["seq"])
    assert (intent["for"], minted["op"], minted["intent"]) == ("mint", "mint", intent["seq"])


@pytest.mark.parametrize("point", ["intent", "changed"])
async def test_a_forget_killed_between_its_intent_and_its_outcome_keeps_its_intent(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
        point: str) -> None:
    """SIGKILLed once its intent is on disk (nothing forgotten yet) or once the keystore's
    transaction committed (its lines not written): the intent stands without an outcome,
    the keystore says which (the records still there, or gone), the custodian goes on
    signing after it, and a rerun forgets them under an intent of its own (killed before)
    or finds none left and writes its count of 0 (after): no line claims them twice."""
    log_dir = tmp_path / "log"
    with running_custodian(custody_state, local_relay, tmp_path,
                           settings={"destroy_grace_seconds": GRACE,
                                     "log_dir": str(log_dir)}) as process:
        client = await CustodianClient.open(process.socket)
        gone = [(await client.mint_agent(owner=human())).pubkey for _ in range(2)]
        busy = (await client.mint_agent(owner=human())).pubkey
        for pubkey in gone:
            await client.destroy_agent(pubkey)
        await client.aclose()
        time.sleep(GRACE + 1.5)
        killed = subprocess.run(
            [sys.executable, "-m", "tests.custodian.crashing_custodian", str(process.config),
             f"forget:{point}", "--forget-destroyed"], capture_output=True, text=True,
            timeout=60, cwd=REPO)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert f"custodian.kill step=forget:{point}" in killed.stderr
        held = _listed(process.socket)
        assert [p in held for p in gone] == [point == "intent"] * 2  # the keystore says
        assert ask(process.socket, "sign", events=[intent(busy, 9, [["h", "c"]], "x")])[0]
        rerun = _forget(process.config)
        assert rerun.returncode == 0, rerun.stderr
        assert f"forgot {2 if point == 'intent' else 0} records" in rerun.stdout
        assert not set(gone) & set(_listed(process.socket))
    lines = _lines(log_dir)
    intents = [e for e in lines if e.get("for") == "forget"]
    outcomes = {e["intent"]: e for e in lines if "intent" in e}
    assert intents[0]["seq"] not in outcomes  # the killed run's: its intent alone
    assert [outcomes[e["seq"]]["agents"] for e in intents[1:]] == [
        2 if point == "intent" else 0]
    assert sorted(e["agent"] for e in lines if e["op"] == "forget" and "agent" in e) == (
        sorted(gone) if point == "intent" else [])
    assert any(e["op"] == "sign" and e["agent"] == busy and e["seq"] > intents[0]["seq"]
               for e in lines)


def _lines(log_dir: Path) -> list[dict[str, Any]]:
    """The custodian's log, its whole chain checked by the log's own verifier."""
    path = log_dir / "signed.jsonl"
    text = path.read_text()
    assert verify_chain(path) == len(text.splitlines())
    return [json.loads(line) for line in text.splitlines()]


async def _mint_ok(socket: Path) -> bool:
    ok, _ = ask(socket, "mint", owner=human(), mint_ref=None)
    return ok


def _import(socket: Path, secret: coincurve.PrivateKey) -> tuple[bool, object]:
    text = secret.secret.hex().encode()
    return ask(socket, "import", tail=text, secret_bytes=len(text), owner=human(),
               auth_tag=None)


def test_a_host_with_no_keystore_is_told_so_and_left_as_it_was(tmp_path: Path) -> None:
    config = tmp_path / "custodian.toml"
    config.write_text(
        f'[custodian]\nsocket = "{tmp_path}/s.sock"\nstate_dir = "{tmp_path}/state"\n'
        'relay_url = "ws://127.0.0.1:1"\n[pkcs11]\nmodule = "/nonexistent.so"\n'
        f'token_label = "t"\npin_file = "{tmp_path}/pin"\nkek_label = "k"\n')
    done = _forget(config)
    assert done.returncode == 1 and "no keystore in" in done.stderr
    assert "Traceback" not in done.stderr and sorted(p.name for p in tmp_path.iterdir()) == [
        "custodian.toml"]


#: The bound the intruder fills: a legitimate live key and a legitimately destroyed one, and
#: three mints of its own (one owning another).
SMALL_BOUND = 5


async def test_an_intruders_mints_named_are_forgotten_now_and_a_mint_succeeds(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with running_custodian(custody_state, local_relay, tmp_path,
                           settings={"log_dir": str(log_dir), "max_records": SMALL_BOUND}
                           ) as process:
        client = await CustodianClient.open(process.socket)
        kept = (await client.mint_agent(owner=human())).pubkey
        mistake = (await client.mint_agent(owner=human())).pubkey
        await client.destroy_agent(mistake)  # the operator's own: its grace copy must stay
        # The compromised pipeline's: mints up to the bound, one under another of its own.
        first = (await client.mint_agent(owner=human())).pubkey
        under = (await client.mint_agent(owner=first)).pubkey
        last = (await client.mint_agent(owner=human())).pubkey
        assert not await _mint_ok(process.socket)  # at max_records: agents.create refused
        for pubkey in (under, first, last):  # the operator destroys the intruder's agents
            await client.destroy_agent(pubkey)
        assert not await _mint_ok(process.socket)  # tombstones count
        # ... and the refusal says the way out this test takes.
        full = ask(process.socket, "mint", owner=human(), mint_ref=None)
        assert "--forget-destroyed` (past their grace; naming keys, those now)" in str(full), full
        # Unnamed, nothing goes: every tombstone is within its grace period.
        assert "forgot 0 records" in _forget(process.config).stdout
        assert not await _mint_ok(process.socket)
        lines_before = len(_lines(log_dir))

        done = _forget(process.config, first, under, last)
        assert done.returncode == 0, done.stderr
        assert "forgot 3 records named" in done.stdout
        assert _listed(process.socket) == {kept: True, mistake: False}
        assert sorted(p.name for p in log_dir.glob("**/*.sealed")) == [f"{mistake}.sealed"]
        began, *gone, counted = _lines(log_dir)[lines_before:]  # the chain verifies whole
        assert (began["op"], began["for"], began["named"]) == (
            "intent", "forget", sorted([first, under, last]))  # which may go, ahead
        assert "before" not in began
        assert sorted(e["agent"] for e in gone) == sorted([first, under, last])
        assert (counted["op"], counted["agents"], counted["intent"]) == (
            "forget", 3, began["seq"])
        assert await _mint_ok(process.socket)  # back under the bound, at once
        # The operator's own destroyed key is still recoverable: its copy was not touched.
        back = subprocess.run([sys.executable, "-m", "daemon.cli", "custodian",
                               str(process.config), "--recover", mistake],
                              capture_output=True, text=True, timeout=60)
        assert back.returncode == 0, back.stderr
        assert _listed(process.socket)[mistake]
        await client.aclose()
    _lines(log_dir)  # the custodian's lines go on after the command's, one chain


async def test_a_named_key_that_cannot_be_forgotten_is_said_and_nothing_changes(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with running_custodian(custody_state, local_relay, tmp_path,
                           settings={"log_dir": str(log_dir)}) as process:
        client = await CustodianClient.open(process.socket)
        live = (await client.mint_agent(owner=human())).pubkey
        owner = (await client.mint_agent(owner=human())).pubkey
        child = (await client.mint_agent(owner=owner)).pubkey  # lives on: owner is needed
        gone = (await client.mint_agent(owner=human())).pubkey
        for pubkey in (owner, gone):
            await client.destroy_agent(pubkey)
        await client.aclose()
        unknown = coincurve.PrivateKey().public_key_xonly.format().hex()
        records, log, copies = (_listed(process.socket), (log_dir / "signed.jsonl").read_bytes(),
                                sorted(log_dir.glob("**/*.sealed")))
        assert len(copies) == 2

        for named, said in (([gone, live], {live: "a live key"}),
                            # by its place: a key unknown here may be a secret pasted
                            ([gone, unknown], {"key 2 named (not shown)":
                                               "no record of this key here"}),
                            ([gone, owner, live], {owner: "names it as owner",
                                                   live: "a live key"})):
            refused = _forget(process.config, *named)
            assert refused.returncode == 1 and "Traceback" not in refused.stderr
            for pubkey, why in said.items():  # each that cannot go, one line each
                assert any(line.startswith(f"custodian: {pubkey}: not forgotten: ")
                           and why in line for line in refused.stderr.splitlines()), (
                    refused.stderr)
            assert gone not in refused.stderr and unknown not in refused.stderr
            assert "nothing was forgotten" in refused.stderr.splitlines()[-1]
            assert len(refused.stderr.splitlines()) == len(said) + 1
            assert (_listed(process.socket), (log_dir / "signed.jsonl").read_bytes(),
                    sorted(log_dir.glob("**/*.sealed"))) == (records, log, copies)
        # Not a pubkey (a secret key pasted by mistake is 64 hex too, but this is not even
        # that): refused before anything, and never echoed.
        pasted = "nsec1" + "q" * 58
        malformed = _forget(process.config, gone, pasted)
        # A malformed argument: a usage error, one line (before, exit 1 as a fault).
        assert malformed.returncode == EXIT_USAGE and pasted not in malformed.stderr
        assert malformed.stderr.count("\n") == 1, malformed.stderr
        assert "key 2 named is not a pubkey" in malformed.stderr
        too_many = _forget(process.config, *(f"{n:064x}" for n in range(MAX_NAMED + 1)))
        assert too_many.returncode == 1 and f"at most {MAX_NAMED} keys" in too_many.stderr
        assert _listed(process.socket) == records
        assert (log_dir / "signed.jsonl").read_bytes() == log
        assert child in records


async def test_a_named_forget_whose_copy_cannot_be_deleted_stands_and_says_so(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The records went in their transaction; a grace copy the disk then refuses to delete
    is said on stderr, after the forget's lines, which say what was done (a mutation
    review: `failed` was written for a forget that stood, and the command ended in a
    traceback)."""
    with running_custodian(custody_state, "wss://r.example", tmp_path) as process:
        ok, made = ask(process.socket, "mint", owner=human(), mint_ref=None)
        agent = made["pubkey"]  # type: ignore[index]
        assert ok and ask(process.socket, "destroy", pubkey=agent)[0]

        def refused(graveyard: Graveyard, pubkey: str) -> None:
            raise PermissionError(errno.EACCES, "refused", pubkey)

        monkeypatch.setattr(command, "forget_copy", refused)
        await command.forget(str(process.config), [agent])
        said = capsys.readouterr()
        log = tmp_path / "state" / "custodian" / "signed.jsonl"
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert [(e["op"], e.get("agent"), e.get("agents")) for e in lines[-2:]] == [
            ("forget", agent, None), ("forget", None, 1)], lines[-3:]
        assert verify_chain(log) == len(lines)
        assert f"{agent}: its sealed copy stays (PermissionError EACCES)" in said.err, said
        assert ask(process.socket, "agent", pubkey=agent, include_deleted=True) == (True, None)


async def _one_live_one_destroyed(custody_state: tuple[TokenConfig, Path]) -> tuple[str, str]:
    """(live, destroyed): two imported keys, the second destroyed (no grace copy kept:
    custody's own destroy, not the custodian's)."""
    token, state = custody_state
    async with await Custody.open(token, state) as custody:
        live = (await custody.import_agent(bytearray(b"a5".rjust(64, b"0")), owner=HUMAN)).pubkey
        gone = (await custody.import_agent(bytearray(b"b6".rjust(64, b"0")), owner=HUMAN)).pubkey
        await custody.destroy_agent(gone)
    return live, gone


async def test_a_named_key_that_cannot_go_inside_the_transaction_keeps_every_named_one(
        custody_state: tuple[TokenConfig, Path]) -> None:
    """All or none is held again inside the transaction (the running custodian may change a
    record between the look and the change): a live key named beside a destroyed one
    refuses the run, and the destroyed one's record stays too."""
    live, gone = await _one_live_one_destroyed(custody_state)
    keystore = Keystore.open(custody_state[1])
    try:
        with pytest.raises(NotForgotten) as refused:
            forget_named(keystore, [gone, live])  # commit=True: the transaction's own look
        assert refused.value.stays == {live: "live"}
        assert keystore.get(gone) is not None, "a refused named run forgot a record"
    finally:
        keystore.close()


async def test_forget_destroyed_takes_a_record_destroyed_at_the_bound_itself(
        custody_state: tuple[TokenConfig, Path]) -> None:
    """`destroyed_before` is "at or before" (forget.py): a record destroyed in that very
    second goes, one destroyed a second later stays."""
    _, gone = await _one_live_one_destroyed(custody_state)
    keystore = Keystore.open(custody_state[1])
    try:
        record = keystore.get(gone)
        assert record is not None and record.deleted_at is not None
        assert forget_destroyed(keystore, record.deleted_at - 1) == []
        assert forget_destroyed(keystore, record.deleted_at) == [gone]
    finally:
        keystore.close()


def _config(custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> Path:
    token, state = custody_state
    return write_custodian_config(tmp_path / "custodian.toml", token=token, state_dir=state,
                                  socket=tmp_path / "custodian.sock", relay_url="wss://r.example")


async def test_a_forget_during_a_rotation_is_refused_and_forgets_nothing(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path) -> None:
    """`keys rotate` holds custody's state lock exclusively; a forget beside it (its own
    process, the custodian stopped) must refuse, not change the keystore under it."""
    _, gone = await _one_live_one_destroyed(custody_state)
    config = _config(custody_state, tmp_path)
    rotation = StateLock.exclusive(custody_state[1])  # a rotation, as far as forget can tell
    try:
        with pytest.raises(CustodyError, match="rotation or migration is running"):
            await command.forget(str(config), [gone])
    finally:
        rotation.release()
    keystore = Keystore.open(custody_state[1])
    try:
        assert keystore.get(gone) is not None
    finally:
        keystore.close()


async def test_a_named_key_with_no_copy_left_is_forgotten_without_a_word_about_its_copy(
        custody_state: tuple[TokenConfig, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A destroyed key whose grace copy is already gone (purged, or never kept) is forgotten
    quietly: no stderr line claims its sealed copy stays."""
    _, gone = await _one_live_one_destroyed(custody_state)
    await command.forget(str(_config(custody_state, tmp_path)), [gone])
    said = capsys.readouterr()
    assert "forgot 1 records named" in said.out, said
    assert "sealed copy stays" not in said.err, said.err
