"""What the daemon tells its operator: metrics for a real request, and logs without secrets."""

from __future__ import annotations

import json
import logging
import uuid

import pytest

from daemon.log import format_record
from tests.fixtures.broker import BrokerHarness


def _value(rendered: str, series: str) -> float:
    for line in rendered.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no series {series!r} in\n{rendered}")


async def test_metrics_count_requests_token_calls_and_relay_trips(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    ok = await broker.call(cred, "message.post", {"channelId": channel, "content": "counted"})
    assert ok["status"] == "succeeded"
    refused = await broker.call(cred, "message.post", {"channelId": str(uuid.uuid4()),
                                                       "content": "x"})
    assert refused["error"]["code"] == "unauthorized"
    rendered = broker.app.metrics.render().decode()
    assert _value(rendered, 'buzz_broker_requests_total{action="message.post",'
                            'status="succeeded",code=""}') == 1
    assert _value(rendered, 'buzz_broker_requests_total{action="message.post",'
                            'status="failed",code="unauthorized"}') == 1
    assert _value(rendered, 'buzz_broker_token_call_seconds_count{op="sign"}') >= 1
    assert _value(rendered, 'buzz_broker_relay_round_trips_total{op="publish",'
                            'result="accepted"}') == 1
    assert agent not in rendered and cred not in rendered


async def test_verdict_logs_name_the_request_and_carry_no_secret(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    content = f"private words {uuid.uuid4()}"
    envelope = await broker.call(cred, "message.post", {"channelId": channel, "content": content},
                                 request_id="log-me-1")
    assert envelope["status"] == "succeeded"
    lines = [format_record(r) for r in caplog.records]
    verdicts = [json.loads(line) for line in lines if '"event":"verdict"' in line]
    assert any(v["request_id"] == "log-me-1" and v["agent"] == agent
               and v["status"] == "succeeded" and len(v["event_ids"]) == 1 for v in verdicts)
    everything = "\n".join(lines)
    assert cred not in everything
    assert content not in everything
