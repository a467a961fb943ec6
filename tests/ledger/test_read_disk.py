"""What a read leaves on disk (issue 24 item 3), on the real daemon and LocalRelay.

- `test_reads_leave_no_ledger_record_and_a_bounded_audit`: 300 channel.reads over 3
  channels (fresh requestIds) add no ledger record and, once counted, one `reads` line
  per channel set, not 300 lines; the counts add up and the chain verifies.
- `test_an_identical_read_retry_runs_again`: the doc's promise (docs/protocol.md, "Where
  this host and NIP-BA still differ"): the retry is answered afresh, without `replayed`,
  and sees an event posted in between.
- `test_an_action_with_effects_keeps_its_record_and_replay`: message.post keeps its
  ledger record, its tombstone, its intent and verdict lines, and replays.
- `test_read_counts_show_in_audit_show`: `audit show` lists the counts; `audit verify`
  passes.
"""

from __future__ import annotations

import json
import uuid

import pytest

from daemon.state.audit import AUDIT_DIRNAME, AuditRecord, ReadCount, read_records, verify
from tests.fixtures.broker import BrokerHarness, request_body

READS = 300


async def _records(broker: BrokerHarness) -> int:
    return await broker.app._ledger.count()  # type: ignore[attr-defined]


def _lines(broker: BrokerHarness) -> list[object]:
    return [line.record for line in read_records(broker.state_dir / AUDIT_DIRNAME)]


async def test_reads_leave_no_ledger_record_and_a_bounded_audit(broker: BrokerHarness) -> None:
    channels = [str(uuid.uuid4()) for _ in range(3)]
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, channels)
    await broker.app.reads.flush(everything=True)
    records, lines = await _records(broker), len(_lines(broker))
    for i in range(READS):
        answer = await broker.call(cred, "channel.read", {"channelId": channels[i % 3]})
        assert answer["status"] == "succeeded", answer
    assert await _records(broker) == records  # no retry record per read
    await broker.app.reads.flush(everything=True)
    added = _lines(broker)[lines:]
    assert len(added) == 1 and isinstance(added[0], ReadCount), added
    assert added[0].count == READS and added[0].agent == agent
    assert dict(added[0].targets) == {c: READS // 3 for c in channels}
    assert verify(broker.state_dir / AUDIT_DIRNAME).ok


async def test_an_identical_read_retry_runs_again(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    body = request_body("channel.read", {"channelId": channel})
    _, first = await broker.post(body, cred)
    assert first is not None and first["status"] == "succeeded"
    posted = await broker.call(cred, "message.post", {"channelId": channel, "content": "new"})
    _, again = await broker.post(body, cred)
    assert again is not None and again["status"] == "succeeded"
    assert "replayed" not in again
    ids = [e["id"] for e in again["outcome"]["messages"]]
    assert posted["outcome"]["eventId"] in ids  # executed again, not replayed


async def test_an_action_with_effects_keeps_its_record_and_replay(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    records = await _records(broker)
    tombs = await broker.app._ledger.tombstones()  # type: ignore[attr-defined]
    body = request_body("message.post", {"channelId": channel, "content": "kept"})
    _, first = await broker.post(body, cred)
    assert first is not None and first["status"] == "succeeded"
    assert await _records(broker) == records + 1
    assert await broker.app._ledger.tombstones() == tombs + 1  # type: ignore[attr-defined]
    _, again = await broker.post(body, cred)
    assert again == {**first, "replayed": True}
    mine = [r for r in _lines(broker) if isinstance(r, AuditRecord)
            and r.request_id == first["requestId"]]
    assert [(r.phase.value, r.replayed) for r in mine] == [
        ("intent", False), ("verdict", False), ("verdict", True)]


async def test_read_counts_show_in_audit_show(broker: BrokerHarness,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from daemon import cli

    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    for _ in range(5):
        await broker.call(cred, "channel.read", {"channelId": channel})
    await broker.call(cred, "storage.address", {"slug": "core"})
    await broker.app.reads.flush(everything=True)
    audit = str(broker.state_dir / AUDIT_DIRNAME)
    assert cli.main(["audit", "show", "--path", audit, "--agent", agent]) == 0
    shown = capsys.readouterr().out
    assert "reads" in shown and "5 counted" in shown and f"{channel[:8]}:5" in shown
    assert "1 counted" in shown and "storage.address" in shown
    assert cli.main(["audit", "show", "--path", audit, "--agent", agent, "--json"]) == 0
    counts = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(c["action"], c["count"]) for c in counts} == {("channel.read", 5),
                                                          ("storage.address", 1)}
    assert cli.main(["audit", "verify", audit]) == 0
