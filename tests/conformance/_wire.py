"""A recording client for the broker's socket that holds every response to the spec.

Rules:
- `Wire.send` posts exact bytes (our own h11 exchange, so the status line and headers are
  seen too) and checks the answer at once, before any test looks at it: HTTP 200 with
  `Content-Type: application/json`; a strict JSON object with no repeated key and no
  `null` at any depth; no `[]` except the required arrays of `_spec.REQUIRED_ARRAYS`; the
  exact member set of its status; a status/code pair the table permits; the outcome's
  exact members for the action asked (seven per returned event, a page within the
  effective limit); the requestId echoed; `replayed`, when present, exactly `true` and only
  on bytes this principal already sent under that requestId — never on a first sending.
  Then NIP-BA's own result rules for all fifteen actions (`_nip_ba.result_problems`: every
  outcome member's type and bound, the kind per action, the echoes a client checks).
  Then the published response schema (docs/schema/response.schema.json, docs/protocol.md
  §9): it states exactly what a host sends, so every real answer must validate.
- Every checked exchange is appended to `Wire.log` (and the module's `ALL_ENVELOPES`), so
  a test can also scan the whole run.
- A body without a usable requestId is sent with `send_uncorrelated`, which expects no
  envelope at all (spec §Request: the one error a host cannot answer with a verdict).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import coincurve
import h11
import jsonschema
import trio

from tests.conformance import _nip_ba, _spec
from tests.fixtures.broker import BrokerHarness, read_response
from tests.fixtures.relay import TestKey, nostr_fetch

_REPO = Path(__file__).resolve().parents[2]
#: The schema as published (the generated file, not the generator): what integrators check.
RESPONSE_SCHEMA = jsonschema.Draft202012Validator(json.loads(
    (_REPO / "docs" / "schema" / "response.schema.json").read_text(encoding="utf-8")))

__all__ = ["HttpReply", "Exchange", "Wire", "exchange", "envelope_body", "strict_loads",
           "ALL_ENVELOPES", "Principal", "owner_tag", "fetch", "known_agent"]

#: Every envelope any conformance test received in this process, already checked.
ALL_ENVELOPES: list[dict[str, Any]] = []


@dataclass(frozen=True)
class HttpReply:
    status: int
    headers: Mapping[str, str]
    body: bytes


async def exchange(socket: Path, method: str, target: str, body: bytes,
                   headers: Sequence[tuple[str, str]] = ()) -> HttpReply:
    """One HTTP/1.1 request on the Unix socket; the whole reply, headers included."""
    stream = await trio.open_unix_socket(str(socket))
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        hdrs = [("Host", "broker"), ("Content-Length", str(len(body))), *headers]
        await stream.send_all(conn.send(h11.Request(method=method, target=target, headers=hdrs)))
        try:
            if body:
                await stream.send_all(conn.send(h11.Data(data=body)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
        except trio.BrokenResourceError:
            pass  # the server answered early (413) and closed; its answer is still readable
        return HttpReply(*await read_response(conn, stream))


def envelope_body(action: str, args: Mapping[str, Any], /, *, request_id: str | None = None,
                  **override: Any) -> bytes:
    """A request envelope with members replaced/added by `override` (None value = drop)."""
    top: dict[str, Any] = {
        "type": "broker_request", "protocolVersion": 1,
        "requestId": request_id or str(uuid.uuid4()), "actionVersion": 1,
        "action": action, "args": dict(args),
    }
    for key, value in override.items():
        if value is _DROP:
            top.pop(key, None)
        else:
            top[key] = value
    return json.dumps(top, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


_DROP = object()
DROP = _DROP


class _Repeated(Exception):
    pass


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Repeated([k for k, _ in pairs])
    return obj


def strict_loads(raw: bytes) -> Any:
    """JSON with repeated keys refused (AssertionError) and NaN refused."""
    def bad_constant(text: str) -> Any:
        raise AssertionError(f"non-JSON constant {text}")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_repeats,
                          parse_constant=bad_constant)
    except _Repeated as exc:
        raise AssertionError(f"repeated key in response: {exc}") from None


def _scan(value: Any, path: str, problems: list[str]) -> None:
    if value is None:
        problems.append(f"null at {path or '/'}")
    elif isinstance(value, dict):
        for key, child in value.items():
            if child == [] and key not in _spec.REQUIRED_ARRAYS:
                problems.append(f"empty array at {path}/{key}")
            _scan(child, f"{path}/{key}", problems)
    elif isinstance(value, list):
        for index, child in enumerate(value):
            _scan(child, f"{path}/{index}", problems)


@dataclass(frozen=True)
class Exchange:
    """One checked request/response pair."""

    body: bytes
    http: HttpReply
    envelope: dict[str, Any]


def _request_facts(body: bytes) -> tuple[str | None, str | None, Mapping[str, Any]]:
    try:
        top = json.loads(body)
    except ValueError:
        return None, None, {}
    if not isinstance(top, dict):
        return None, None, {}
    args = top.get("args")
    action = top.get("action")
    return (top.get("requestId") if isinstance(top.get("requestId"), str) else None,
            action if isinstance(action, str) else None,
            args if isinstance(args, dict) else {})


def check_envelope(body: bytes, reply: HttpReply, *, first_sending: bool,
                   me: str | None = None) -> dict[str, Any]:
    """Every rule a host response must keep, whatever the request was (module docstring)."""
    assert reply.status == 200, (reply.status, reply.body[:200])
    assert reply.headers.get("content-type", "").split(";")[0].strip() == "application/json", reply.headers
    env = strict_loads(reply.body)
    assert isinstance(env, dict), env
    problems: list[str] = []
    _scan(env, "", problems)
    assert not problems, (problems, env)
    request_id, action, args = _request_facts(body)
    assert env.get("type") == "broker_result" and env.get("protocolVersion") == 1, env
    assert env.get("requestId") == request_id, (env.get("requestId"), request_id)
    status = env.get("status")
    members = set(env) - {"replayed"}
    if "replayed" in env:
        assert env["replayed"] is True, env
        assert not first_sending, ("replayed on a first sending", env)
    if status == "succeeded":
        assert members == _spec.SUCCEEDED_MEMBERS, env
        assert action is not None and env["action"] == action, (env["action"], action)
        required, optional = _spec.NIP_BA_OUTCOMES[action]
        outcome = env["outcome"]
        assert isinstance(outcome, dict) and required <= set(outcome) <= required | optional, outcome
        if action == "channel.read":
            limit = args.get("limit", _spec.DEFAULT_PAGE)
            assert len(outcome["messages"]) <= limit, (len(outcome["messages"]), limit)
            for event in outcome["messages"]:
                assert set(event) == _spec.EVENT_MEMBERS, event
        if action == "agents.update":
            fields = outcome["updatedFields"]
            assert fields == sorted(fields) and len(set(fields)) == len(fields), fields
    else:
        assert status in ("failed", "indeterminate"), env
        assert members == _spec.ERROR_MEMBERS, env
        error = env["error"]
        assert isinstance(error, dict) and set(error) == _spec.ERROR_OBJECT_MEMBERS, error
        assert status in _spec.PAIRING[error["code"]], (status, error)
        assert isinstance(error["message"], str) and error["message"], error
    try:
        request = json.loads(body)
    except ValueError:
        request = None
    if isinstance(request, dict):
        problems = _nip_ba.result_problems(request, env, me)
        assert not problems, (problems, env)
    schema_errors = [e.message for e in RESPONSE_SCHEMA.iter_errors(env)]
    assert not schema_errors, (schema_errors, env)
    ALL_ENVELOPES.append(env)
    return env


@dataclass(frozen=True)
class Principal:
    """An agent this test can speak as: its key, its owner's key, its credential."""

    key: TestKey
    owner: TestKey
    credential: str
    channel: str

    @property
    def pubkey(self) -> str:
        return self.key.pubkey


