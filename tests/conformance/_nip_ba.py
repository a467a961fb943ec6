"""A result checker for all fifteen NIP-BA actions, written from NIP-BA's text (not its code).

`result_problems(request, result, me=None)` takes one request envelope and the host's
result (both parsed JSON) and returns every rule of NIP-BA's "Result" and "Actions"
sections the result breaks, as sentences; an empty list means the result is one a
conforming client must accept. Nothing here imports `daemon` or `buzzwire`: a checker
built from the code under test would agree with it by construction.

What it checks (NIP-BA section in brackets):
- [Wire] no `null` at any depth; integers are JSON integers (not booleans) within their
  width: versions u16, counts/kinds u32, timestamps u64.
- [Result] `type`, `protocolVersion` 1, `requestId` copied exactly, `status` one of three,
  `replayed` only `true`/`false`; the exact member set per status; success carries the
  request's action; `error` exactly `{code, message}` with a code of the table on a status
  it permits and a non-empty message.
- [Actions] the exact outcome members of the action, each of its type: Published is
  `{eventId: Hex, kind: u32, createdAt: u64}` with the action's kind; Hex is 64 lowercase
  hexadecimal characters on output; a Pubkey is also a valid secp256k1 x-only key; a
  Channel is lowercase hyphenated on output; names 1-120 scalars.
- [Result, client duties] identities echoed: a created agent's channel is the requested
  channel, an update/delete by pubkey names that pubkey; a read page within its effective
  limit and every event within the requested channel/thread/mention filters; an observer
  receipt within the submitted frame count.
- [Managed agents] `updatedFields` sorted, unique, a subset of the supplied mutable fields.
- [Channel and messages] an event has exactly the seven NIP-01 members with their types.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import coincurve

from tests.conformance import _spec

__all__ = ["result_problems"]

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")
_VISIBLE = re.compile(r"[\x21-\x7e]{1,256}")
_CANONICAL_CHANNEL = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_STATUSES = ("succeeded", "failed", "indeterminate")
_EVENT_MEMBERS = ("id", "pubkey", "created_at", "kind", "tags", "content", "sig")


def _nulls(value: Any, path: str, out: list[str]) -> None:
    if value is None:
        out.append(f"null at {path or '/'}")
    elif isinstance(value, dict):
        for key, child in value.items():
            _nulls(child, f"{path}/{key}", out)
    elif isinstance(value, list):
        for index, child in enumerate(value):
            _nulls(child, f"{path}/{index}", out)


def _uint(value: Any, top: int) -> bool:
    return type(value) is int and 0 <= value <= top


def _hex(value: Any) -> bool:
    return type(value) is str and _HEX64.fullmatch(value) is not None


def _pubkey(value: Any) -> bool:
    if not _hex(value):
        return False
    try:
        coincurve.PublicKeyXOnly(bytes.fromhex(value))
    except ValueError:
        return False
    return True


def _name(value: Any) -> bool:
    return type(value) is str and value.strip() != "" and len(value) <= _spec.NIP_BA_NAME_CHARS


def _channel(value: Any) -> str | None:
    """The canonical form of a requested channel, for comparing an echo, else None.

    Lenient on purpose: which spellings a host must accept is a request-side rule; here
    only "the echo names the same UUID" is judged (Python's reader takes hyphenated,
    32-hex, braced and `urn:uuid:` forms in any case)."""
    if type(value) is not str:
        return None
    try:
        return str(uuid.UUID(value.strip().lower()))
    except ValueError:
        return None


def _event(event: Any, where: str, out: list[str]) -> None:
    if not isinstance(event, dict) or tuple(sorted(event)) != tuple(sorted(_EVENT_MEMBERS)):
        out.append(f"{where}: not exactly the seven NIP-01 members")
        return
    if not (_hex(event["id"]) and _hex(event["pubkey"])):
        out.append(f"{where}: id and pubkey must be 64 lowercase hex")
    if not (_uint(event["created_at"], _spec.U64) and _uint(event["kind"], _spec.U32)):
        out.append(f"{where}: created_at u64 and kind u32")
    tags = event["tags"]
    if not (isinstance(tags, list) and all(
            isinstance(t, list) and all(type(v) is str for v in t) for t in tags)):
        out.append(f"{where}: tags must be arrays of string arrays")
    if type(event["content"]) is not str:
        out.append(f"{where}: content must be a string")
    if type(event["sig"]) is not str or _HEX128.fullmatch(event["sig"]) is None:
        out.append(f"{where}: sig must be 128 hex characters")


def _tag_values(event: Mapping[str, Any], name: str) -> list[str]:
    return [t[1] for t in event.get("tags", ()) if isinstance(t, list) and len(t) >= 2
            and t[0] == name]


def _read(args: Mapping[str, Any], outcome: Mapping[str, Any], me: str | None,
          out: list[str]) -> None:
    messages = outcome["messages"]
    if not isinstance(messages, list):
        out.append("messages must be an array")
        return
    limit = args.get("limit", _spec.DEFAULT_PAGE)
    if len(messages) > limit:
        out.append(f"page of {len(messages)} exceeds the effective limit {limit}")
    if "nextCursor" in outcome and (type(outcome["nextCursor"]) is not str
                                    or _VISIBLE.fullmatch(outcome["nextCursor"]) is None):
        out.append("nextCursor must be 1-256 bytes of 0x21-0x7e")
    channel = _channel(args.get("channelId"))
    root = args.get("rootEventId")
    for index, event in enumerate(messages):
        where = f"messages/{index}"
        _event(event, where, out)
        if not isinstance(event, dict):
            continue
        if channel not in [_channel(v) for v in _tag_values(event, "h")]:
            out.append(f"{where}: not in the requested channel")
        if isinstance(root, str) and event.get("id") != root.lower() and root.lower() not in [
                v.lower() for v in _tag_values(event, "e")]:
            out.append(f"{where}: not in the requested thread")
        if args.get("mentionsOnly") is True and me is not None and me not in _tag_values(event, "p"):
            out.append(f"{where}: does not mention the requesting agent")


def _published(action: str, outcome: Mapping[str, Any], out: list[str]) -> None:
    if not _hex(outcome["eventId"]):
        out.append("eventId must be 64 lowercase hex")
    if not _uint(outcome["createdAt"], _spec.U64):
        out.append("createdAt must be a u64")
    kind = outcome["kind"]
    if not _uint(kind, _spec.U32):
        out.append("kind must be a u32")
    elif kind != _spec.NIP_BA_KINDS[action]:
        out.append(f"{action} publishes kind {_spec.NIP_BA_KINDS[action]}, not {kind}")


def _agents(action: str, args: Mapping[str, Any], outcome: Mapping[str, Any],
            out: list[str]) -> None:
    if not _pubkey(outcome["agentPubkey"]):
        out.append("agentPubkey must be a lowercase hex secp256k1 x-only key")
    if not _name(outcome["displayName"]):
        out.append("displayName must be a non-empty name of at most 120 scalars")
    if action == "agents.create":
        got = outcome["channelId"]
        if type(got) is not str or _CANONICAL_CHANNEL.fullmatch(got) is None:
            out.append("channelId must be the lowercase hyphenated UUID")
        elif got != _channel(args.get("channelId")):
            out.append("the created agent's channel is not the requested channel")
        return
    target = args.get("target")
    if isinstance(target, dict) and isinstance(target.get("pubkey"), str) \
            and outcome["agentPubkey"] != target["pubkey"].lower():
        out.append("agentPubkey does not echo the pubkey target")
    if action == "agents.update":
        fields = outcome["updatedFields"]
        if not isinstance(fields, list) or not all(type(f) is str for f in fields):
            out.append("updatedFields must be an array of strings")
            return
        if fields != sorted(fields) or len(set(fields)) != len(fields):
            out.append("updatedFields must be sorted and without duplicates")
        supplied = set(args) & _spec.NIP_BA_MUTABLE
        if not set(fields) <= supplied:
            out.append("updatedFields names a field the request did not supply")


def _outcome(action: str, args: Mapping[str, Any], outcome: Any, me: str | None,
             out: list[str]) -> None:
    required, optional = _spec.NIP_BA_OUTCOMES[action]
    if not isinstance(outcome, dict):
        out.append("outcome must be an object")
        return
    if not required <= set(outcome) <= required | optional:
        out.append(f"outcome members {sorted(outcome)} are not {action}'s exact shape")
        return
    if action in _spec.NIP_BA_KINDS:
        _published(action, outcome, out)
    elif action == "channel.read":
        _read(args, outcome, me, out)
    elif action == "storage.address":
        if not _pubkey(outcome["authorPubkey"]) or not _hex(outcome["dTag"]):
            out.append("authorPubkey must be a Pubkey and dTag Hex")
        if outcome["kind"] != _spec.NIP_BA_MEMORY_KIND:
            out.append("storage.address names kind 30174")
        if me is not None and outcome["authorPubkey"] != me:
            out.append("authorPubkey is not the requesting agent")
    elif action == "storage.get":
        if "value" in outcome and type(outcome["value"]) is not str:
            out.append("value must be a string")
    elif action == "observer.emit":
        frames = args.get("frames")
        sent = len(frames) if isinstance(frames, list) else 0
        if not _uint(outcome["accepted"], _spec.U32) or outcome["accepted"] > sent:
            out.append("accepted must be a u32 from 0 to the number of frames sent")
    else:
        _agents(action, args, outcome, out)


def result_problems(request: Mapping[str, Any], result: Any, me: str | None = None) -> list[str]:
    """Every NIP-BA rule `result` breaks as the answer to `request` (see the module rules).

    Args:
        request: the request envelope as sent (parsed).
        result: the host's result envelope (parsed).
        me: the requesting agent's pubkey, when known (enables the echoes that need it).
    """
    out: list[str] = []
    _nulls(result, "", out)
    if not isinstance(result, dict):
        return out + ["a result is a JSON object"]
    if result.get("type") != "broker_result":
        out.append("type must be broker_result")
    if type(result.get("protocolVersion")) is not int or result.get("protocolVersion") != 1:
        out.append("protocolVersion must be the integer 1")
    if result.get("requestId") != request.get("requestId"):
        out.append("requestId must be copied exactly")
    if "replayed" in result and type(result["replayed"]) is not bool:
        out.append("replayed must be a boolean")
    status = result.get("status")
    members = set(result) - {"replayed"}
    common = {"type", "protocolVersion", "requestId", "status"}
    if status not in _STATUSES:
        return out + [f"status {status!r} is none of {_STATUSES}"]
    if status == "succeeded":
        if members != common | {"action", "outcome"}:
            return out + [f"succeeded members {sorted(members)} are not exact"]
        action = request.get("action")
        if result["action"] != action:
            return out + ["success must name the requested action"]
        if action not in _spec.NIP_BA_OUTCOMES:
            return out + [f"{action!r} is no NIP-BA action, so it cannot succeed"]
        args = request.get("args") if isinstance(request.get("args"), dict) else {}
        _outcome(action, args, result["outcome"], me, out)
        return out
    if members != common | {"error"}:
        return out + [f"{status} members {sorted(members)} are not exact"]
    error = result["error"]
    if not isinstance(error, dict) or set(error) != {"code", "message"}:
        return out + ["error must be exactly {code, message}"]
    permitted = _spec.PAIRING.get(error["code"]) if type(error["code"]) is str else None
    if permitted is None:
        out.append(f"error code {error['code']!r} is not in NIP-BA's table")
    elif status not in permitted:
        out.append(f"{error['code']} may not travel with {status}")
    if type(error["message"]) is not str or not error["message"]:
        out.append("error message must be a non-empty string")
    return out
