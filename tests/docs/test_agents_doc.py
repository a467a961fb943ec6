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
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio

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


# ------------------------------------------------------------ the Buzz-runtime example

#: shared/spec/buzz-client.md: what Buzz's source says its runtime reads (no Buzz binary
#: runs here). BUZZ_SHARED_DIR names another shared directory; absent, the test skips
#: naming the path, as the wire-schema tests do.
BUZZ_CLIENT_MD = (Path(os.environ.get("BUZZ_SHARED_DIR")
                       or Path(__file__).resolve().parents[3] / "shared")
                  / "spec" / "buzz-client.md")
TCP_SOCKET_UNIT = REPO / "systemd" / "buzz-broker-tcp.socket"
_ASSIGNMENT = re.compile(r"^(?:# )?(BUZZ_[A-Z_]+)=(\S+)", re.M)
_LOOPBACK_URL = re.compile(r"http://(?:localhost|127(?:\.\d{1,3}){3}|\[::1\]):(\d+)")


def _runtime_section(spec: str) -> str:
    match = re.search(r"^## The agent runtime in broker mode.*?(?=^## )", spec, re.M | re.S)
    assert match, "buzz-client.md has no 'The agent runtime in broker mode' section"
    return match.group(0)


def test_buzz_runtime_example_names_exactly_the_variables_buzz_reads() -> None:
    if not BUZZ_CLIENT_MD.is_file():
        pytest.skip(f"{BUZZ_CLIENT_MD} is absent; set BUZZ_SHARED_DIR to the shared directory")
    runtime = _runtime_section(BUZZ_CLIENT_MD.read_text(encoding="utf-8"))
    example = dict(_ASSIGNMENT.findall(block(AGENTS_MD, "buzz-runtime-env")))

    # The same names, no more and no fewer (the commented poll interval included).
    assert sorted(example) == sorted(set(re.findall(r"BUZZ_[A-Z_]+", runtime)))
    assert example["BUZZ_AGENT_MODE"] == "broker"
    assert "`BUZZ_AGENT_MODE=broker`" in runtime
    # The transport takes http:// only to loopback; the port is the one the unit listens on.
    url = _LOOPBACK_URL.fullmatch(example["BUZZ_BROKER_URL"])
    assert url, example["BUZZ_BROKER_URL"]
    assert "`http://…` only when the host\n  is `localhost`, a loopback IPv4 address or `[::1]`" in (
        BUZZ_CLIENT_MD.read_text(encoding="utf-8"))
    ports = re.findall(r"^ListenStream=\S+:(\d+)$", TCP_SOCKET_UNIT.read_text(), re.M)
    assert ports == [url.group(1)]
    # The credential is the value itself (Buzz has no *_FILE variant): read from the file.
    assert example["BUZZ_BROKER_CREDENTIAL"].startswith('"$(cat')
    # The poll interval's default and minimum, as the doc's comment states them.
    interval = re.search(r"`BUZZ_BROKER_POLL_INTERVAL_MS` \(default (\d+), minimum (\d+)\)", runtime)
    assert interval, "buzz-client.md no longer states the poll interval's default and minimum"
    assert example["BUZZ_BROKER_POLL_INTERVAL_MS"] == interval.group(1)
    doc = AGENTS_MD.read_text(encoding="utf-8")
    assert f"Buzz's default poll interval (minimum {interval.group(2)})" in doc
