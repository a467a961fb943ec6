"""`buzz-broker call` against the real daemon, as an agent's operator would type it (issue 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import trio

from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import nostr_fetch, nostr_verify


def _call(harness: BrokerHarness, cred_file: Path, action: str, args: dict[str, object],
          *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CREDENTIAL"}
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", "call", action, "--args", json.dumps(args),
         "--credential-file", str(cred_file), "--socket", str(harness.socket), *extra],
        capture_output=True, text=True, env=env, timeout=60)


async def test_call_posts_replies_and_reports_each_fate(broker: BrokerHarness,
                                                        tmp_path: Path) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred_file = tmp_path / "credential"
    cred_file.write_text(broker.credential(agent, [channel]) + "\n")
    cred_file.chmod(0o400)

    posted = await trio.to_thread.run_sync(
        lambda: _call(broker, cred_file, "message.post", {"channelId": channel, "content": "hi"},
                      "--request-id", "cli-post-1"))
    assert posted.returncode == 0, posted.stderr
    verdict = json.loads(posted.stdout)
    assert verdict["status"] == "succeeded" and verdict["requestId"] == "cli-post-1"
    [event] = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url,
                                            [{"ids": [verdict["outcome"]["eventId"]]}])
    assert event["content"] == "hi" and nostr_verify(event)

    again = await trio.to_thread.run_sync(
        lambda: _call(broker, cred_file, "message.post", {"channelId": channel, "content": "hi"},
                      "--request-id", "cli-post-1"))
    assert again.returncode == 0 and json.loads(again.stdout)["replayed"] is True

    refused = await trio.to_thread.run_sync(
        lambda: _call(broker, cred_file, "message.post",
                      {"channelId": str(uuid.uuid4()), "content": "elsewhere"}))
    assert refused.returncode == 3
    assert json.loads(refused.stdout)["error"]["code"] == "unauthorized"

    bad = await trio.to_thread.run_sync(
        lambda: _call(broker, cred_file, "message.post", {"channelId": "nope", "content": "x"}))
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1

    credential = cred_file.read_text().strip()
    for done in (posted, again, refused, bad):
        assert credential not in done.stdout + done.stderr


async def test_call_speaks_the_live_signals(broker: BrokerHarness, tmp_path: Path) -> None:
    # observer.emit: exit 0 with the count; liveness.ping: unsupported on a best-effort
    # action is exit 4 (carry on); bad frames are a usage error and nothing is sent.
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred_file = tmp_path / "credential"
    cred_file.write_text(broker.credential(agent, [channel]) + "\n")
    cred_file.chmod(0o400)
    frames = {"frames": [{"kind": "turn_started", "payload": '{"turnId":"t-1"}'}]}
    emitted = await trio.to_thread.run_sync(
        lambda: _call(broker, cred_file, "observer.emit", frames))
    assert emitted.returncode == 0, emitted.stderr
    assert json.loads(emitted.stdout)["outcome"] == {"accepted": 1}
    pinged = await trio.to_thread.run_sync(
        lambda: _call(broker, cred_file, "liveness.ping", {"channelId": channel, "turnId": "t-1"}))
    assert pinged.returncode == 4, pinged.stderr
    assert json.loads(pinged.stdout)["error"]["code"] == "unsupported"
    empty = await trio.to_thread.run_sync(
        lambda: _call(broker, cred_file, "observer.emit", {"frames": []}))
    assert empty.returncode == 2 and empty.stdout == "" and empty.stderr.count("\n") == 1
