"""`--recover` beside a custodian that may be told to destroy the key again, and within an
interrupted rotation (a review's two ways to lose a key the docs said could come back).

- A destroy the running custodian answers while `--recover` runs keeps its own copy, which
  `--recover` no longer deletes afterwards: the key can come back again.
- A key recovered while a rotation is interrupted after its swap is sealed again under the
  active KEK, so the rotation's rerun, which destroys the retiring KEK, leaves it usable.

And its lines in the custodian's log, written beside the serving custodian's own in one
chain: its intent and `recover` (or `failed`), none for a run that asks nothing, and the
intent alone when it is killed between them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from buzzwire.nostr import verify_signed
from custody import Custody, CustodyError, UnknownAgent, UnsignedEvent, init_kek
from custody._keys import rotate_keys
from custody.custodian import changes
from custody.custodian import recover as command
from custody.custodian.client import CustodianClient
from custody.custodian.ledger import SignLog
from custody.custodian.verify import verify_chain
from custody.custodian.main import EXIT_USAGE
from tests.custodian.test_refusals import ask, held, human, intent
from tests.custody._sealing import HUMAN
from tests.fixtures.custodian import CustodianProcess
from tests.fixtures.token import SoftHsmToken

REPO = Path(__file__).resolve().parents[2]


def _recover(config: Path, pubkey: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "custody.custodian", str(config), "--recover",
                           pubkey], capture_output=True, text=True, timeout=120)


async def _one_destroyed(custodian: CustodianProcess) -> str:
    """A new agent's pubkey, its key destroyed through the custodian (a copy kept)."""
    client = await CustodianClient.open(custodian.socket)
    agent = await held(client, human())
    await client.aclose()
    assert ask(custodian.socket, "destroy", pubkey=agent)[0]
    return agent


async def test_a_destroy_answered_while_recover_runs_keeps_its_copy(
        custodian: CustodianProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = await _one_destroyed(custodian)
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


def _log(custodian: CustodianProcess) -> list[dict[str, Any]]:
    """The custodian's log, checked end to end by the chain's own verifier."""
    path = custodian.config.parent / "state" / "custodian" / "signed.jsonl"
    text = path.read_text()
    assert verify_chain(path) == len(text.splitlines())
    return [json.loads(line) for line in text.splitlines()]


def _signs(socket: Path, agent: str, seconds: float = 10.0) -> None:
    """`agent` signs once the custodian sees it held (within its records' recheck)."""
    deadline = time.monotonic() + seconds
    while not (answer := ask(socket, "sign", events=[intent(agent, 9, [["h", "c"]], "x")]))[0]:
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)


async def test_recovers_beside_a_serving_custodian_are_in_its_log_and_its_chain_goes_on(
        custodian: CustodianProcess) -> None:
    """Three `--recover` runs while the custodian signs for another agent as fast as it is
    asked: each has its intent and its `recover` line naming the agent, the custodian's
    lines go on between and after them, and the whole log verifies. (A review: `--recover`
    wrote no line, so a security engineer reading the log never saw a destroyed key come
    back; it could not append beside the serving custodian without forking the chain.)"""
    client = await CustodianClient.open(custodian.socket)
    busy = await held(client, human())
    agents = [await held(client, human()) for _ in range(3)]
    await client.aclose()
    for agent in agents:
        assert ask(custodian.socket, "destroy", pubkey=agent)[0]
    stop, answers = threading.Event(), []

    def signing() -> None:
        while not stop.is_set():
            answers.append(ask(custodian.socket, "sign", events=[intent(busy, 9, [["h", "c"]])]))

    signer = threading.Thread(target=signing)
    signer.start()
    try:
        for agent in agents:
            done = _recover(custodian.config, agent)
            assert done.returncode == 0, done.stderr
    finally:
        stop.set()
        signer.join(60)
    for agent in agents:
        _signs(custodian.socket, agent)
    custodian.stop()
    lines = _log(custodian)
    assert answers and all(ok for ok, _ in answers), [a for a in answers if not a[0]][:3]
    for agent in agents:
        began, back = [e for e in lines if e.get("agent") == agent and (
            e.get("for") == "recover" or e["op"] == "recover")]
        assert (began["op"], began["for"], back["op"], back["intent"]) == (
            "intent", "recover", "recover", began["seq"])
        assert lines[-1]["seq"] > back["seq"]  # the custodian's lines go on after it
    first = min(e["seq"] for e in lines if e.get("for") == "recover")
    assert any(e["op"] == "sign" and e["agent"] == busy and e["seq"] > first for e in lines)


