"""docs/protocol.md holds: its JSON examples, its schemas and its three programs.

- The schemas in docs/schema/ are exactly what scripts/json_schemas.py makes from the
  contract's tables (so a contract change without regenerating them fails here).
- Every JSON block labelled `request-…`/`response-…` validates against them, and
  round-trips through `buzzwire.contract` to the same bytes (the examples are written in
  the canonical form the contract writes). Every action has both.
- The curl, httpx and TypeScript programs run as written against the real daemon (SoftHSM2
  token, nostr-sdk's LocalRelay), with every other example, in reading order:
  tests/docs/test_docs_walkthrough.py (it uses the helpers here). The TypeScript one, run
  against a host that alters one event of a page, prints no answer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import trio

from buzzwire import kinds
from buzzwire.contract import (
    ACTIONS, MAX_FRAMES, ContractError, Status, Verdict, encode_request, encode_response, mark_replayed, parse_response,
    read_request,
)
from buzzwire.contract._shapes import SHAPES
from buzzwire.nostr import verify_event
from tests.client.scripted_host import Received, ScriptedHost, Signer, publish_outcome, socket_dir, succeeded
from tests.docs.node_deps import MIN_NODE, node_modules, node_version
from tests.docs.snippets import REPO, block, blocks

PROTOCOL_MD = REPO / "docs" / "protocol.md"
SCHEMAS = REPO / "docs" / "schema"
EXAMPLE_CHANNEL = "5df7dfa8-e919-43df-8efd-f1dcb8af7071"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("json_schemas", REPO / "scripts" / "json_schemas.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _examples(kind: str) -> dict[str, str]:
    out = {label: body.strip() for lang, label, body in blocks(PROTOCOL_MD)
           if lang == "json" and label is not None and label.startswith(kind + "-")}
    assert out, f"no {kind} examples"
    return out


def test_schemas_are_generated_from_the_contract() -> None:
    rendered = _generator().render()
    assert sorted(rendered) == sorted(p.name for p in SCHEMAS.glob("*.json"))
    for name, text in rendered.items():
        assert (SCHEMAS / name).read_text(encoding="utf-8") == text, (
            f"docs/schema/{name} is stale: run python scripts/json_schemas.py")


def test_every_action_has_a_request_and_a_response_example() -> None:
    assert {f"request-{a}" for a in ACTIONS} <= set(_examples("request"))
    assert {f"response-{a}" for a in ACTIONS} <= set(_examples("response"))


@pytest.mark.parametrize("label", sorted(_examples("request")))
def test_request_example_validates_and_round_trips(label: str) -> None:
    text = _examples("request")[label]
    _validator("request").validate(json.loads(text))
    reading = read_request(text.encode("utf-8"))
    assert reading.request is not None, reading.error
    assert encode_request(reading.request) == text.encode("utf-8")


def _reencode(body: bytes) -> bytes:
    response = parse_response(body)
    if response.status is Status.SUCCEEDED:
        assert response.action is not None and response.outcome is not None
        verdict = Verdict.succeeded(response.action, response.outcome)
    else:
        assert response.code is not None
        verdict = Verdict(status=response.status, code=response.code, message=response.message)
    out = encode_response(response.request_id, verdict)
    return mark_replayed(out) if response.replayed else out


@pytest.mark.parametrize("label", sorted(_examples("response")))
def test_response_example_validates_and_round_trips(label: str) -> None:
    text = _examples("response")[label]
    envelope = json.loads(text)
    _validator("response").validate(envelope)
    assert _reencode(text.encode("utf-8")) == text.encode("utf-8")
    for event in envelope.get("outcome", {}).get("messages", []):
        assert verify_event(event), "the doc's events are real, signed ones"


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("request", lambda e: e["args"].update(mentions=None)),
        ("request", lambda e: e["args"].update(mentions=[])),
        ("request", lambda e: e.update(requester="a" * 64)),
        ("request", lambda e: e["args"].update(content=" \n ")),
        ("request", lambda e: e.update(action="sign")),
        ("response", lambda e: e.update(replayed=False)),
        ("response", lambda e: e.update(error={"code": "outcome_unknown", "message": "x"})),
        ("response", lambda e: e["outcome"].update(secretKey="00" * 32)),
    ],
)
def test_schemas_refuse_what_the_contract_refuses(kind: str, mutate: Any) -> None:
    envelope = json.loads(_examples(kind)[f"{kind}-message.post"])
    mutate(envelope)
    assert not _validator(kind).is_valid(envelope)
    body = json.dumps(envelope).encode()
    if kind == "request":
        assert read_request(body).request is None
    else:
        with pytest.raises(ContractError):
            parse_response(body)


_HEX = "603ffc2a2402e5a5d3657b67778185bbf83e9555fb9d1f76b7fdc5fc7a65985a"
_CHANNEL = "5df7dfa8-e919-43df-8efd-f1dcb8af7071"


@pytest.mark.parametrize(
    ("action", "member", "value"),
    [
        # The reader trims and lowercases identities (§7 forgives spelling); a broker only
        # ever writes them canonical, so the schema of what it sends does not.
        pytest.param("message.post", "eventId", "\u2028 " + "AB" * 32 + "\n", id="eventId-padded-upper"),
        pytest.param("message.post", "eventId", " " + _HEX, id="eventId-padded"),
        pytest.param("message.post", "eventId", _HEX.upper(), id="eventId-upper"),
        pytest.param("storage.address", "dTag", _HEX.upper(), id="dTag-upper"),
        pytest.param("storage.address", "authorPubkey", _HEX + "\t", id="authorPubkey-padded"),
        pytest.param("agents.create", "agentPubkey", _HEX[:63], id="agentPubkey-63"),
        pytest.param("agents.update", "agentPubkey", _HEX.upper(), id="agentPubkey-upper"),
        pytest.param("agents.create", "channelId", _CHANNEL.upper(), id="channelId-upper"),
        pytest.param("agents.create", "channelId", _CHANNEL.replace("-", ""), id="channelId-bare"),
        pytest.param("agents.create", "channelId", "{" + _CHANNEL + "}", id="channelId-braced"),
        pytest.param("agents.create", "channelId", "urn:uuid:" + _CHANNEL, id="channelId-urn"),
        pytest.param("agents.create", "channelId", " " + _CHANNEL, id="channelId-padded"),
        # A name in an outcome is trimmed and holds nothing a name may not (outcome_name).
        pytest.param("agents.delete", "displayName", " Scout Jr", id="displayName-padded"),
        pytest.param("agents.delete", "displayName", "Scout\u3000", id="displayName-ideographic-space"),
        pytest.param("agents.update", "displayName", "\x1b]0;owned\x07Bob", id="displayName-escape"),
        pytest.param("agents.update", "displayName", "Scout\u202eJr", id="displayName-bidi"),
        # updatedFields: the update's own member names, each once.
        pytest.param("agents.update", "updatedFields", ["secretKey"], id="updatedFields-unknown"),
        pytest.param("agents.update", "updatedFields", ["target"], id="updatedFields-target"),
        pytest.param("agents.update", "updatedFields", ["model", "model"], id="updatedFields-twice"),
        # accepted counts frames sent, and one request sends at most MAX_FRAMES.
        pytest.param("observer.emit", "accepted", MAX_FRAMES + 1, id="accepted-beyond-frames"),
    ],
)
def test_the_response_schema_refuses_what_a_broker_never_sends(
    action: str, member: str, value: object
) -> None:
    envelope = json.loads(_examples("response")[f"response-{action}"])
    assert _validator("response").is_valid(envelope)
    envelope["outcome"][member] = value
    assert not _validator("response").is_valid(envelope)


def _holds(action: str, outcome: dict[str, Any]) -> bool:
    """Whether the contract's outcome class can hold this wire outcome as it is: it
    refuses any value not already in its checker's canonical form (check_instance)."""
    shape = SHAPES[ACTIONS[action].outcome_type]
    try:
        shape.cls(**{f.attr: tuple(v) if isinstance(v := outcome[f.wire], list) else v
                     for f in shape.fields if f.wire in outcome})
    except ValueError:
        return False
    return True


