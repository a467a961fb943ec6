"""The NIP-BA result checker itself: it accepts each vector's own result and refuses each
rule broken on purpose (a checker that accepts everything would prove nothing)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.conformance import _spec
from tests.conformance._nip_ba import result_problems
from tests.conformance.test_nip_ba_vectors import _vectors

_PUB = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"


def _by_action() -> dict[str, dict[str, Any]]:
    return {v["request"]["action"]: v for v in _vectors()}


def test_every_vector_result_passes() -> None:
    for action, vector in _by_action().items():
        assert result_problems(vector["request"], vector["result"], _PUB) == [], action


#: (action, a change to its vector's result, the rule it breaks)
BROKEN: list[tuple[str, dict[str, Any], str]] = [
    ("message.post", {"outcome": {"eventId": "A" * 64, "kind": 9, "createdAt": 1}}, "hex"),
    ("message.post", {"outcome": {"eventId": "a" * 64, "kind": 7, "createdAt": 1}}, "kind"),
    ("presence.set", {"outcome": {"eventId": "a" * 64, "kind": 9, "createdAt": 1}}, "kind"),
    ("typing.set", {"outcome": {"eventId": "a" * 64, "kind": 20002, "createdAt": -1}}, "u64"),
    ("typing.set", {"outcome": {"eventId": "a" * 64, "kind": True, "createdAt": 1}}, "bool"),
    ("storage.put", {"outcome": {"eventId": "a" * 64, "kind": 30174}}, "members"),
    ("storage.get", {"outcome": {"value": None}}, "null"),
    ("storage.get", {"outcome": {"value": 1}}, "type"),
    ("observer.emit", {"outcome": {"accepted": 2}}, "more than sent"),
    ("liveness.ping", {"outcome": {"eventId": "a" * 64, "kind": 24201, "createdAt": 1}}, "kind"),
    ("agents.create", {"outcome": {"agentPubkey": _PUB, "displayName": "Example",
                                   "channelId": "5DF7DFA8-E919-43DF-8EFD-F1DCB8AF7071"}}, "case"),
    ("agents.create", {"outcome": {"agentPubkey": _PUB, "displayName": "Example",
                                   "channelId": "00000000-0000-4000-8000-000000000000"}}, "echo"),
    ("agents.update", {"outcome": {"agentPubkey": _PUB, "displayName": "Example",
                                   "updatedFields": ["systemPrompt"]}}, "not supplied"),
    ("agents.update", {"outcome": {"agentPubkey": "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5",
                                   "displayName": "Example", "updatedFields": []}}, "target"),
    ("agents.delete", {"outcome": {"agentPubkey": "0" * 64, "displayName": "Example"}}, "point"),
    ("storage.address", {"outcome": {"authorPubkey": _PUB, "kind": 30175, "dTag": "a" * 64}}, "kind"),
    ("channel.read", {"outcome": {"messages": [{"id": "a" * 64}]}}, "event members"),
    ("channel.read", {"action": "message.post"}, "action"),
    ("message.post", {"requestId": "other"}, "requestId"),
    ("message.post", {"error": {"code": "internal", "message": "x"}}, "members"),
]


@pytest.mark.parametrize("action,change,rule", BROKEN, ids=[f"{a}-{r}" for a, _, r in BROKEN])
def test_each_broken_rule_is_named(action: str, change: dict[str, Any], rule: str) -> None:
    vector = _by_action()[action]
    result = copy.deepcopy(vector["result"])
    result.update(change)
    assert result_problems(vector["request"], result, _PUB), (action, rule)


def test_errors_must_pair_with_their_status() -> None:
    vector = _by_action()["typing.set"]
    base = {"type": "broker_result", "protocolVersion": 1, "requestId": "example-10"}
    good = {**base, "status": "failed", "error": {"code": "unsupported", "message": "off"}}
    assert result_problems(vector["request"], good) == []
    for status, code in (("indeterminate", "unsupported"), ("failed", "outcome_unknown"),
                         ("failed", "no_such_code")):
        bad = {**base, "status": status, "error": {"code": code, "message": "m"}}
        assert result_problems(vector["request"], bad), (status, code)
    assert set(_spec.PAIRING) == {
        "invalid_request", "unsupported_protocol_version", "unknown_action",
        "unsupported_action_version", "unsupported", "unauthenticated", "unauthorized",
        "request_id_conflict", "action_failed", "outcome_unknown", "internal"}
