"""README.md → docs/agents.md → docs/protocol.md: every example, in reading order, as written.

A newcomer reads the three documents in that order and runs what they show. `READING_ORDER`
names every fenced block of the three, in order (a test checks it is exactly the
documents' blocks, so a new example cannot be left out silently), and says what is done
with each: a step here, run against ONE real daemon (SoftHSM2 token, nostr-sdk's
LocalRelay) in that order, or the test that proves it elsewhere and why it is not run here.

The steps run the blocks as written. Where a block holds a placeholder the reader fills in
(`<uuid>`, `[--socket PATH]`), the step fills it the way the reader would and nothing else.
One thing is arranged first, as a reader's channel would already hold it: the event the
doc's channel.read example returns (a real signed event, checked by test_protocol_doc.py)
is published to the relay, so that the message.reply and reaction.add examples, which
target it, find it. The request examples of protocol.md §2–§4 are sent byte for byte, in
order, by one agent: together they exercise all fifteen actions.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from buzzwire.contract import ACTIONS
from buzzwire.nostr import verify_event
from daemon import cli
from tests.docs.snippets import REPO
from tests.docs.test_agents_doc import run_script
from tests.docs.test_protocol_doc import (
    EXAMPLE_CHANNEL, _examples, program_env, run_json, run_typescript, typescript_example,
)
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import nostr_fetch, nostr_publish

README = REPO / "README.md"
AGENTS_MD = REPO / "docs" / "agents.md"
PROTOCOL_MD = REPO / "docs" / "protocol.md"


#: Every fence, with or without a language (snippets.blocks takes only those with one).
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?: (?P<label>[\w.-]+))?\n(?P<body>.*?)^```$", re.M | re.S)


def _doc_blocks() -> list[tuple[str, str, str]]:
    """(document, name, body) for every block of the three, in reading order. A block's
    name is its label, else its first two words (what survives small edits of its text)."""
    out = []
    for path in (README, AGENTS_MD, PROTOCOL_MD):
        for m in _FENCE.finditer(path.read_text(encoding="utf-8")):
            name = m["label"] if m["label"] is not None else " ".join(m["body"].split()[:2])
            out.append((path.name, name, m["body"]))
    return out


def _request_labels() -> list[str]:
    return [key for doc, key, _ in _doc_blocks() if doc == PROTOCOL_MD.name
            and key.startswith("request-")]


@dataclass
class Walk:
    """What the steps share: one daemon, one agent and its credential, the answers so far."""

    broker: BrokerHarness
    python: str
    tmp: Path
    agent: str = ""
    credential: str = ""
    channel: str = field(default_factory=lambda: str(uuid.uuid4()))
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    mention_id: str = ""

    def env(self, **extra: str) -> dict[str, str]:
        path = self.tmp / "credential"
        if not path.exists():
            path.write_text(self.credential + "\n")
            path.chmod(0o400)
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.tmp),
                "BUZZ_BROKER_SOCKET": str(self.broker.socket),
                "BUZZ_BROKER_CREDENTIAL_FILE": str(path), **extra}


Step = Callable[[Walk, str], Awaitable[None]]


# ---------------------------------------------------------------- README.md


async def command_line(walk: Walk, body: str) -> None:
    """Every command the synopsis lists is one the CLI has (its --help answers, exit 0)."""
    paths: list[list[str]] = []
    for line in body.splitlines():
        if not line.startswith("buzz-broker "):
            continue  # a continuation line of the command above
        words = line.split("#")[0].replace("[--config PATH]", "").split()[1:]
        path = []
        for word in words:
            if not re.fullmatch(r"[a-z][a-z-]*", word):
                break
            path.append(word)
        paths.append(path)
        for alternative in re.findall(r"\| ([a-z][a-z-]*)", line.split("#")[0]):
            paths.append([*path[:-1], alternative])
    assert len(paths) >= 20, paths
    for path in paths:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            cli.main([*path, "--help"])
        assert done.value.code == 0 and "usage:" in out.getvalue(), path


# ---------------------------------------------------------------- docs/agents.md


async def pip_install(walk: Walk, body: str) -> None:
    # `walk.python` is the venv the client_only_python fixture made with exactly this
    # (from copies of ./buzzwire and ./client); the steps below run in it.
    assert body == "pip install ./buzzwire ./client\n"
    assert Path(walk.python).exists()


async def agent_asyncio(walk: Walk, body: str) -> None:
    asker = await walk.broker.human_owned_agent("asker")
    mention = await walk.broker.call(walk.broker.credential(asker, [walk.channel]),
                                     "message.post",
                                     {"channelId": walk.channel, "content": "ping",
                                      "mentions": [walk.agent]})
    assert mention["status"] == "succeeded", mention
    walk.mention_id = mention["outcome"]["eventId"]
    script = walk.tmp / "agent_asyncio.py"
    script.write_text(body)
    env = walk.env(BUZZ_CHANNEL=walk.channel, AGENT_PUBKEY=walk.agent,
                   AGENT_STATE=str(walk.tmp / "agent-state.json"))
    [line] = (await run_script(walk.python, script, env)).splitlines()
    assert line.startswith("replied ") and line.endswith(f" to {walk.mention_id}"), line
    walk.answers["reply"] = {"id": line.split()[1]}
    # A second poll finds nothing new: the handled mention is remembered. It runs under
    # `python -O`, which the client must survive (the forged-event case under -O is
    # tests/client/test_client.py::test_events_are_verified_under_python_O).
    assert await run_script(walk.python, script, env, "-O") == ""


async def agent_threads(walk: Walk, body: str) -> None:
    script = walk.tmp / "agent_threads.py"
    script.write_text(body)
    lines = (await run_script(walk.python, script, walk.env(BUZZ_CHANNEL=walk.channel))).splitlines()
    assert [line.split(":")[0] for line in lines] == [f"task {n}" for n in range(4)]
    assert all(": posted " in line for line in lines), lines
    page = await walk.broker.call(walk.credential, "channel.read", {"channelId": walk.channel})
    events = {e["id"]: e for e in page["outcome"]["messages"]}
    assert all(verify_event(e) for e in events.values())
    assert ["e", walk.mention_id] in [tag[:2] for tag in events[walk.answers["reply"]["id"]]["tags"]]
    assert sorted(e["content"] for e in events.values() if e["content"].startswith("task ")) == [
        f"task {n} done: {n * n}" for n in range(4)]


async def buzz_broker_call(walk: Walk, body: str) -> None:
    """The reader fills in the channel and the optional socket, and leaves out --request-id."""
    config = walk.tmp / ".config" / "buzz-broker"
    config.mkdir(parents=True, exist_ok=True)
    (config / "credential").write_text(walk.credential + "\n")
    (config / "credential").chmod(0o400)
    command = (body.replace("<uuid>", walk.channel)
               .replace("[--socket PATH]", '--socket "$BUZZ_BROKER_SOCKET"')
               .replace(" [--request-id ID]", ""))
    assert "<" not in command and "[" not in command, command
    env = walk.env(PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                   BUZZ_BROKER_CONFIG=str(walk.broker.config_path))
    answer = await run_json(["bash", "-c", command], env)
    assert answer["status"] == "succeeded" and answer["action"] == "message.post", answer


# ---------------------------------------------------------------- docs/protocol.md


async def send_request(walk: Walk, label: str) -> None:
    """A request example, byte for byte, answered as its response example says."""
    action = label.removeprefix("request-")
    status, answer = await walk.broker.post(_examples("request")[label].encode(), walk.credential)
    documented = json.loads(_examples("response")[f"response-{action}"])
    assert status == 200 and answer is not None, (label, status)
    assert (answer["requestId"], answer["status"]) == (documented["requestId"], documented["status"]), answer
    if documented["status"] == "succeeded":
        assert answer["action"] == action and set(answer) == set(documented), answer
        if action == "storage.get":
            # Read before the put that follows it in the doc: no record yet (the documented
            # value after a put: tests/e2e/test_memory.py::test_the_protocol_examples_run_as_written).
            assert answer["outcome"] == {}, answer
        else:  # `nextCursor` is there only when there is more
            assert set(documented["outcome"]) - {"nextCursor"} <= set(answer["outcome"]) <= set(
                documented["outcome"]), answer
        for fact in ("kind", "displayName", "updatedFields", "accepted", "channelId"):
            if fact in documented["outcome"]:
                assert answer["outcome"][fact] == documented["outcome"][fact], (fact, answer)
    else:
        assert answer["error"]["code"] == documented["error"]["code"], answer
    walk.answers[action] = answer


async def response_failed(walk: Walk, body: str) -> None:
    """The §2 request from an agent whose credential may only read: refused, nothing done."""
    reader = await walk.broker.human_owned_agent("reader")
    credential = walk.broker.credential(reader, [EXAMPLE_CHANNEL], actions=["channel.read"])
    _, answer = await walk.broker.post(_examples("request")["request-message.post"].encode(),
                                       credential)
    documented = json.loads(body)
    assert answer is not None and answer["status"] == "failed"
    assert answer["error"]["code"] == documented["error"]["code"], answer


async def response_replayed(walk: Walk, body: str) -> None:
    """The §2 request again, the same bytes: the recorded answer, marked replayed."""
    _, again = await walk.broker.post(_examples("request")["request-message.post"].encode(),
                                      walk.credential)
    assert again == {**walk.answers["message.post"], "replayed": True}
    assert set(again) == set(json.loads(body))


async def vector(walk: Walk, body: str) -> None:
    assert verify_event(json.loads(body))  # the whole check: test_event_verification.py


async def curl(walk: Walk, body: str) -> None:
    env = program_env(walk.broker.socket, walk.tmp / "programs", walk.credential)
    assert walk.credential not in body
    first = await run_json(["bash", "-c", body], env)
    assert first["status"] == "succeeded" and "replayed" not in first, first
    again = await run_json(["bash", "-c", body], env)  # the same bytes: the recorded answer
    assert again == {**first, "replayed": True}


async def httpx_program(walk: Walk, body: str) -> None:
    script = walk.tmp / "httpx_example.py"
    script.write_text(body)
    env = program_env(walk.broker.socket, walk.tmp / "programs", walk.credential)
    answer = await run_json([sys.executable, str(script)], env)
    assert answer["status"] == "succeeded" and answer["action"] == "message.post", answer


async def typescript_program(walk: Walk, body: str) -> None:
    directory = walk.tmp / "node"
    directory.mkdir()
    argv = await typescript_example(directory)  # transpiles this same block
    env = program_env(walk.broker.socket, walk.tmp / "programs", walk.credential)
    answer, read = await run_typescript(argv, env)
    assert answer["status"] == "succeeded" and answer["action"] == "message.post", answer
    page = await walk.broker.call(walk.credential, "channel.read",
                                  {"channelId": EXAMPLE_CHANNEL, "limit": 20})
    events = page["outcome"]["messages"]
    # It read the channel's page and verified every event on it, each signed by its author
    # (the seeded doc event, this agent's posts through custody).
    assert read == f"read {len(events)} events, every id and signature verified", read
    assert {"Hello from TypeScript", "Hello from curl", "Hello from httpx"} <= {
        e["content"] for e in events}


def _sent(label: str) -> Step:
    async def step(walk: Walk, body: str) -> None:
        await send_request(walk, label)
    return step


def _checked_with(request: str) -> str:
    return f"the answer to {request}, compared where that request is sent"


#: Every block of the three documents, in reading order: a step, or why it is not run here.
READING_ORDER: list[tuple[str, str, Step | str]] = [
    ("README.md", "make run",
     "`make run` is driven by tests/test_make_run.py; `make test` is this suite"),
    ("README.md", "agent ──",
     "a diagram"),
    ("README.md", "buzz-broker [--config",
     command_line),
    ("agents.md", "pip install", pip_install),
    ("agents.md", "agent-asyncio", agent_asyncio),
    ("agents.md", "agent-threads", agent_threads),
    ("agents.md", "buzz-broker call",
     buzz_broker_call),
    ("agents.md", "buzz-runtime-env",
     "Buzz's runtime configuration: no Buzz binary runs here; its variables are checked by "
     "tests/docs/test_agents_doc.py (against buzz-client.md, and as shell that sets them)"),
    ("protocol.md", "POST /v1/action",
     "the exchange's form, with placeholders; curl, httpx and TypeScript below are its instances"),
    ("protocol.md", "tcp-refusals",
     "a loopback TCP listener's 403 bodies, to read: tests/docs/test_protocol_lists.py::"
     "test_the_403_lines_are_the_listeners_own, and the daemon sends them in "
     "tests/test_tcp_listener.py::test_browser_requests_refused_without_reaching_the_pipeline"),
    *[("protocol.md", label, step) for label, step in list[tuple[str, Step | str]]([
        ("request-message.post", _sent("request-message.post")),
        ("response-message.post", _checked_with("request-message.post")),
        ("response-failed", response_failed),
        ("response-indeterminate", "a healthy relay never gives one: tests/adversarial/"
         "test_relay_faults_e2e.py::test_no_ok_is_indeterminate_then_the_retry_succeeds_with_the_same_event"),
        ("response-replayed", response_replayed),
    ])],
]
for _label in _request_labels()[1:]:
    _action = _label.removeprefix("request-")
    READING_ORDER.append(("protocol.md", _label, _sent(_label)))
    READING_ORDER.append(("protocol.md", f"response-{_action}", _checked_with(_label)))
    if _action == "reaction.add":
        READING_ORDER.append((
            "protocol.md", "response-reaction.add-unsupported",
            "this host offers reaction.add; a client's handling of the answer is "
            "tests/client/test_client.py::test_unsupported_is_normal_on_reaction_add_and_failed_elsewhere"))
READING_ORDER += [
    ("protocol.md", "/args/limit: integer",
     "messages to read, not to run: each is produced by the contract in tests/contract/"
     "test_refusal_messages.py::test_the_examples_in_the_protocol_doc_are_messages_the_rules_produce"),
    ("protocol.md", "nip01-vector-event", vector),
    ("protocol.md", "nip01-vector-serialization",
     "bytes to compare, not to run: tests/docs/test_event_verification.py"),
    ("protocol.md", "curl", curl),
    ("protocol.md", "httpx", httpx_program),
    ("protocol.md", "node", typescript_program),
]


def test_the_reading_order_names_every_block_of_the_three_documents() -> None:
    assert [(doc, key) for doc, key, _ in READING_ORDER] == [
        (doc, key) for doc, key, _ in _doc_blocks()]


def test_the_request_examples_cover_all_fifteen_actions() -> None:
    labels = _request_labels()
    assert len(labels) == len(set(labels)) and {f"request-{a}" for a in ACTIONS} == set(labels)
    ids = [json.loads(_examples("request")[label])["requestId"] for label in labels]
    assert len(set(ids)) == len(ids), "one agent sends them all: one requestId each"


@pytest.mark.broker_config(policy={"models": ["m-2"]})  # protocol.md names it
async def test_every_example_runs_in_reading_order(
    broker: BrokerHarness, client_only_python: str, tmp_path: Path
) -> None:
    walk = Walk(broker=broker, python=client_only_python, tmp=tmp_path)
    walk.agent = await broker.human_owned_agent("scout")
    walk.credential = broker.credential(walk.agent, [walk.channel, EXAMPLE_CHANNEL])
    (tmp_path / "programs").mkdir()
    # The reader's channel already holds the event the doc's read example shows.
    [seed] = json.loads(_examples("response")["response-channel.read"])["outcome"]["messages"]
    # (The relay lives for the session: another test may have published it already.)
    if not await trio.to_thread.run_sync(nostr_publish, broker.relay_url, seed):
        held = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, [{"ids": [seed["id"]]}])
        assert [e["id"] for e in held] == [seed["id"]], "the relay refused the doc's event"

    bodies = {(doc, key): body for doc, key, body in _doc_blocks()}
    ran: list[str] = []
    for doc, key, how in READING_ORDER:
        if callable(how):
            await how(walk, bodies[(doc, key)])
            ran.append(key)
    assert {a for a in ACTIONS} == {k.removeprefix("request-") for k in ran
                                    if k.startswith("request-")}
