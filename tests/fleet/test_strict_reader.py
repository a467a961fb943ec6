"""The fleet client's strict reading (tests/fleet/buzz_agent.py `read_answer`).

The fleet test and benchmark count an answer as a verdict only when it passes Buzz's
strict reading; this proves that reading refuses what it says it refuses, so a host that
answers our own client but not Buzz's cannot pass the fleet by a lax generator.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.fleet.buzz_agent import NoAnswer, read_answer

ARGS = {"channelId": "c1", "limit": 2}
EVENT = {"id": "a" * 64, "pubkey": "b" * 64, "created_at": 1_700_000_000, "kind": 9,
         "tags": [["h", "c1"]], "content": "hello", "sig": "c" * 128}


def _answer() -> dict[str, Any]:
    return {"type": "broker_result", "protocolVersion": 1, "requestId": "r1",
            "status": "succeeded", "action": "channel.read",
            "outcome": {"messages": [dict(EVENT), dict(EVENT, id="d" * 64)],
                        "nextCursor": "cur"}}


def _event(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(answer: dict[str, Any]) -> None:
        answer["outcome"]["messages"][1].update(changes)
    return mutate


#: A change to a valid answer -> what Buzz's reader refuses it for.
REFUSED: dict[str, Callable[[dict[str, Any]], None]] = {
    "upper-case hex id": _event(id="A" * 64),
    "short pubkey": _event(pubkey="b" * 63),
    "non-hex signature": _event(sig="g" * 128),
    "id not a string": _event(id=7),
    "kind a bool": _event(kind=True),
    "a tag value not a string": _event(tags=[["h", 1]]),
    "an extra event member": _event(extra=1),
    "a page longer than its limit": lambda a: a["outcome"]["messages"].append(dict(EVENT)),
    "an empty nextCursor": lambda a: a["outcome"].update(nextCursor=""),
    "another requestId": lambda a: a.update(requestId="r2"),
    "another action": lambda a: a.update(action="channel.list"),
    "an extra envelope member": lambda a: a.update(extra=True),
    "protocolVersion a bool": lambda a: a.update(protocolVersion=True),
    "failed with an indeterminate code": lambda a: (
        a.pop("action"), a.pop("outcome"), a.update(
            status="failed", error={"code": "outcome_unknown", "message": "x"})),
}


def test_a_valid_answer_is_read() -> None:
    verdict = read_answer(json.dumps(_answer()).encode(), "r1", "channel.read", ARGS)
    assert verdict.status == "succeeded" and len(verdict.outcome["messages"]) == 2


@pytest.mark.parametrize("change", sorted(REFUSED))
def test_the_strict_reader_refuses(change: str) -> None:
    answer = _answer()
    REFUSED[change](answer)
    with pytest.raises(NoAnswer):
        read_answer(json.dumps(answer).encode(), "r1", "channel.read", ARGS)


@pytest.mark.parametrize("raw", [
    b'{"type":"broker_result","type":"broker_result"}',  # a duplicate member
    b'{"outcome":{"messages":[{"id":"1","id":"2"}]}}',   # a duplicate, nested
    b'[NaN]', b'not json', b'[]'])
def test_the_strict_reader_refuses_bytes(raw: bytes) -> None:
    with pytest.raises(NoAnswer):
        read_answer(raw, "r1", "channel.read", ARGS)
