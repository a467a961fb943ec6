"""The intent is audited before the pending record exists, and a failed intent is final.

Issue 9 measured writing the two concurrently: it saved a hop at low load and cost
throughput at 64 in flight, so the pipeline keeps them in order (docs/performance.md).
Pinned here:
- when the intent append fails, no pending record has been written yet;
- the request is finished failed + internal, final: the identical retry replays that
  verdict and never publishes.

The audit faults are injected by wrapping the running broker's `AuditLog.append`: the
disk-full path itself is exercised in test_guardrails_e2e.py; here the point is the order
of the writes, which a full disk cannot choose.
"""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.state.audit import AUDIT_DIRNAME, AuditRecord, AuditUnavailable, Entry, Phase, verify
from daemon.state.ledger import request_key
from tests.fixtures.broker import BrokerHarness, request_body
from tests.fixtures.relay import nostr_fetch


def _ledger_row(state_dir: Path, request_id: str) -> tuple[str, bytes | None]:
    conn = sqlite3.connect(state_dir / "ledger.db")
    try:
        row = conn.execute("SELECT state, pending FROM entries WHERE rid = ?",
                           (request_key(request_id),)).fetchone()
    finally:
        conn.close()
    assert row is not None, "the request left no ledger record"
    return str(row[0]), row[1]


def _failing_intents(broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch,
                     *, delay: float) -> list[tuple[str, str | None]]:
    """Make every intent append fail after `delay` seconds; verdict records still pass.

    Returns the refusals: (requestId, the ledger state at the moment of the refusal).
    """
    audit = broker.app._audit
    real = audit.append
    refused: list[tuple[str, str | None]] = []

    async def append(record: Entry) -> None:
        if isinstance(record, AuditRecord) and record.phase is Phase.INTENT:
            await trio.sleep(delay)  # let the concurrent pending commit land first
            conn = sqlite3.connect(broker.state_dir / "ledger.db")
            try:
                row = conn.execute("SELECT state FROM entries WHERE rid = ?",
                                   (request_key(record.request_id),)).fetchone()
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


async def test_failed_intent_comes_before_any_pending_record_and_is_final(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch,
) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    refused = _failing_intents(broker, monkeypatch, delay=0.05)
    body = request_body("message.post", {"channelId": channel, "content": "never sent"})
    _, answer = await broker.post(body, cred)
    assert answer is not None
    assert (answer["status"], answer["error"]["code"]) == ("failed", "internal"), answer
    request_id = answer["requestId"]
    # Nothing was durable in the ledger when the intent failed; the verdict is final.
    assert refused == [(request_id, None)]
    state, _pending = _ledger_row(broker.state_dir, request_id)
    assert state == "final"

    monkeypatch.undo()  # the audit log works again: the retry still must not publish
    _, again = await broker.post(body, cred)
    assert again == {**answer, "replayed": True}
    assert await _on_relay(broker, channel) == []
    assert verify(broker.state_dir / AUDIT_DIRNAME).ok