_NAMES = [
    "Scout Jr", "A", "x" * 120, "x" * 121, " Scout", "Scout ", "\u3000Scout", "Scout\u00a0",
    "Sc\u00a0out", "\u200cزهره", "\U0001f469\u200d\U0001f4bb dev", "\ufeffBob", "\x1bBob",
    "\x1cBob", "Bob\u0085", "Bob\u2028x", "Bob\u202ex", "Bo\tb", "\tBob", "", "   ",
]
_IDS = [_HEX, _HEX.upper(), " " + _HEX, _HEX + "\u2028", _HEX + "\n", _HEX[:63], _HEX + "0"]
_CHANNELS = [_CHANNEL, _CHANNEL.upper(), _CHANNEL.replace("-", ""), "{" + _CHANNEL + "}",
             "urn:uuid:" + _CHANNEL, _CHANNEL + "\n"]


@pytest.mark.parametrize(
    ("action", "member", "value"),
    [("agents.delete", "displayName", name) for name in _NAMES]
    + [("message.post", "eventId", v) for v in _IDS]
    + [("storage.address", "dTag", v) for v in _IDS]
    + [("agents.create", "channelId", v) for v in _CHANNELS],
)
def test_the_response_schema_accepts_exactly_what_an_outcome_can_hold(
    action: str, member: str, value: str
) -> None:
    """Names, ids and channels: the schema and the contract's outcome classes agree on
    every row, both ways (so it refuses nothing a broker sends). A pubkey's curve check
    and the host rules on `updatedFields` and `accepted` are beyond the classes."""
    envelope = json.loads(_examples("response")[f"response-{action}"])
    envelope["outcome"][member] = value
    assert _validator("response").is_valid(envelope) is _holds(action, envelope["outcome"])


