"""Issue 22 H1 and M1, issue 23 item 7 (retention), on the real daemon, token and relay.

- H1: a refused `agents.create` must not destroy the child an earlier create with the same
  requestId made. The narrow credential's refusal is keyed apart from the agent's record
  (`<agent>/<credential>`), so it is neither a replay nor a conflict; before the fix its
  `failed` verdict destroyed the key found by the mint reference `<agent>/<requestId>`.
- Retention: after the ledger's retention a requestId of an action with effects is never
  new again: a compact tombstone answers the identical retry `indeterminate` +
  `outcome_unknown` and another body `request_id_conflict`, and nothing runs.
- A mint reference whose ledger record is gone altogether (a lost ledger file, records
  swept before tombstones existed) is refused `request_id_conflict`: the create never
  adopts, re-publishes or destroys the agent that reference made.
- A refusal decided before anything ran is no claim of its requestId (NIP-BA claims K
  "After authentication and permission checks"): it is kept for its retention only as a
  convenience (replayed), then forgotten without a tombstone, and the id runs then.
- M1: a narrow credential's refusals fill its own share, not its agent's: the agent's
  other credentials keep working.

In each H1 test the child proves it is whole: its owner can still update it (custody
signs the owner's 30177 for it), and its own credential still posts (custody signs as it).
"""

from __future__ import annotations

import logging
import sqlite3
import time
import uuid
from typing import Any

import pytest
import trio

from daemon.pipeline.broker import REFUSALS_FULL
from daemon.state.ledger import LEDGER_FILENAME
from daemon.state.refusal_audit import BURST
from tests.fixtures.broker import BrokerHarness, request_body
from tests.fixtures.relay import nostr_fetch

CREATE_ID = "create-1"


def _args(channel: str, name: str = "Child") -> dict[str, Any]:
    return {"channelId": channel, "displayName": name, "systemPrompt": "be brief"}


async def _owner_with_child(broker: BrokerHarness) -> tuple[str, str, str, str]:
    """(channel, owner's wide credential, child pubkey, child's credential)."""
    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    wide = broker.credential(owner, [channel])
    created = await broker.call(wide, "agents.create", _args(channel), request_id=CREATE_ID)
    assert created["status"] == "succeeded", created
    child = created["outcome"]["agentPubkey"]
    return channel, wide, child, broker.credential(child, [channel])


async def _assert_child_whole(broker: BrokerHarness, channel: str, wide: str, child: str,
                              child_cred: str) -> None:
    assert broker.custody.agent(child) is not None, "the child's key was destroyed"
    posted = await broker.call(child_cred, "message.post",
                               {"channelId": channel, "content": "still here"})
    assert posted["status"] == "succeeded", posted
    updated = await broker.call(wide, "agents.update",
                                {"target": {"pubkey": child}, "model": "m-2"})
    assert updated["status"] == "succeeded", updated


def _forget_ledger_records(broker: BrokerHarness) -> None:
    """What a lost or older ledger file looks like: no record, no tombstone."""
    conn = sqlite3.connect(str(broker.state_dir / LEDGER_FILENAME))
    try:
        for table in ("entries", "tombstones"):
            if conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (table,)).fetchone():
                conn.execute(f"DELETE FROM {table}")
        conn.commit()
    finally:
        conn.close()


@pytest.mark.broker_config(policy={"models": ["m-2"]})  # _assert_child_whole names it
async def test_a_narrow_credentials_refused_create_leaves_the_child_whole(
    broker: BrokerHarness,
) -> None:
    channel, wide, child, child_cred = await _owner_with_child(broker)
    owner = broker.custody.agent(child)
    assert owner is not None
    narrow = broker.credential(owner.owner, [channel], actions=["channel.read"])
    refused = await broker.call(narrow, "agents.create", _args(channel), request_id=CREATE_ID)
    assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthorized")
    await _assert_child_whole(broker, channel, wide, child, child_cred)


