"""Issue 10 through the daemon: rate limits that survive a restart, and an audit log that
fails closed and verifies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import coincurve
import pytest
import trio

from custody import TokenConfig
from daemon.state.audit import AUDIT_DIRNAME, verify
from daemon.pipeline.broker import Broker
from daemon.wiring import running
from daemon.config import load_config
from daemon.http import HttpRequest
from tests.fixtures.broker import BrokerHarness, request_body, write_config
from tests.fixtures.relay import nostr_fetch


def _cli(harness: BrokerHarness, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config",
                           str(harness.config_path), *args],
                          capture_output=True, text=True, env=dict(os.environ))


async def test_a_loop_of_posts_hits_the_credential_limit_and_the_count_survives_a_restart(
    custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
) -> None:
    token, state_dir = custody_state
    config_path = write_config(tmp_path / "broker.toml", token=token, state_dir=state_dir,
                               socket=tmp_path / "unused.sock", relay_url=local_relay)
    config = load_config(str(config_path))
    channel = str(uuid.uuid4())
    bodies = [request_body("message.post", {"channelId": channel, "content": f"loop {i}"})
              for i in range(200)]

    async def post(app: Broker, body: bytes, credential: str) -> dict[str, Any]:
        answer = await app.handle(HttpRequest(body=body, authorization=f"Bearer {credential}",
                                              peer_uid=None, peer_pid=None))
        assert answer.status == 200 and answer.body is not None
        return dict(json.loads(answer.body))

    async with running(config) as app:
        owner = coincurve.PrivateKey().public_key_xonly.format().hex()
        record = await app.custody.import_agent(
            bytearray(coincurve.PrivateKey().secret.hex().encode()), owner=owner)
        issued = subprocess.run(
            [sys.executable, "-m", "daemon.cli", "--config", str(config_path), "credential",
             "issue", "--agent", record.pubkey, "--channel", channel, "--all-actions",
             "--rate", "message.post=20/day", "--any-uid"],  # in process: no peer uid
            capture_output=True, text=True, env=dict(os.environ))
        assert issued.returncode == 0, issued.stderr
        looping = issued.stdout.strip()
        _, other = app.sessions.issue(agent=record.pubkey, channels=[channel],
                                      actions=["message.post"], ttl_seconds=None, uid=None,
                                      now=int(time.time()))
        verdicts = [await post(app, body, looping) for body in bodies]
        assert [v["status"] for v in verdicts[:20]] == ["succeeded"] * 20
        for refused in verdicts[20:]:
            assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthorized")
            assert "message.post 20/day" in refused["error"]["message"]
            assert "retry in" in refused["error"]["message"]
        # A replay of a succeeded request costs nothing and is still answered.
        replay = await post(app, bodies[0], looping)
        assert replay["status"] == "succeeded" and replay["replayed"] is True
        # Another credential is unaffected.
        assert (await post(app, request_body("message.post", {"channelId": channel,
                                                              "content": "other"}),
                           other))["status"] == "succeeded"
    events = await trio.to_thread.run_sync(nostr_fetch, local_relay,
                                           [{"kinds": [9], "#h": [channel]}])
    assert len(events) == 21

    # After a restart of the whole daemon on the same state, the day's count stands.
    async with running(config) as restarted:
        again = await post(restarted, bodies[100], looping)
        assert (again["status"], again["error"]["code"]) == ("failed", "unauthorized")


async def test_audit_log_records_every_verdict_and_verifies(broker: BrokerHarness) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    secret_words = f"do not log {uuid.uuid4()}"
    body = request_body("message.post", {"channelId": channel, "content": secret_words})
    _, first = await broker.post(body, cred)
    _, _replay = await broker.post(body, cred)
    await broker.call(cred, "message.post", {"channelId": str(uuid.uuid4()), "content": "no"})
    await broker.post(request_body("message.post", {"channelId": channel, "content": ""}), cred)
    audit_dir = broker.state_dir / AUDIT_DIRNAME
    result = verify(audit_dir)
    assert result.ok and result.records >= 5
    text = "\n".join(p.read_text() for p in sorted(audit_dir.iterdir()))
    assert first["outcome"]["eventId"] in text
    assert secret_words not in text and cred not in text
    shown = _cli(broker, "audit", "verify")
    assert shown.returncode == 0 and shown.stdout.startswith("audit log: ok ")


@pytest.fixture
def full_audit_disk(custody_state: tuple[TokenConfig, Path]) -> Iterator[Path]:
    """A tiny tmpfs mounted where the audit log lives, so the test can fill it for real."""
    _, state_dir = custody_state
    audit_dir = state_dir / AUDIT_DIRNAME
    audit_dir.mkdir(parents=True, mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs",
                              str(audit_dir)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield audit_dir
    finally:
        subprocess.run(["umount", "-l", str(audit_dir)], capture_output=True)


async def test_an_unwritable_audit_log_refuses_publishing_and_reading(
    full_audit_disk: Path, broker: BrokerHarness,
) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    assert (await broker.call(cred, "message.post", {"channelId": channel,
                                                     "content": "before"}))["status"] == "succeeded"
    filler = full_audit_disk / "filler"
    try:
        with filler.open("wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass  # ENOSPC: the audit log's disk is full now
    # tmpfs hands out whole pages, so the log's last page still has room for a few records;
    # post until the first refusal (a bounded number of tries).
    accepted: list[str] = []
    for i in range(64):
        body = request_body("message.post", {"channelId": channel, "content": f"try {i}"})
        _, answer = await broker.post(body, cred)
        if answer["status"] != "succeeded":
            break
        accepted.append(f"try {i}")
    assert (answer["status"], answer["error"]["code"]) == ("failed", "internal"), answer
    read = await broker.call(cred, "channel.read", {"channelId": channel})
    assert (read["status"], read["error"]["code"]) == ("failed", "internal")
    events = await trio.to_thread.run_sync(nostr_fetch, broker.relay_url,
                                           [{"kinds": [9], "#h": [channel]}])
    assert sorted(e["content"] for e in events) == sorted(["before", *accepted])

    # Room again: the refused request keeps its verdict (I3: one requestId, one verdict),
    # a new request goes through, and the chain is intact.
    filler.unlink()
    _, retried = await broker.post(body, cred)
    assert retried == {**answer, "replayed": True}
    fresh = await broker.call(cred, "message.post", {"channelId": channel, "content": "after"})
    assert fresh["status"] == "succeeded"
    assert verify(full_audit_disk).ok


async def test_every_answer_after_authentication_is_audited(broker: BrokerHarness) -> None:
    """Replays, conflicts and a narrower credential's refused replay each leave a record."""
    from daemon.state.audit import read_records

    channel, other = str(uuid.uuid4()), str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    wide = broker.credential(agent, [channel])
    narrow = broker.credential(agent, [other], actions=["channel.read"])
    body = request_body("message.post", {"channelId": channel, "content": "audited"},
                        request_id="audit-every-1")
    _, first = await broker.post(body, wide)
    _, replay = await broker.post(body, wide)
    _, conflict = await broker.post(body.replace(b"audited", b"changed"), wide)
    _, refused = await broker.post(body, narrow)
    assert first["status"] == "succeeded" and replay["replayed"] is True
    assert conflict["error"]["code"] == "request_id_conflict"
    assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthorized")
    records = [line.record for line in read_records(broker.state_dir / AUDIT_DIRNAME)
               if line.record is not None and line.record.request_id == "audit-every-1"]
    verdicts = [(r.phase.value, r.status.value if r.status else None,
                 r.code.value if r.code else None, r.replayed) for r in records]
    assert verdicts == [
        ("intent", None, None, False),
        ("verdict", "succeeded", None, False),
        ("verdict", "succeeded", None, True),
        ("verdict", "failed", "request_id_conflict", False),
        ("verdict", "failed", "unauthorized", False),
    ]
