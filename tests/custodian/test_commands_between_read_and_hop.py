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
so each test shows it on every run. (The third, an attach_auth of a key not held, calling
custody to be refused, had two reads on the event loop between which a revive could land:
it is now answered from the row's own read, `unknown_agent`, with no test that can put a
commit between two reads that no await separates.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from custody import Custody, TokenConfig, UnknownAgent
from custody._keystore import Keystore
from custody.custodian import messages
from custody.custodian.forget import forget_destroyed
from custody.custodian.ledger import verify_chain
from custody.custodian.recover import revive_agent
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
    return messages.decode_reply(frame[messages.HEADER.size:])


def _lines(custodian: Custodian) -> list[dict[str, Any]]:
    path = custodian.settings.log_path
    text = path.read_text()
    assert verify_chain(path) == len(text.splitlines())
    return [json.loads(line) for line in text.splitlines()]


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
    ok, made = await _ask(custodian, "mint", owner=human(), mint_ref=None)
    agent = made["pubkey"]
    assert (await _ask(custodian, "destroy", pubkey=agent))[0]
    copy = custodian.graveyard.take(agent)
    assert copy is not None
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
