"""One credential cannot fill the disk with refusals (issue 13 item 3), on the real daemon.

- `test_refusals_cost_little_disk`: 5,000 refused requests with fresh requestIds from one
  credential (`message.post` to a channel the credential does not hold: refused by
  authorization, before the relay). The ledger file and the audit files grow by at most
  `BUDGET` bytes per refusal on average. Measured after a clean stop, when SQLite has
  checkpointed its WAL into ledger.db (the test checks the WAL is gone), so nothing the
  daemon wrote is left out. Every refusal is still recorded (C2, I3): sampled ones replay
  byte for byte with `replayed: true` and another body under the same requestId is a
  `request_id_conflict`; the audit log accounts for all of them, one line each up to the
  burst and counted after it.
- `test_the_ledger_cap_refuses_unrecorded`: with the credential's refusal share at its
  minimum, refusals fill it (not the agent's share: issue 22 M1); then a new request from
  that credential is refused `failed` + `unauthorized` and not recorded (its identical
  retry is judged again, never replayed), while a recorded verdict still replays.
- `test_the_agents_cap_refuses_unrecorded`: the same for the agent's own share, filled by
  records that are the agent's (posts that ran and found no relay; a read that ran
  leaves no record at all, issue 24).

The figure goes to docs/reliability.md ("Disk per refusal").
"""

from __future__ import annotations

import os
import random
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from custody import TokenConfig
from daemon.state.audit import AUDIT_DIRNAME, AuditRecord, RefusalCount, audit_files, read_records
from daemon.pipeline.broker import LEDGER_FULL, REFUSALS_FULL
from tests.adversarial._daemon import (
    AgentState,
    DaemonProcess,
    envelope,
    post,
    request_body,
    setup_state,
)
from tests.fixtures.broker import write_config

#: The issue's target: average growth of ledger + audit files per refused request.
BUDGET = 300
REFUSALS = int(os.environ.get("BUZZ_DISK_REFUSALS", "5000"))
CONCURRENCY = 8
NO_RELAY = "ws://127.0.0.1:9"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bb-disk-") as name:
        yield Path(name)


def disk_bytes(state_dir: Path) -> int:
    """ledger.db and the audit files; the WAL must have been checkpointed away."""
    wal = state_dir / "ledger.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0, "measure after a clean stop"
    audit = sum(p.stat().st_size for _n, p in audit_files(state_dir / AUDIT_DIRNAME))
    return (state_dir / "ledger.db").stat().st_size + audit


def refused_post(request_id: str, *, content: str = "not yours") -> bytes:
    # A channel the credential was not issued for: refused by authorization.
    return request_body("message.post", {"channelId": str(uuid.uuid4()), "content": content},
                        request_id=request_id)


def refused_delete(request_id: str) -> bytes:
    # An agent this requester does not own: refused by authorization, within the
    # credential's own scope (it may ask for agents.delete).
    return request_body("agents.delete", {"target": {"pubkey": "f" * 64}},
                        request_id=request_id)


async def refuse_many(daemon: DaemonProcess, agent: AgentState, bodies: list[bytes]) -> None:
    queue = list(bodies)

    async def worker() -> None:
        while queue:
            answer = envelope(await post(daemon.socket, queue.pop(), agent.credential))
            assert (answer["status"], answer["error"]["code"]) == ("failed", "unauthorized"), answer

    async with trio.open_nursery() as nursery:
        for _ in range(CONCURRENCY):
            nursery.start_soon(worker)


async def _daemon_setup(custody_state: tuple[TokenConfig, Path], short_dir: Path,
                        channel: str | None = None, **state: object
                        ) -> tuple[AgentState, Path, Path]:
    """An agent with a credential for one channel; (agent, config, socket)."""
    token, state_dir = custody_state
    agent = await setup_state(token, state_dir, [channel or str(uuid.uuid4())])
    socket = short_dir / "b.sock"
    config = write_config(short_dir / "broker.toml", token=token, state_dir=state_dir,
                          socket=socket, relay_url=NO_RELAY, sections={"state": state})
    return agent, config, socket