@pytest.mark.broker_config(policy={"models": ["m-2"]})  # _assert_child_whole names it
async def test_after_retention_the_requestid_is_a_tombstone_not_new(
    broker: BrokerHarness,
) -> None:
    channel, wide, child, child_cred = await _owner_with_child(broker)
    ledger = broker.app._ledger  # white box: run the sweep as if the retention had passed
    assert await ledger.sweep(int(time.time()) + 10 * 365 * 86400) >= 1
    # Another body (one validation refuses) under the spent id: a conflict, nothing runs.
    bad = await broker.call(wide, "agents.create", {**_args(channel), "runtime": "nope"},
                            request_id=CREATE_ID)
    assert (bad["status"], bad["error"]["code"]) == ("failed", "request_id_conflict"), bad
    # The identical retry: the outcome is no longer known, and it is not run again.
    status, same = await broker.post(request_body("agents.create", _args(channel),
                                                  request_id=CREATE_ID), wide)
    assert status == 200 and same is not None
    assert (same["status"], same["error"]["code"]) == ("indeterminate", "outcome_unknown"), same
    await _assert_child_whole(broker, channel, wide, child, child_cred)


@pytest.mark.broker_config(policy={"disabled_actions": ["message.post"]})
async def test_a_refusal_before_execution_claims_nothing_and_its_id_runs_later(
    broker: BrokerHarness,
) -> None:
    """NIP-BA: "After authentication and permission checks, the host MUST atomically claim
    an unused K": a request refused before it ran made no record, so its tombstone rule
    ("prevent re-execution") has nothing to protect. This host keeps the refusal for its
    retention (a convenience: replayed), then forgets it, and the id runs once, as on a
    NIP-BA host that never recorded it; from then on the id is an effect's, for good."""
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    body = request_body("message.post", {"channelId": channel, "content": "once"},
                        request_id="refused-first")
    status, first = await broker.post(body, cred)  # refused by policy: unsupported
    assert status == 200 and first is not None
    assert (first["status"], first["error"]["code"]) == ("failed", "unsupported"), first
    invalid = request_body("message.post", {"channelId": channel, "content": " "},
                           request_id="invalid-first")
    status, bad = await broker.post(invalid, cred)  # refused by validation
    assert bad is not None and bad["error"]["code"] == "invalid_request", bad
    config = broker.config_path.read_text()
    broker.config_path.write_text(config.replace('["message.post"]', "[]"))
    broker.app.reload()  # message.post is offered from now on
    later = {"channelId": channel, "content": "later"}
    # While kept: the identical retry is replayed, another body is a conflict.
    status, kept = await broker.post(body, cred)
    assert kept is not None and kept.get("replayed") is True and kept["error"] == first["error"]
    other = await broker.call(cred, "message.post", later, request_id="invalid-first")
    assert (other["status"], other["error"]["code"]) == ("failed", "request_id_conflict"), other
    ledger = broker.app._ledger  # white box: sweep as if the ledger's retention had passed
    assert await ledger.sweep(int(time.time()) + 8 * 86400) == 2
    assert await ledger.tombstones() == 0, "a refusal before execution left a tombstone"
    # Forgotten: the identical bytes are judged afresh and run; the other id is new too.
    status, ran = await broker.post(body, cred)
    assert ran is not None and ran["status"] == "succeeded" and "replayed" not in ran, ran
    fresh = await broker.call(cred, "message.post", later, request_id="invalid-first")
    assert fresh["status"] == "succeeded", fresh
    # Now each id stands for an effect: replayed, and after the retention a tombstone.
    status, again = await broker.post(body, cred)
    assert again is not None and again.get("replayed") is True
    assert again["outcome"] == ran["outcome"]
    published = await trio.to_thread.run_sync(
        nostr_fetch, broker.relay_url, [{"kinds": [9], "authors": [agent]}])
    assert sorted(e["id"] for e in published) == sorted(
        [ran["outcome"]["eventId"], fresh["outcome"]["eventId"]]), "an id ran twice"
    assert await ledger.sweep(int(time.time()) + 16 * 86400) == 2
    status, late = await broker.post(body, cred)
    assert late is not None
    assert (late["status"], late["error"]["code"]) == ("indeterminate", "outcome_unknown"), late


@pytest.mark.broker_config(policy={"models": ["m-2"]})  # _assert_child_whole names it
async def test_a_create_whose_mint_reference_outlived_its_record_is_refused(
    broker: BrokerHarness,
) -> None:
    channel, wide, child, child_cred = await _owner_with_child(broker)
    _forget_ledger_records(broker)
    # The identical body: before the fix it adopted the child and re-published it.
    again = await broker.call(wide, "agents.create", _args(channel), request_id=CREATE_ID)
    assert (again["status"], again["error"]["code"]) == ("failed", "request_id_conflict"), again
    # A body refused by validation: before the fix its `failed` destroyed the child.
    _forget_ledger_records(broker)
    bad = await broker.call(wide, "agents.create", {**_args(channel), "runtime": "nope"},
                            request_id=CREATE_ID)
    assert (bad["status"], bad["error"]["code"]) == ("failed", "invalid_request"), bad
    await _assert_child_whole(broker, channel, wide, child, child_cred)


