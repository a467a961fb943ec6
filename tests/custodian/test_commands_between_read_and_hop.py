"""A row never changes a key without its lines, whatever `--recover` or `--forget-destroyed`
(other processes, beside the custodian) commit between the row's read of a record and its
token hop (docs/custodian.md, "A change's lines").

A red-team review found three rows that answered "nothing to change" by calling custody's
changing method, trusting it to change nothing: the hop ran later, on what the command
had made of the record meanwhile. A destroy of a tombstone destroyed a key `--recover` had
just brought back (no lines, no fresh grace copy: the copy's grace still ran from the first
destroy, so the key could be lost for good); a mint of a used mint_ref minted a new key
with no line once `--forget-destroyed` had dropped the record. The reviewer hit both
through the socket by flooding the token worker; here the command's commit is put in the
window itself, by running the real command's own function where the row's read returns,
so each test shows it on every run. The third, an attach_auth of a key not held, asked
custody to be refused: two reads on the event loop, between which another process's
revive can land; it is now answered from the row's own read, `unknown_agent`. A mutation
review added the tests that hold each row's answer to its own read (a revive right after
the read the row answers from, for destroy and attach_auth).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
import coincurve

import pytest
from buzzwire.nostr import owner_tag_digest

from custody import Custody, TokenConfig, UnknownAgent
from custody._keystore import Keystore
from custody.custodian import messages
from custody.custodian.client import decode_reply
from custody.custodian.forget import forget_destroyed
from custody.custodian.verify import verify_chain
from custody.custodian.recover import kept_copy, revive_agent, revive_tombstone
from custody.custodian.server import Custodian, Settings
from tests.custodian.test_refusals import human
from tests.fixtures.custodian import write_custodian_config

REPO = Path(__file__).resolve().parents[2]


def _custodian(custody: Custody, tmp_path: Path) -> Custodian:
    return Custodian(custody, Settings(
        socket=tmp_path / "unused.sock", pipeline_uid=os.getuid(), relay_url="wss://r.example",
        log_path=tmp_path / "log" / "signed.jsonl"))


async def _ask(custodian: Custodian, op: str, **args: object) -> tuple[bool, Any]:
    frame = await custodian.answer(messages.Request(op, args))
    return decode_reply(frame[messages.HEADER.size:])


def _lines(custodian: Custodian) -> list[dict[str, Any]]:
    path = custodian.settings.log_path
    text = path.read_text()
    assert verify_chain(path) == len(text.splitlines())
    return [json.loads(line) for line in text.splitlines()]


async def _destroyed(custodian: Custodian, owner: str) -> tuple[str, bytes]:
    """A key minted for `owner` and destroyed through the row; its grace copy."""
    ok, made = await _ask(custodian, "mint", owner=owner, mint_ref=None)
    assert ok and (await _ask(custodian, "destroy", pubkey=made["pubkey"]))[0]
    copy = kept_copy(custodian.graveyard, made["pubkey"])
    assert copy is not None
    return made["pubkey"], copy


def _then(monkeypatch: pytest.MonkeyPatch, name: str, command: Callable[[], Any]) -> list[None]:
    """`Custody.<name>`, a read, runs `command` once right after its first call returns
    or raises: the other process's commit landing in that window (awaited if a read is)."""
    ran: list[None] = []
    original = getattr(Custody, name)

    async def async_read(self: Custody, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, *args, **kwargs)
        finally:
            if not ran:
                ran.append(None)
                await command()

    def read(self: Custody, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            if not ran:
                ran.append(None)
                command()

    monkeypatch.setattr(Custody, name, async_read if name == "sealed_copy" else read)
    return ran


async def test_a_destroy_of_a_tombstone_recovered_meanwhile_copies_and_logs_it(
        custody: Custody, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The destroy's copy read finds no live key; `--recover` lands before its answer: the
    key is live again, so the destroy is a destroy (intent, line, a fresh copy), never a
    tombstone made by the "destroyed already" answer."""
    custodian = _custodian(custody, tmp_path)
    agent, copy = await _destroyed(custodian, human())
    (held := custodian.graveyard.directory / f"{agent}.sealed").unlink()
    ran = _then(monkeypatch, "sealed_copy", lambda: revive_agent(custody, agent, copy))

    ok, answer = await _ask(custodian, "destroy", pubkey=agent)
    assert ran and ok and answer["deleted_at"] is not None
    destroys = [line for line in _lines(custodian)
                if line.get("for") == "destroy" or line["op"] == "destroy"]
    assert [line["op"] for line in destroys] == ["intent", "destroy"] * 2, destroys
    assert held.is_file(), "the second destroy kept no copy: the key is lost after the grace"
    custodian.log.close()


async def test_a_mint_of_a_used_mint_ref_forgotten_meanwhile_makes_no_key_without_a_line(
        custody: Custody, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mint's read finds the mint_ref's record; `--forget-destroyed` drops it before
    the answer: the answer is the record read, and no key is made (before: a new key, no
    intent, no line)."""
    custodian = _custodian(custody, tmp_path)
    owner = human()
    ok, first = await _ask(custodian, "mint", owner=owner, mint_ref="ref-1")
    assert (await _ask(custodian, "destroy", pubkey=first["pubkey"]))[0]
    state = custody._keystore.path.parent

    def forget() -> None:
        keystore = Keystore.open(state)
        try:
            assert len(forget_destroyed(keystore, 2**40)) == 1
        finally:
            keystore.close()

    ran = _then(monkeypatch, "minted", forget)
    ok, again = await _ask(custodian, "mint", owner=owner, mint_ref="ref-1")
    assert ran and ok and again["pubkey"] == first["pubkey"], again
    keys = {record.pubkey for record in custody.agents(include_deleted=True)}
    logged = {line["agent"] for line in _lines(custodian) if line["op"] == "mint"}
    assert keys <= logged, f"keys made with no line: {keys - logged}"
    custodian.log.close()


def _beside(custody_state: tuple[TokenConfig, Path], custodian: Custodian, tmp_path: Path,
            *command: str) -> Callable[[], subprocess.CompletedProcess[str]]:
    """The operator's real command (its own process) on the custodian's state and log."""
    token, state = custody_state
    config = write_custodian_config(
        tmp_path / "custodian.toml", token=token, state_dir=state, socket=custodian.settings.socket,
        relay_url=custodian.settings.relay_url,
        settings={"log_dir": str(custodian.settings.log_path.parent)})
    return lambda: subprocess.run([sys.executable, "-m", "custody.custodian", str(config),
                                   *command], capture_output=True, text=True, timeout=120,
                                  cwd=REPO, check=True)


async def test_a_mint_under_an_owner_recovered_meanwhile_says_the_owner_signed(
        custody: Custody, custody_state: tuple[TokenConfig, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The mint's read finds its owner destroyed; `--recover` of the owner lands before the
    hop, which then signs the new key's NIP-OA tag with the owner's key: the line says
    `signed_by`, from the record custody made (before: from the read, so not said)."""
    custodian = _custodian(custody, tmp_path)
    ok, made = await _ask(custodian, "mint", owner=human(), mint_ref=None)
    owner = made["pubkey"]
    assert (await _ask(custodian, "destroy", pubkey=owner))[0]
    ran = _then(monkeypatch, "agent", _beside(custody_state, custodian, tmp_path,
                                              "--recover", owner))
    ok, child = await _ask(custodian, "mint", owner=owner, mint_ref=None)
    assert ran and ok and child["auth_tag"] is not None, child
    [line] = [line for line in _lines(custodian) if line["op"] == "mint"
              and line["agent"] == child["pubkey"]]
    assert line.get("signed_by") == owner, line
    custodian.log.close()


async def test_a_recover_of_a_key_another_recovered_meanwhile_claims_no_recovery(
        custody: Custody, custody_state: tuple[TokenConfig, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two operators (or one re-running a command that seemed to hang): this `--recover`
    reads the key destroyed, the other's commits before this one's keystore write. One
    `recover` line, this run's intent closed `failed` (before: a second `recover` line, for
    a change this run did not make)."""
    from custody.custodian import recover as command

    custodian = _custodian(custody, tmp_path)
    ok, made = await _ask(custodian, "mint", owner=human(), mint_ref=None)
    agent = made["pubkey"]
    assert (await _ask(custodian, "destroy", pubkey=agent))[0]
    other = _beside(custody_state, custodian, tmp_path, "--recover", agent)
    ran = _then(monkeypatch, "agent", other)
    with pytest.raises(UnknownAgent):
        await command.recover(str(tmp_path / "custodian.toml"), agent)
    assert ran
    lines = [line for line in _lines(custodian) if line.get("agent") == agent
             or line["op"] == "failed"]
    assert [(line["op"], line.get("for")) for line in lines][-4:] == [
        ("intent", "recover"), ("recover", None), ("intent", "recover"), ("failed", None)], lines
    custodian.log.close()


def _revive_from_another_process(custody: Custody, agent: str, copy: bytes):
    """`--recover`'s commit as another process makes it: its own keystore connection, the
    grace copy (sealed under the same KEK) put back; synchronous, so it can land between
    two reads on the event loop that no await separates."""
    state = custody._keystore.path.parent

    def recover() -> None:
        keystore = Keystore.open(state)
        try:
            assert revive_tombstone(keystore, agent, copy, int(time.time())) is not None
        finally:
            keystore.close()

    return recover


async def test_a_destroy_answered_from_a_tombstone_read_never_destroys_the_key_revived_after_it(
        custody: Custody, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The destroy reads a tombstone (no live key, the record a destroyed one): its answer
    is that record. `--recover` commits right after that read: the key it brought back
    stays live, since the answer changed nothing (answered through custody's destroy
    instead, the key would be destroyed again with no line and no fresh grace copy)."""
    custodian = _custodian(custody, tmp_path)
    agent, copy = await _destroyed(custodian, human())
    # After the row's own read of the record (include_deleted), not the liveness check
    # inside custody's sealed_copy (which calls `agent` too: the case tested above).
    revive, ran, read = _revive_from_another_process(custody, agent, copy), [], Custody.agent

    def agent_then_revive(self: Custody, pubkey: str, *, include_deleted: bool = False):
        try:
            return read(self, pubkey, include_deleted=include_deleted)
        finally:
            if include_deleted and not ran:
                ran.append(None)
                revive()

    monkeypatch.setattr(Custody, "agent", agent_then_revive)
    ok, answer = await _ask(custodian, "destroy", pubkey=agent)
    assert ran and ok and answer["deleted_at"] is not None, answer  # the tombstone read
    monkeypatch.undo()
    assert custody.agent(agent) is not None, "the revived key was destroyed with no line"
    destroys = [line for line in _lines(custodian)
                if line.get("for") == "destroy" or line["op"] == "destroy"]
    assert [line["op"] for line in destroys] == ["intent", "destroy"], destroys
    custodian.log.close()


async def test_an_attach_auth_of_a_key_not_held_never_attaches_to_a_key_revived_after_its_read(
        custody: Custody, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """attach_auth reads no live key: `unknown_agent`, from that read. `--recover` commits
    right after it: the revived key gets no tag (asked of custody instead, it would be
    changed with no intent and no line)."""
    custodian = _custodian(custody, tmp_path)
    owner = coincurve.PrivateKey()
    owner_pubkey = owner.public_key_xonly.format().hex()
    agent, copy = await _destroyed(custodian, owner_pubkey)
    tag = ["auth", owner_pubkey, "", owner.sign_schnorr(owner_tag_digest(agent, "")).hex()]
    ran = _then(monkeypatch, "agent", _revive_from_another_process(custody, agent, copy))

    ok, answer = await _ask(custodian, "attach_auth", pubkey=agent, tag=tag)
    assert ran and not ok and answer[0] == "unknown_agent", answer
    monkeypatch.undo()
    revived = custody.agent(agent)
    assert revived is not None and revived.auth_tag is None, revived
    assert not [line for line in _lines(custodian) if line.get("for") == "attach_auth"
                or line["op"] == "attach_auth"]
    custodian.log.close()


async def test_while_a_line_is_owed_the_lookups_and_relay_answer_and_changes_are_refused(
        custody: Custody, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line owed (the log's disk failing): every LOOKUPS row still answers, `relay` (the
    daemon's start asks it) and `memory_address` among them, while a change is refused
    naming the log's fault."""
    custodian = _custodian(custody, tmp_path)
    ok, made = await _ask(custodian, "mint", owner=human(), mint_ref=None)
    agent = made["pubkey"]

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError):
        custodian.log.append([{"op": "destroy", "agent": "a" * 64, "intent": 0}], done=True)
    assert (await _ask(custodian, "relay")) == (True, "wss://r.example")
    ok, address = await _ask(custodian, "memory_address", agent=agent, slug="core")
    assert ok, address
    assert (await _ask(custodian, "chain", pubkey=agent))[0]
    assert (await _ask(custodian, "mint", owner=human(), mint_ref=None)) == (
        False, ("custody", "the custodian's log cannot be written: OSError EIO"))
    monkeypatch.undo()
    custodian.log.close()


async def test_a_mint_ref_used_for_another_owner_is_refused_not_answered_its_record(
        custody: Custody, tmp_path: Path) -> None:
    """The mint row answers a used mint_ref from its own read (`Custody.minted`): only for
    the owner it was used for. Another owner naming it is refused, and is never handed the
    first owner's agent (nor a key made, nor a line)."""
    custodian = _custodian(custody, tmp_path)
    first_owner, other_owner = human(), human()
    ok, first = await _ask(custodian, "mint", owner=first_owner, mint_ref="ref-1")
    assert ok
    before = _lines(custodian)
    ok, answer = await _ask(custodian, "mint", owner=other_owner, mint_ref="ref-1")
    assert not ok and answer[0] == "custody" and "another owner" in answer[1], answer
    assert _lines(custodian) == before
    assert [r.pubkey for r in custody.agents(include_deleted=True)] == [first["pubkey"]]
    custodian.log.close()