async def test_a_recover_that_asks_nothing_writes_nothing_and_one_that_fails_writes_failed(
        custodian: CustodianProcess) -> None:
    """No copy within the grace period: refused before custody is opened, no line. A copy
    that does not open as that agent (here another destroyed agent's, under its name):
    its intent, then `failed` naming `UnsealFailed`, and the key stays destroyed."""
    client = await CustodianClient.open(custodian.socket)
    agent, other = await held(client, human()), await held(client, human())
    never = human()
    await client.aclose()
    for pubkey in (agent, other):
        assert ask(custodian.socket, "destroy", pubkey=pubkey)[0]
    before = _log(custodian)
    done = _recover(custodian.config, never)
    assert done.returncode == 1 and "no sealed copy" in done.stderr, done.stderr
    # A key with no copy here may be a secret pasted by mistake, and a path must not reach
    # the copies' directory: neither is said, nor looked up (a review: it was echoed).
    assert never not in done.stderr
    for pasted in ("nsec1" + "q" * 58, "../../" + "a" * 58, agent.upper()):
        refused = _recover(custodian.config, pasted)
        # A malformed argument: a usage error, one line (before, exit 1 as a fault).
        assert refused.returncode == EXIT_USAGE and pasted not in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1 and "not a pubkey" in refused.stderr
    assert _log(custodian) == before
    copies = custodian.config.parent / "state" / "custodian" / "destroyed"
    (copies / f"{agent}.sealed").write_bytes((copies / f"{other}.sealed").read_bytes())
    done = _recover(custodian.config, agent)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    began, failed = _log(custodian)[len(before):]
    assert (began["op"], began["for"], began["agent"]) == ("intent", "recover", agent)
    assert failed == {**failed, "op": "failed", "intent": began["seq"],
                      "fault": "UnsealFailed"}
    ok, record = ask(custodian.socket, "agent", pubkey=agent, include_deleted=True)
    assert ok and isinstance(record, dict) and record["deleted_at"] is not None


@pytest.mark.parametrize("point", ["intent", "changed"])
async def test_a_recover_killed_between_its_intent_and_its_outcome_keeps_its_intent(
        custodian: CustodianProcess, point: str) -> None:
    """SIGKILLed once its intent is on disk (nothing asked yet) or once the keystore took
    the key back (its outcome not written): the intent stands without an outcome, the
    custodian goes on signing after it, and a rerun recovers the key under an intent of its
    own (killed before the change) or finds it held and writes nothing (after)."""
    client = await CustodianClient.open(custodian.socket)
    agent, busy = await held(client, human()), await held(client, human())
    await client.aclose()
    assert ask(custodian.socket, "destroy", pubkey=agent)[0]
    killed = subprocess.run(
        [sys.executable, "-m", "tests.custodian.crashing_custodian", str(custodian.config),
         f"recover:{point}", "--recover", agent], capture_output=True, text=True, timeout=120,
        cwd=REPO)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert f"custodian.kill step=recover:{point}" in killed.stderr
    _signs(custodian.socket, busy)
    rerun = _recover(custodian.config, agent)
    assert rerun.returncode == (0 if point == "intent" else 1), rerun.stderr
    _signs(custodian.socket, agent)
    custodian.stop()
    lines = _log(custodian)
    intents = [e for e in lines if e.get("for") == "recover"]
    outcomes = {e["intent"]: e["op"] for e in lines if "intent" in e}
    assert intents[0]["agent"] == agent and intents[0]["seq"] not in outcomes  # before: none
    assert [outcomes[e["seq"]] for e in intents[1:]] == (["recover"] if point == "intent"
                                                          else [])
    assert any(e["op"] == "sign" and e["agent"] == busy and e["seq"] > intents[0]["seq"]
               for e in lines)


