"""docs/agents.md's promises about its scripts that the reading-order walk cannot show.

- `pip install ./buzzwire ./client` makes a venv (tests/docs/conftest.py, made fresh once
  per session, without the system's packages, from copies of buzzwire/ and client/) that
  cannot import
  python-pkcs11, custody, the daemon, trio or `cryptography`: the scripts run on asyncio
  and threads with the client alone. They run there, as written, against the real daemon,
  in tests/docs/test_docs_walkthrough.py.
- The asyncio script, against a host that alters one event, refuses the page and says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest
import trio

from buzzwire.nostr import verify_event
from tests.client.scripted_host import Received, ScriptedHost, Signer, socket_dir, succeeded
from tests.docs.snippets import REPO, block

AGENTS_MD = REPO / "docs" / "agents.md"
#: What an agent must not need. `trio` too: anyio runs the client on asyncio.
ABSENT = ("pkcs11", "custody", "daemon", "trio", "cryptography")


async def run_script(python: str, script: Path, env: dict[str, str], *flags: str) -> str:
    done = await trio.run_process([python, *flags, str(script)], cwd=script.parent, env=env,
                                  capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout.decode()


async def test_the_client_venv_holds_nothing_of_the_daemon(
        client_only_python: str, tmp_path: Path) -> None:
    found = await trio.run_process(
        [client_only_python, "-c",
         "import importlib.util as u, json; "
         f"print(json.dumps([n for n in {ABSENT!r} if u.find_spec(n)]))"],
        cwd=tmp_path, capture_stdout=True, env={"PATH": os.environ.get("PATH", "")},
    )
    assert json.loads(found.stdout) == []


async def test_buzzwire_comes_from_its_own_distribution(
        client_only_python: str, tmp_path: Path) -> None:
    """`pip install ./buzzwire ./client`: the shared wire module is `buzz-broker-wire`'s (its
    own folder, buzzwire/), and the client's distribution carries no copy of it."""
    probe = ("import importlib.metadata as m, json; print(json.dumps({"
             "d: sorted({str(f).split('/')[0] for f in m.files(d) if str(f).endswith('.py')})"
             " for d in ('buzz-broker-wire', 'buzz-broker-client')}))")
    found = await trio.run_process([client_only_python, "-c", probe], cwd=tmp_path,
                                   capture_stdout=True, env={"PATH": os.environ.get("PATH", "")})
    assert json.loads(found.stdout) == {"buzz-broker-wire": ["buzzwire"],
                                        "buzz-broker-client": ["buzz_broker_client"]}


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
    out = await run_script(client_only_python, script, env)
    assert out.splitlines() == ["read refused: an event's id or signature does not verify"]
    assert {r.json()["action"] for r in host.received} == {"channel.read"}
    assert json.loads((tmp_path / "agent-state.json").read_text())["seen"] == []


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


def test_the_buzz_runtime_example_is_shell_that_sets_them(tmp_path: Path) -> None:
    """The block runs as written in a shell and sets the variables as described, the
    credential read from its file (Buzz has no *_FILE variant)."""
    (tmp_path / ".config" / "buzz-broker").mkdir(parents=True)
    (tmp_path / ".config" / "buzz-broker" / "credential").write_text("the-credential\n")
    out = subprocess.run(["bash", "-c", block(AGENTS_MD, "buzz-runtime-env")
                          + '\nprintf "%s\\n" "$BUZZ_AGENT_MODE" "$BUZZ_BROKER_URL" '
                          '"$BUZZ_BROKER_CREDENTIAL"'],
                         env={"HOME": str(tmp_path), "PATH": os.environ.get("PATH", "")},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["broker", "http://127.0.0.1:7475", "the-credential"]
