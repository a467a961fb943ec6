"""What the pipeline logs about a request beside its verdict line (broker.REQUEST_LINES):
an agent, or a fault, can make each as frequent as its requests, and each was a line per
request, past journald's per-unit rate limit (which then drops the daemon's lines
wholesale). Each is now one line a minute per cause, then a `suppressed` count, and
every request is answered and counted as before."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest

from custody import Custody, CustodyError
from daemon.pipeline.broker import REFUSALS_FULL, REQUEST_LINES
from tests.fixtures.broker import BrokerHarness


def _lines(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == event]


@pytest.mark.broker_config(state={"ledger_max_refusal_bytes_per_credential": 4096})
async def test_invalid_requests_and_a_full_refusal_share_are_a_line_each_a_minute(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker")
    agent = await broker.human_owned_agent()
    channel = str(uuid.uuid4())
    cred = broker.credential(agent, [channel])
    answers = [await broker.call(cred, "channel.read", {"channelId": channel, "limit": 0})
               for _ in range(80)]
    assert all(a["status"] == "failed" for a in answers)
    full = [a for a in answers if a["error"]["message"] == REFUSALS_FULL]
    assert 0 < len(full) < 80, "the share filled partway"
    lines = broker.app._lines  # white box: the counts behind the lines
    for event, happened in (("request.invalid", 80 - len(full)),
                            ("ledger.credential_full", len(full))):
        assert len(_lines(caplog, event)) == 1, event
        assert lines.total(event) == happened
        assert event in REQUEST_LINES


async def test_a_custody_fault_on_every_request_is_a_line_a_minute(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker")
    agent = await broker.human_owned_agent()
    channel = str(uuid.uuid4())
    cred = broker.credential(agent, [channel])

    async def broken(*_: Any, **__: Any) -> Any:
        raise CustodyError("the token is gone")

    monkeypatch.setattr(Custody, "sign_events", broken)
    for i in range(20):
        answer = await broker.call(cred, "message.post", {"channelId": channel,
                                                          "content": f"m{i}"})
        assert (answer["status"], answer["error"]["code"]) == ("failed", "internal")
    [line] = _lines(caplog, "custody.fault")
    assert line.levelno == logging.ERROR
    assert broker.app._lines.total("custody.fault") == 20
    monkeypatch.undo()
    answer = await broker.call(cred, "message.post", {"channelId": channel, "content": "ok"})
    assert answer["status"] == "succeeded"