def _sync_fails_from(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """os.fdatasync fails (EIO) from its `call`-th call on: the disk going bad mid-command."""
    real, calls = os.fdatasync, [0]

    def fdatasync(fd: int) -> None:
        calls[0] += 1
        if calls[0] >= call:
            raise OSError(errno.EIO, "injected")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)


@pytest.mark.token_independent
@pytest.mark.parametrize("outcome", ["made", "raised"])
async def test_a_commands_outcome_line_the_disk_refuses_is_owed_then_said_at_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        outcome: str) -> None:
    """The intent is on disk; the change is made (or raised); the disk then refuses the
    outcome (or `failed`) line. That line is owed, so the log's close says it on stderr,
    and a change that raised is reported as its own fault, not the log's."""
    log = SignLog(tmp_path / "signed.jsonl", 1 << 20)
    _sync_fails_from(monkeypatch, 2)

    async def change() -> str:
        if outcome == "raised":
            raise UnknownAgent("c" * 64)
        return "done"

    expected = CustodyError if outcome == "made" else UnknownAgent
    with pytest.raises(expected) as raised:
        await changes.logged_change(log, {"for": "recover", "agent": "c" * 64}, change,
                                    lambda result, seq: [{"op": "recover", "agent": "c" * 64,
                                                          "intent": seq}])
    assert type(raised.value) is expected
    with caplog.at_level(logging.ERROR, logger="buzz_broker.custodian"):
        log.close()
    said = [r.getMessage() for r in caplog.records if "a line owed, never written" in r.getMessage()]
    op = '"op": "recover"' if outcome == "made" else '"op": "failed"'
    assert len(said) == 1 and op in said[0], said
    assert verify_chain(tmp_path / "signed.jsonl") == 1  # the intent alone


@pytest.mark.token_independent
def test_a_log_a_command_cannot_open_is_one_line_saying_what_it_left_done(tmp_path: Path) -> None:
    """The log's directory cannot be made (a file where it would be): one CustodyError
    naming the fault and what the command leaves done, no traceback."""
    (tmp_path / "log").write_text("a file, not a directory")
    config = SimpleNamespace(settings=SimpleNamespace(log_path=tmp_path / "log" / "signed.jsonl",
                                                      log_max_bytes=1 << 20))
    with pytest.raises(CustodyError, match=r"cannot be written \(.*\): nothing was recovered"):
        changes.open_log(config, "nothing was recovered")  # type: ignore[arg-type]


async def test_a_recover_whose_outcome_line_the_disk_refuses_says_it_on_stderr(
        custodian: CustodianProcess, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The key is back; the disk refuses the `recover` line. The command fails in one line
    saying the change stands, and closes its log, which says the owed line (the journal is
    then the only record of it)."""
    agent = await _one_destroyed(custodian)
    revive = command.revive_agent

    async def revived_then_the_disk_fails(custody: Custody, pubkey: str, blob: bytes) -> object:
        record = await revive(custody, pubkey, blob)
        _sync_fails_from(monkeypatch, 1)
        return record

    monkeypatch.setattr(command, "revive_agent", revived_then_the_disk_fails)
    with caplog.at_level(logging.ERROR, logger="buzz_broker.custodian"):
        with pytest.raises(CustodyError, match="the change is made"):
            await command.recover(str(custodian.config), agent)
    monkeypatch.undo()
    said = [r.getMessage() for r in caplog.records if "a line owed, never written" in r.getMessage()]
    assert len(said) == 1 and '"op": "recover"' in said[0] and agent in said[0], said