async def _wide_and_narrow(broker: BrokerHarness) -> tuple[str, str, str]:
    """(channel, a credential for every action, one for channel.read only) of one agent."""
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    return (channel, broker.credential(agent, [channel]),
            broker.credential(agent, [channel], actions=["channel.read"]))


def _invalid_read(channel: str) -> dict[str, Any]:
    return {"channelId": channel, "limit": 0}  # limit is 1–500: refused by validation


@pytest.mark.broker_config(state={"ledger_max_bytes_per_agent": 4096})
async def test_a_narrow_credentials_refusals_do_not_lock_its_agent_out(
    broker: BrokerHarness,
) -> None:
    channel, wide, narrow = await _wide_and_narrow(broker)
    for _ in range(60):  # ~20 of these filled the agent's 4 KiB share before the fix
        refused = await broker.call(narrow, "channel.read", _invalid_read(channel))
        assert refused["error"]["code"] == "invalid_request", refused
    posted = await broker.call(wide, "message.post", {"channelId": channel, "content": "hi"})
    assert posted["status"] == "succeeded", posted


@pytest.mark.broker_config(state={"ledger_max_bytes_per_agent": 4096,
                                  "ledger_max_refusal_bytes_per_credential": 4096,
                                  "read_retention": "15m"})
async def test_a_full_refusal_share_turns_away_only_its_credential(
    broker: BrokerHarness,
) -> None:
    channel, wide, narrow = await _wide_and_narrow(broker)
    # One refusal by authorization (kept the retention), then validation refusals.
    kept = request_body("message.post", {"channelId": channel, "content": "no"},
                        request_id="kept-refusal")
    status, first = await broker.post(kept, narrow)
    assert status == 200 and first is not None and first["error"]["code"] == "unauthorized"
    answers = [await broker.call(narrow, "channel.read", _invalid_read(channel))
               for _ in range(60)]
    full = [a for a in answers if a["error"]["message"] == REFUSALS_FULL]
    assert full and all(a["error"]["code"] == "unauthorized" for a in full)
    # Only the narrow credential is turned away; the agent's other credentials are not.
    posted = await broker.call(wide, "message.post", {"channelId": channel, "content": "hi"})
    assert posted["status"] == "succeeded", posted
    # What was recorded still replays.
    status, again = await broker.post(kept, narrow)
    assert again is not None and again.get("replayed") is True
    assert again["error"] == first["error"]
    # Validation refusals are kept only the read retention; the authorization one stays.
    ledger = broker.app._ledger  # white box: run the sweep as if 15 minutes had passed
    await ledger.sweep(int(time.time()) + 15 * 60 + 60)
    read = await broker.call(narrow, "channel.read", {"channelId": channel})
    assert read["status"] == "succeeded", read
    status, still = await broker.post(kept, narrow)
    assert still is not None and still.get("replayed") is True


