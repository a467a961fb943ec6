"""docs/agents.md's two agent scripts, run as written, in a venv holding only the client.

The venv is made fresh once per session, without the system's packages, and the client is
installed into it the way the doc says (`pip install ./client`, from a copy of that
directory so nothing can reach back into the checkout). It must not be able to import
python-pkcs11, custody, the daemon or trio: the scripts then run on asyncio and threads,
against the real daemon (SoftHSM2 token, nostr-sdk's LocalRelay), from a temporary
directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio

from buzzwire.nostr import verify_event
from tests.client.scripted_host import Received, ScriptedHost, Signer, socket_dir, succeeded
from tests.docs.snippets import REPO, block
from tests.fixtures.broker import BrokerHarness

AGENTS_MD = REPO / "docs" / "agents.md"
#: What an agent must not need. `trio` too: anyio runs the client on asyncio.
ABSENT = ("pkcs11", "custody", "daemon", "trio", "cryptography")


@pytest.fixture(scope="session")
def client_only_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("client-venv")
    source = root / "client"
    shutil.copytree(REPO / "client", source,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # This venv's pip installs into the fresh one (`--python`): no pip inside it, no
    # bootstrap cost; pip's own cache serves the dependency wheels after the first run.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def _run_env(broker: BrokerHarness, tmp_path: Path, credential: str, channel: str,
             agent: str) -> dict[str, str]:
    path = tmp_path / "credential"
    path.write_text(credential + "\n")
    path.chmod(0o400)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "BUZZ_BROKER_SOCKET": str(broker.socket),
        "BUZZ_BROKER_CREDENTIAL_FILE": str(path),
        "BUZZ_CHANNEL": channel,
        "AGENT_PUBKEY": agent,
        "AGENT_STATE": str(tmp_path / "agent-state.json"),
    }


async def _run(python: str, script: Path, env: dict[str, str], *flags: str) -> str:
    done = await trio.run_process([python, *flags, str(script)], cwd=script.parent, env=env,
                                  capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout.decode()


async def test_agent_scripts_run_in_a_venv_with_only_the_client(
    broker: BrokerHarness, client_only_python: str, tmp_path: Path
) -> None:
    found = await trio.run_process(
        [client_only_python, "-c",
         "import importlib.util as u, json; "
         f"print(json.dumps([n for n in {ABSENT!r} if u.find_spec(n)]))"],
        cwd=tmp_path, capture_stdout=True, env={"PATH": os.environ.get("PATH", "")},
    )
    assert json.loads(found.stdout) == []

    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent("doc-agent")
    asker = await broker.human_owned_agent("asker")
    asker_credential = broker.credential(asker, [channel])
    env = _run_env(broker, tmp_path, broker.credential(agent, [channel]), channel, agent)
    mention = await broker.call(asker_credential, "message.post",
                                {"channelId": channel, "content": "ping", "mentions": [agent]})
    assert mention["status"] == "succeeded", mention
    mention_id = mention["outcome"]["eventId"]

    asyncio_script = tmp_path / "agent_asyncio.py"
    asyncio_script.write_text(block(AGENTS_MD, "agent-asyncio"))
    out = await _run(client_only_python, asyncio_script, env)
    [line] = out.splitlines()
    assert line.startswith("replied ") and line.endswith(f" to {mention_id}")
    reply_id = line.split()[1]
    # A second poll finds nothing new: the handled mention is remembered. It runs under
    # `python -O`, which the client must survive (the forged-event case under -O is
    # tests/client/test_client.py::test_events_are_verified_under_python_O).
    assert await _run(client_only_python, asyncio_script, env, "-O") == ""

    thread_script = tmp_path / "agent_threads.py"
    thread_script.write_text(block(AGENTS_MD, "agent-threads"))
    lines = (await _run(client_only_python, thread_script, env)).splitlines()
    assert [line.split(":")[0] for line in lines] == [f"task {n}" for n in range(4)]
    assert all(": posted " in line for line in lines), lines

    page = await broker.call(asker_credential, "channel.read", {"channelId": channel})
    events = {e["id"]: e for e in page["outcome"]["messages"]}
    assert ["e", mention_id] in [tag[:2] for tag in events[reply_id]["tags"]]
    assert sorted(e["content"] for e in events.values() if e["content"].startswith("task ")) == [
        f"task {n} done: {n * n}" for n in range(4)]


async def test_the_asyncio_agent_refuses_a_tampered_event(
    nursery: trio.Nursery, client_only_python: str, tmp_path: Path
) -> None:
    """The asyncio script against a host that alters one byte of a mention (a hostile or
    broken broker, which the real one cannot be made to be): the client's check refuses the
    page, the script says so, and nothing is answered or reacted to."""
    channel = str(uuid.uuid4())
    author = Signer()
    agent = Signer().pubkey
    mention = author.event(content="@scout ping", tags=[["h", channel], ["p", agent]])
    assert verify_event(mention)
    tampered = {**mention, "content": "@scout pong"}

    def answer(got: Received) -> object:
        assert got.json()["action"] == "channel.read", "nothing but the read may be sent"
        return succeeded(None, {"messages": [tampered]})(got)

    host = ScriptedHost(str(Path(socket_dir()) / "host.sock"), default=answer)
    await nursery.start(host.serve)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
        "BUZZ_BROKER_SOCKET": host.path, "BUZZ_BROKER_CREDENTIAL": "a-scripted-credential",
        "BUZZ_CHANNEL": channel, "AGENT_PUBKEY": agent,
        "AGENT_STATE": str(tmp_path / "agent-state.json"),
    }
    script = tmp_path / "agent_asyncio.py"
    script.write_text(block(AGENTS_MD, "agent-asyncio"))
    out = await _run(client_only_python, script, env)
    assert out.splitlines() == ["read refused: an event's id or signature does not verify"]
    assert {r.json()["action"] for r in host.received} == {"channel.read"}
    assert json.loads((tmp_path / "agent-state.json").read_text())["seen"] == []
