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

from buzzwire.contract import (
    ACTIONS, ContractError, Status, Verdict, encode_request, encode_response, mark_replayed, parse_response,
    read_request,
)
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