def _reported_kinds() -> dict[str, int]:
    """action -> the kind its example's outcome reports (those that report one)."""
    out = {}
    for action in ACTIONS:
        outcome = json.loads(_examples("response")[f"response-{action}"]).get("outcome", {})
        if "kind" in outcome:
            out[action] = outcome["kind"]
    return out


@pytest.mark.parametrize("action", sorted(_reported_kinds()))
def test_the_response_schema_ties_each_outcomes_kind_to_its_action(action: str) -> None:
    """Every kind another action reports, and a kind no action does, in this action's
    outcome: refused (the client's check of the kind, client.py `_echo_check`)."""
    own = _reported_kinds()[action]
    others = (set(_reported_kinds().values()) | {kinds.MANAGED_AGENT}) - {own}
    assert others
    for kind in sorted(others):
        envelope = json.loads(_examples("response")[f"response-{action}"])
        envelope["outcome"]["kind"] = kind
        assert not _validator("response").is_valid(envelope), (action, kind)


def _node_with_typescript() -> tuple[str, str]:
    node = shutil.which("node")
    assert node is not None, "node is missing: `make deps` installs nodejs"
    for root in ("/usr/share/nodejs", "/usr/lib/node_modules", "/usr/local/lib/node_modules"):
        if (Path(root) / "typescript" / "package.json").exists():
            return node, root
    raise AssertionError("TypeScript is missing: `make deps` installs node-typescript")


async def run_json(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    done = await trio.run_process(argv, env=env, capture_stdout=True, capture_stderr=True,
                                  check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    envelope = json.loads(done.stdout)
    assert isinstance(envelope, dict)
    return envelope


async def typescript_example(directory: Path) -> list[str]:
    """The doc's TypeScript, transpiled to an ES module in `directory`, beside the
    node_modules its lockfile describes: the argv that runs it."""
    node, typescript_root = _node_with_typescript()
    assert node_version(node) >= MIN_NODE, (
        f"node {node_version(node)} is older than @noble/curves 2.4.0 needs (>= 20.19)")
    modules = await trio.to_thread.run_sync(node_modules)
    (directory / "node_modules").symlink_to(modules, target_is_directory=True)
    source = directory / "example.ts"
    source.write_text(block(PROTOCOL_MD, "node"))
    compiled = directory / "example.mjs"
    transpile = (
        "const ts = require('typescript'); const fs = require('fs');"
        f"const out = ts.transpileModule(fs.readFileSync({str(source)!r}, 'utf8'),"
        " {compilerOptions: {module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022},"
        "  reportDiagnostics: true});"
        "if (out.diagnostics.length) { console.error(JSON.stringify(out.diagnostics.map(d => d.messageText))); process.exit(1); }"
        f"fs.writeFileSync({str(compiled)!r}, out.outputText);"
    )
    await trio.run_process([node, "-e", transpile], env={"NODE_PATH": typescript_root,
                                                         "PATH": os.environ.get("PATH", "")})
    return [node, str(compiled)]


async def run_typescript(argv: list[str], env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """The example's two lines: the post's envelope, and what its read verified."""
    done = await trio.run_process(argv, env=env, capture_stdout=True, capture_stderr=True,
                                  check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    posted, read = done.stdout.decode().splitlines()
    envelope = json.loads(posted)
    assert isinstance(envelope, dict)
    return envelope, read


def program_env(socket: Path, tmp_path: Path, credential: str) -> dict[str, str]:
    path = tmp_path / "credential"
    if not path.exists():  # 0400: written once (the walk's programs share one)
        path.write_text(credential + "\n")
        path.chmod(0o400)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
            "BUZZ_BROKER_SOCKET": str(socket), "BUZZ_BROKER_CREDENTIAL_FILE": str(path)}


async def test_the_typescript_example_refuses_a_tampered_event(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A host that alters one byte of one event of a page (a hostile or broken broker, which
    the real one cannot be made to be): the example's check finds it and it prints no
    answer, after retrying the same bytes as §6 says."""
    typescript = await typescript_example(tmp_path)
    signer = Signer()
    good = signer.event(content="signed by its author", tags=[["h", EXAMPLE_CHANNEL]])
    assert verify_event(good)
    tampered = {**good, "content": "signed by its author!"}

    def answer(got: Received) -> object:
        action = got.json()["action"]
        outcome = (publish_outcome() if action == "message.post"
                   else {"messages": [good, tampered]})
        return succeeded(None, outcome)(got)

    host = ScriptedHost(str(Path(socket_dir()) / "host.sock"), default=answer)
    await nursery.start(host.serve)
    posted, read = await run_typescript(typescript, program_env(Path(host.path), tmp_path, "cred"))
    assert posted["status"] == "succeeded", posted
    assert read.startswith("no answer"), read
    reads = [r.body for r in host.received if r.json()["action"] == "channel.read"]
    assert len(reads) == 4 and len(set(reads)) == 1, "four attempts, identical bytes"