def owner_tag(owner: TestKey, agent: str) -> list[str]:
    """NIP-OA `["auth", owner, "", sig]`, signed here with coincurve (independent of custody)."""
    digest = hashlib.sha256((_spec.NIP_OA_PREFIX + agent + ":").encode("utf-8")).digest()
    sig = coincurve.PrivateKey(bytes.fromhex(owner.secret_hex)).sign_schnorr(
        digest, secrets.token_bytes(32))
    return ["auth", owner.pubkey, "", sig.hex()]


def verify_nip_oa(tag: Sequence[str], agent: str) -> bool:
    """The owner's BIP-340 signature over sha256("nostr:agent-auth:" + agent + ":" + cond)."""
    if len(tag) != 4 or tag[0] != "auth" or tag[1] == agent:
        return False
    digest = hashlib.sha256(f"{_spec.NIP_OA_PREFIX}{agent}:{tag[2]}".encode("utf-8")).digest()
    try:
        return bool(coincurve.PublicKeyXOnly(bytes.fromhex(tag[1])).verify(
            bytes.fromhex(tag[3]), digest))
    except ValueError:
        return False


async def known_agent(broker: BrokerHarness, name: str, channels: Sequence[str]) -> Principal:
    """Import an agent whose secret (and whose human owner's secret) this test holds,
    with its NIP-OA tag, so the test can sign as it and check the tag the host adds."""
    owner, key = TestKey(), TestKey()
    await broker.hold(bytearray(key.secret_hex.encode("ascii")), owner=owner.pubkey,
                      name=name, auth_tag=owner_tag(owner, key.pubkey))
    return Principal(key=key, owner=owner, credential=broker.credential(key.pubkey, channels),
                     channel=channels[0])