async def test_unauthenticated_and_uncorrelated_lines_are_rate_bounded(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 22 L1: a flood anyone on the socket can send costs one line per cause."""
    caplog.set_level(logging.INFO, logger="buzz_broker")
    for i in range(50):
        status, answer = await broker.post(request_body(
            "storage.address", {"slug": "mem/x"}, request_id=f"anon-{i}"), "bzb_not_a_token")
        assert answer is not None and answer["error"]["code"] == "unauthenticated"
        status, _ = await broker.post(b'{"type":"broker_request"}', None)
        assert status == 400
    events = [r.getMessage() for r in caplog.records
              if r.name.startswith("buzz_broker")]
    assert events.count("verdict") == 1 and events.count("request.uncorrelated") == 1, events
    recorder = broker.app._recorder  # white box: every one of them was still counted
    assert recorder.unvouched.total == 50 and recorder.uncorrelated_log.total == 50
    # An authenticated action with effects has a verdict line each.
    agent = await broker.human_owned_agent()
    channel = str(uuid.uuid4())
    cred = broker.credential(agent, [channel])
    for n in range(3):
        assert (await broker.call(cred, "message.post", {"channelId": channel,
                                                          "content": f"p{n}"}))["status"] == (
            "succeeded")
    events = [r.getMessage() for r in caplog.records
              if r.name.startswith("buzz_broker")]
    assert events.count("verdict") == 4


async def test_reads_verdict_lines_are_one_a_minute_per_outcome_above_debug(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture,
) -> None:
    """A fleet's polls (256 reads/s) were a journal line each: past journald's rate
    limit, which then drops the unit's lines wholesale. Above debug, a read's verdict line
    is one a minute per (action, status, code); at debug, every one."""
    agent = await broker.human_owned_agent()
    channel = str(uuid.uuid4())
    cred = broker.credential(agent, [channel])

    async def lines(n: int) -> list[dict[str, object]]:
        caplog.clear()
        for _ in range(n):
            for action, args in (("storage.address", {"slug": "mem/x"}),
                                 ("channel.read", {"channelId": channel, "limit": 5}),
                                 ("storage.get", {"slug": "mem/none"})):
                assert (await broker.call(cred, action, args))["status"] == "succeeded"
            refused = await broker.call(cred, "channel.read",
                                        {"channelId": channel, "cursor": "not-a-cursor"})
            assert refused["error"]["code"] == "invalid_request"
        return [r.buzz_fields for r in caplog.records  # type: ignore[attr-defined]
                if r.name.startswith("buzz_broker") and r.getMessage() == "verdict"]

    caplog.set_level(logging.INFO, logger="buzz_broker")
    shown = await lines(20)
    # One line per outcome: three reads that succeeded and one refused, the first of each.
    assert sorted((f["action"], f["status"]) for f in shown) == [
        ("channel.read", "failed"), ("channel.read", "succeeded"),
        ("storage.address", "succeeded"), ("storage.get", "succeeded")], shown
    assert broker.app._recorder.read_lines.total == 80  # white box: every one was counted
    caplog.set_level(logging.DEBUG, logger="buzz_broker.recorder")
    assert len(await lines(5)) == 20


async def test_refusals_past_a_credentials_burst_cost_the_log_what_they_cost_the_audit(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture,
) -> None:
    """One credential's flood of refused requests was a journal line each, with the end
    a fleet's reads had (journald's rate limit dropping the unit's lines wholesale). Its
    first refusals (the audit log's burst) keep a line each; past it, as the audit log
    counts them, their lines are one a minute per (agent, action, code); at debug, every
    one. The ledger keeps each refusal all the same."""
    agent = await broker.human_owned_agent()
    allowed, other = str(uuid.uuid4()), str(uuid.uuid4())
    cred = broker.credential(agent, [allowed])

    async def refused(n: int, start: int) -> list[dict[str, object]]:
        caplog.clear()
        for i in range(start, start + n):
            answer = await broker.call(cred, "message.post",
                                       {"channelId": other, "content": "no"},
                                       request_id=f"refused-{i}")
            assert answer["status"] == "failed" and answer["error"]["code"] == "unauthorized"
        return [r.buzz_fields for r in caplog.records  # type: ignore[attr-defined]
                if r.name.startswith("buzz_broker") and r.getMessage() == "verdict"]

    caplog.set_level(logging.INFO, logger="buzz_broker")
    recorder = broker.app._recorder  # white box: the audit's burst and its counts
    shown = await refused(BURST + 40, 0)
    assert len(shown) == BURST + 1, len(shown)  # the burst, then the first one counted
    assert all(f["code"] == "unauthorized" and f["agent"] == agent for f in shown)
    assert recorder.refusal_lines.total == 40 and recorder._refusals.counted == 40
    # Each refusal is still a ledger record: its requestId answers the same verdict.
    replay = await broker.call(cred, "message.post", {"channelId": other, "content": "no"},
                               request_id=f"refused-{BURST + 39}")
    assert replay["error"]["code"] == "unauthorized"
    # An action with effects, past the burst, still has its line.
    caplog.clear()
    assert (await broker.call(cred, "message.post", {"channelId": allowed,
                                                      "content": "yes"}))["status"] == "succeeded"
    assert [r.getMessage() for r in caplog.records
            if r.name.startswith("buzz_broker")].count("verdict") == 1
    caplog.set_level(logging.DEBUG, logger="buzz_broker.recorder")
    assert len(await refused(5, 1000)) == 5