async def test_refusals_cost_little_disk(custody_state: tuple[TokenConfig, Path],
                                         short_dir: Path) -> None:
    state_dir = custody_state[1]
    agent, config, socket = await _daemon_setup(custody_state, short_dir)

    daemon = await DaemonProcess.start(config, socket)
    try:
        await refuse_many(daemon, agent, [refused_post("warm-up")])  # files and tables exist
        assert await daemon.stop() == 0
    finally:
        daemon.kill()
    before = disk_bytes(state_dir)

    bodies = [refused_post(str(uuid.uuid4())) for _ in range(REFUSALS)]
    daemon = await DaemonProcess.start(config, socket)
    try:
        await refuse_many(daemon, agent, bodies)
        assert await daemon.stop() == 0
    finally:
        daemon.kill()
    per_refusal = (disk_bytes(state_dir) - before) / REFUSALS
    print(f"\ndisk per refusal: {per_refusal:.1f} bytes (ledger + audit, {REFUSALS} refusals)")
    assert per_refusal <= BUDGET

    # The audit log accounts for every refusal: a line each, or a count.
    listed = counted = 0
    for line in read_records(state_dir / AUDIT_DIRNAME):
        if isinstance(line.record, AuditRecord) and line.record.code is not None:
            listed += 1
        elif isinstance(line.record, RefusalCount):
            counted += line.record.count
    assert listed + counted == REFUSALS + 1  # and the warm-up
    assert counted > 0 and listed < 100

    # Every verdict is still recorded per (agent, requestId).
    daemon = await DaemonProcess.start(config, socket)
    try:
        for body in random.sample(bodies, 20):
            first = await post(socket, body, agent.credential)
            assert first is not None
            again = envelope(first)
            assert again.get("replayed") is True and again["error"]["code"] == "unauthorized"
        conflicting = bodies[0].replace(b"not yours", b"not yours either")
        answer = envelope(await post(socket, conflicting, agent.credential))
        assert answer["error"]["code"] == "request_id_conflict"
        assert await daemon.stop() == 0
    finally:
        daemon.kill()


async def test_the_ledger_cap_refuses_unrecorded(custody_state: tuple[TokenConfig, Path],
                                                 short_dir: Path) -> None:
    agent, config, socket = await _daemon_setup(
        custody_state, short_dir, ledger_max_bytes_per_agent=4096,
        ledger_max_refusal_bytes_per_credential=4096)
    daemon = await DaemonProcess.start(config, socket)
    try:
        # Refused within the credential's scope: charged to the credential's refusal share
        # (issue 22 M1), which fills first and turns away that credential alone.
        recorded = refused_delete("first")
        messages = []
        for i in range(60):
            body = recorded if i == 0 else refused_delete(f"fill-{i}")
            messages.append(envelope(await post(socket, body, agent.credential))["error"])
        assert messages[0]["message"] != REFUSALS_FULL
        full = [m for m in messages if m["message"] == REFUSALS_FULL]
        assert 0 < len(full) < 50 and all(m["code"] == "unauthorized" for m in full)

        # A new request of any kind from that credential is refused, and not recorded.
        read = request_body("storage.address", {"slug": "mem/x"}, request_id="a-read")
        for _ in range(2):
            answer = envelope(await post(socket, read, agent.credential))
            assert answer["error"] == {"code": "unauthorized", "message": REFUSALS_FULL}
            assert "replayed" not in answer
        # What was recorded still replays.
        replay = envelope(await post(socket, recorded, agent.credential))
        assert replay.get("replayed") is True and replay["error"] == messages[0]
        events = [e for e in daemon.log_events() if e.get("event") == "ledger.credential_full"]
        assert events
        assert await daemon.stop() == 0
    finally:
        daemon.kill()


async def test_the_agents_cap_refuses_unrecorded(custody_state: tuple[TokenConfig, Path],
                                                 short_dir: Path) -> None:
    channel = str(uuid.uuid4())
    agent, config, socket = await _daemon_setup(custody_state, short_dir, channel,
                                                ledger_max_bytes_per_agent=4096)
    daemon = await DaemonProcess.start(config, socket)
    try:
        # Posts that ran (and found no relay) are the agent's records: they fill its
        # account. Reads that ran leave none (issue 24), so they never could.
        answers = [envelope(await post(socket, request_body(
            "message.post", {"channelId": channel, "content": f"m{i}"},
            request_id=f"post-{i}"), agent.credential)) for i in range(40)]
        first = answers[0]
        assert first.get("error", {}).get("message") != LEDGER_FULL, first
        full = [a for a in answers if a.get("error", {}).get("message") == LEDGER_FULL]
        assert full and all(a["error"]["code"] == "unauthorized" for a in full)
        assert answers.index(full[0]) > 0
        # A read adds no record, but the account is full: it is refused, unrecorded.
        read = request_body("storage.address", {"slug": "mem/x"}, request_id="a-read")
        for _ in range(2):
            answer = envelope(await post(socket, read, agent.credential))
            assert answer["error"] == {"code": "unauthorized", "message": LEDGER_FULL}
            assert "replayed" not in answer
        events = [e for e in daemon.log_events() if e.get("event") == "ledger.agent_full"]
        assert events
        assert await daemon.stop() == 0
    finally:
        daemon.kill()
