"""The pipeline writes the intent and the pending record at the same time (issue 9).

What that must not weaken (daemon/broker.py, module docstring):
- nothing reaches the relay unless the intent is audited AND the pending record committed;
- a pending record whose intent could not be audited is finished failed + internal, final:
  the identical retry replays that verdict and never publishes;
- a resumed request audits its intent again before re-sending, and when it cannot, it
  sends nothing and answers indeterminate (an earlier attempt may be on the relay), with
  the pending work kept for the next retry.

The audit faults are injected by wrapping the running broker's `AuditLog.append`: the
disk-full path itself is exercised in test_guardrails_e2e.py; here the point is the order
of the two concurrent writes, which a full disk cannot choose.
"""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.audit import AUDIT_DIRNAME, AuditRecord, AuditUnavailable, Phase, read_records, verify
from daemon.relay import Unknown
from tests.fixtures.broker import BrokerHarness, request_body
from tests.fixtures.relay import nostr_fetch


def _ledger_row(state_dir: Path, request_id: str) -> tuple[str, bytes | None]:
    conn = sqlite3.connect(state_dir / "ledger.db")
    try:
        row = conn.execute("SELECT state, pending FROM ledger WHERE request_id = ?",
                           (request_id,)).fetchone()
    finally:
        conn.close()
    assert row is not None, "the request left no ledger record"
    return str(row[0]), row[1]


def _intents(state_dir: Path, request_id: str) -> int:
    return sum(1 for line in read_records(state_dir / AUDIT_DIRNAME)
               if line.record is not None and line.record.request_id == request_id
               and line.record.phase is Phase.INTENT)


def _failing_intents(broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch,
                     *, delay: float) -> list[tuple[str, str | None]]:
    """Make every intent append fail after `delay` seconds; verdict records still pass.

    Returns the refusals: (requestId, the ledger state at the moment of the refusal).
    """
    audit = broker.app._audit
    real = audit.append
    refused: list[tuple[str, str | None]] = []

    async def append(record: AuditRecord) -> None:
        if record.phase is Phase.INTENT:
            await trio.sleep(delay)  # let the concurrent pending commit land first
            conn = sqlite3.connect(broker.state_dir / "ledger.db")
            try:
                row = conn.execute("SELECT state FROM ledger WHERE request_id = ?",
                                   (record.request_id,)).fetchone()
            finally:
                conn.close()
            refused.append((record.request_id, None if row is None else str(row[0])))
            raise AuditUnavailable("injected by the test")
        await real(record)

    monkeypatch.setattr(audit, "append", append)
    return refused


async def _on_relay(broker: BrokerHarness, channel: str) -> list[str]:
    events: list[dict[str, Any]] = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"kinds": [9], "#h": [channel]}])
    return sorted(str(e["content"]) for e in events)


async def test_failed_intent_after_pending_commit_is_final_internal_and_never_published(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch,
) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    refused = _failing_intents(broker, monkeypatch, delay=0.2)
    body = request_body("message.post", {"channelId": channel, "content": "never sent"})
    _, answer = await broker.post(body, cred)
    assert answer is not None
    assert (answer["status"], answer["error"]["code"]) == ("failed", "internal"), answer
    request_id = answer["requestId"]
    # The pending record had committed when the intent failed, and the verdict closed it.
    assert refused == [(request_id, "pending")]
    state, _pending = _ledger_row(broker.state_dir, request_id)
    assert state == "final"

    monkeypatch.undo()  # the audit log works again: the retry still must not publish
    _, again = await broker.post(body, cred)
    assert again == {**answer, "replayed": True}
    assert await _on_relay(broker, channel) == []
    assert verify(broker.state_dir / AUDIT_DIRNAME).ok


async def test_a_resumed_request_audits_its_intent_before_re_sending(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch,
) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    body = request_body("message.post", {"channelId": channel, "content": "resumed"})

    # 1. The relay never confirms: indeterminate, the pending work is kept.
    async def no_ok(pubkey: str, event: dict[str, Any]) -> Unknown:
        return Unknown(reason="injected: no OK")

    with monkeypatch.context() as patch:
        patch.setattr(broker.app._relay, "publish", no_ok)
        _, first = await broker.post(body, cred)
    assert first is not None and first["status"] == "indeterminate", first
    request_id = first["requestId"]
    assert _intents(broker.state_dir, request_id) == 1

    # 2. The retry cannot audit its intent: nothing is sent, indeterminate again, and the
    #    pending record stays (never a final failed + internal over possible effects).
    with monkeypatch.context() as patch:
        refused = _failing_intents(broker, patch, delay=0.0)
        _, second = await broker.post(body, cred)
    assert refused == [(request_id, "indeterminate")]
    assert second is not None
    assert (second["status"], second["error"]["code"]) == ("indeterminate", "outcome_unknown")
    state, pending = _ledger_row(broker.state_dir, request_id)
    assert state == "indeterminate" and pending is not None
    assert await _on_relay(broker, channel) == []

    # 3. The audit log is back: the retry audits a second intent, then sends the same event.
    _, third = await broker.post(body, cred)
    assert third is not None and third["status"] == "succeeded", third
    assert _intents(broker.state_dir, request_id) == 2
    assert await _on_relay(broker, channel) == ["resumed"]
    assert verify(broker.state_dir / AUDIT_DIRNAME).ok