async def fetch(broker: BrokerHarness, flt: dict[str, Any]) -> list[dict[str, Any]]:
    """An independent read of the relay (nostr-sdk's client, its own AUTH)."""
    return list(await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [flt]))


@dataclass
class Wire:
    """The broker, spoken to byte for byte, every answer checked on arrival."""

    broker: BrokerHarness
    log: list[Exchange] = field(default_factory=list)
    _agent_of: dict[str, str] = field(default_factory=dict)
    _sent: set[tuple[str, str]] = field(default_factory=set)

    def bind(self, credential: str, agent: str) -> None:
        """Say which agent a credential speaks for (the ledger's principal)."""
        self._agent_of[credential] = agent

    async def send(self, body: bytes, credential: str | None) -> dict[str, Any]:
        headers = [("Content-Type", "application/json")]
        if credential is not None:
            headers.append(("Authorization", f"Bearer {credential}"))
        request_id, _, _ = _request_facts(body)
        agent = self._agent_of.get(credential or "")
        key = (agent or f"?{credential}", request_id or "")
        first = key not in self._sent
        reply = await exchange(self.broker.socket, "POST", "/v1/action", body, headers)
        env = check_envelope(body, reply, first_sending=first, me=agent)
        self._sent.add(key)
        self.log.append(Exchange(body, reply, env))
        return env

    async def send_uncorrelated(self, body: bytes, credential: str | None) -> HttpReply:
        headers = [("Content-Type", "application/json")]
        if credential is not None:
            headers.append(("Authorization", f"Bearer {credential}"))
        return await exchange(self.broker.socket, "POST", "/v1/action", body, headers)

    async def call(self, who: Principal, action: str, args: Mapping[str, Any],
                   *, request_id: str | None = None) -> dict[str, Any]:
        self.bind(who.credential, who.pubkey)
        return await self.send(envelope_body(action, args, request_id=request_id), who.credential)

    async def ok(self, who: Principal, action: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """The outcome of a call that must succeed."""
        env = await self.call(who, action, args)
        assert env["status"] == "succeeded", env
        return dict(env["outcome"])
