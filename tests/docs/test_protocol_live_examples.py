"""docs/protocol.md's presence.set and typing.set examples, sent as written to the real daemon.

The request bytes are the document's own; the credential is bound to the example channel.
The answer must succeed with the document's response shape and kind (its ids and times
are the host's to choose); the same bytes sent again are a replay.
"""

from __future__ import annotations

import json

import pytest

from tests.conformance._wire import Wire, known_agent
from tests.docs.test_protocol_doc import EXAMPLE_CHANNEL, _examples
from tests.fixtures.broker import BrokerHarness


@pytest.mark.parametrize("action", ["presence.set", "typing.set"])
async def test_the_documented_live_signal_example_is_answered_as_documented(
        broker: BrokerHarness, action: str) -> None:
    a = await known_agent(broker, "doc", [EXAMPLE_CHANNEL])
    wire = Wire(broker)
    wire.bind(a.credential, a.pubkey)
    body = _examples("request")[f"request-{action}"].encode("utf-8")
    documented = json.loads(_examples("response")[f"response-{action}"])
    answer = await wire.send(body, a.credential)
    assert answer["status"] == documented["status"] == "succeeded", answer
    assert set(answer) == set(documented) and answer["requestId"] == documented["requestId"]
    assert set(answer["outcome"]) == set(documented["outcome"])
    assert answer["outcome"]["kind"] == documented["outcome"]["kind"]
    again = await wire.send(body, a.credential)
    assert again == {**answer, "replayed": True}
