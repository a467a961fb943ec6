"""Shared vectors for the contract tests: valid arguments per action, valid outcomes, and a
JSON writer that can spell what Python dicts cannot (repeated keys)."""

from __future__ import annotations

import json
import re
from typing import Any

from buzzwire.contract import Rule

CHANNEL = "5df7dfa8-e919-43df-8efd-f1dcb8af7071"
EVENT_ID = "cacf5f811cc8ef3f4af3f92cc222f92a86cdf6a26728a144c8e63b74ab6db359"
# Public keys from the specs' vectors (secrets 1 and 2) and the spec's mention example.
PK1 = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"
PK2 = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
PK3 = "d31d54af61c73c47053822d496ce341eac337252ee1aa7c41c9751fa3060d121"
REQUEST_ID = "a9f3c2e1-0b5d-4e8a-9c71-3f2b6d8e4a10"

# One valid argument object per action, using every member (required and optional).
VALID_ARGS: dict[str, dict[str, Any]] = {
    "channel.read": {"channelId": CHANNEL, "rootEventId": EVENT_ID, "mentionsOnly": True,
                     "cursor": "c1.1787675388", "limit": 50},
    "message.post": {"channelId": CHANNEL, "content": "hello", "mentions": [PK1]},
    "message.reply": {"channelId": CHANNEL, "replyToEventId": EVENT_ID, "content": "On it.",
                      "mentions": [PK3]},
    "reaction.add": {"channelId": CHANNEL, "targetEventId": EVENT_ID, "reaction": "👍"},
    "profile.set": {"displayName": "Ada", "about": "helps", "picture": "https://x.example/a.png"},
    "storage.address": {"slug": "mem/slice-c"},
    "storage.get": {"slug": "mem/slice-c"},
    "storage.put": {"slug": "mem/slice-c", "value": "remember:field-lab-Tuesday"},
    "agents.create": {"channelId": CHANNEL, "displayName": "Scout", "systemPrompt": "be brief",
                      "runtime": "goose", "provider": "p", "model": "m", "respondTo": "owner-only"},
    "agents.update": {"target": {"pubkey": PK2}, "displayName": "Scout 2", "systemPrompt": "s",
                      "runtime": "goose", "provider": "p", "model": "m", "respondTo": "anyone"},
    "agents.delete": {"target": {"name": "Scout"}},
    "presence.set": {"status": "away"},
    "typing.set": {"channelId": CHANNEL},
    "observer.emit": {"frames": [{"kind": "acp_read", "payload": '{"jsonrpc":"2.0","id":1}'},
                                 {"kind": "turn_started", "payload": "not json"}]},
    "liveness.ping": {"channelId": CHANNEL, "turnId": "turn-7"},
}

EVENT: dict[str, Any] = {
    "id": EVENT_ID, "pubkey": PK1, "created_at": 1787675388, "kind": 9,
    "tags": [["h", CHANNEL], ["p", PK3], []], "content": "hi @scout", "sig": "ab" * 64,
}

# One valid outcome object per action, using every member.
VALID_OUTCOMES: dict[str, dict[str, Any]] = {
    "channel.read": {"messages": [EVENT], "nextCursor": "c2.1787675300"},
    "message.post": {"eventId": EVENT_ID, "kind": 9, "createdAt": 1787675471},
    "message.reply": {"eventId": EVENT_ID, "kind": 9, "createdAt": 1787675471},
    "reaction.add": {"eventId": EVENT_ID, "kind": 7, "createdAt": 1787675471},
    "profile.set": {"eventId": EVENT_ID, "kind": 0, "createdAt": 1787675471},
    "storage.address": {"authorPubkey": PK1, "kind": 30174,
                        "dTag": "bdc233238ffe52e272b44cc233c8f33a2bc510b08be04495b225964283be4a90"},
    "storage.get": {"value": "remember:field-lab-Tuesday"},
    "storage.put": {"eventId": EVENT_ID, "kind": 30174, "createdAt": 1787675471},
    "agents.create": {"agentPubkey": PK2, "displayName": "Scout", "channelId": CHANNEL},
    "agents.update": {"agentPubkey": PK2, "displayName": "Scout 2",
                      "updatedFields": ["displayName", "systemPrompt"]},
    "agents.delete": {"agentPubkey": PK2, "displayName": "Scout"},
    "presence.set": {"eventId": EVENT_ID, "kind": 20001, "createdAt": 1787675471},
    "typing.set": {"eventId": EVENT_ID, "kind": 20002, "createdAt": 1787675471},
    "observer.emit": {"accepted": 2},
    "liveness.ping": {"eventId": EVENT_ID, "kind": 24200, "createdAt": 1787675471},
}


class Pairs(list):  # type: ignore[type-arg]
    """A JSON object written as (key, value) pairs, so a key can repeat."""


def dump(value: Any) -> str:
    """Compact JSON that also writes `Pairs` (repeated keys) verbatim."""
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value) + "}"
    if isinstance(value, dict):
        return dump(Pairs(value.items()))
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def envelope(action: str = "message.reply", args: Any = None, **over: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "type": "broker_request", "protocolVersion": 1, "requestId": REQUEST_ID,
        "actionVersion": 1, "action": action,
        "args": VALID_ARGS.get(action, VALID_ARGS["message.reply"]) if args is None else args,
    }
    env.update(over)
    return env


def body(value: Any) -> bytes:
    return dump(value).encode("utf-8")


def reason_pattern(rule: Rule) -> re.Pattern[str]:
    """`rule`'s reason template as a pattern: each placeholder stands for host digits and
    words (a limit, an enum's values), never for anything a request could hold."""
    parts = re.split(r"\{(\w+)\}", rule.value)
    return re.compile("".join(re.escape(part) if index % 2 == 0 else r"[0-9a-z_.,\- ]+"
                              for index, part in enumerate(parts)))
