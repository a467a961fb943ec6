"""Authority ends when the agent ends (issue 13, item 5).

Attack: keep using a credential after its agent was removed. `agent remove` used to destroy
the key and revoke nothing, so the credential still authenticated; and an agent removed by
any other path (custody directly, a restored keystore) kept its credentials' authority too.

Proven here against the daemon in this process (real token, real LocalRelay, real socket),
with the operator's CLI as a separate process:
- `agent remove --yes` revokes every credential of the agent: the next request is
  `failed` + `unauthenticated`, and `credential list` shows them revoked;
- an agent removed without any revocation (custody's destroy in this process, or the
  keystore written by another process) is refused at authentication all the same:
  liveness is checked per request, and an answer the daemon keeps is dropped as soon as
  the keystore changes;
- a keystore that cannot be read at that check lets nothing through: `failed` +
  `internal`, nothing published;
- `agent remove` without `--yes` asks, and anything but `yes` removes nothing.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from custody import CustodyError
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.relay import nostr_fetch

CHANNEL = str(uuid.uuid4())


async def _cli(harness: BrokerHarness, *args: str, stdin: str = "") -> subprocess.CompletedProcess[bytes]:
    done = await trio.run_process(
        [sys.executable, "-m", "daemon.cli", "--config", str(harness.config_path), *args],
        stdin=stdin.encode(), capture_stdout=True, capture_stderr=True, check=False,
        env=dict(os.environ),
    )
    assert b"Traceback" not in done.stderr, done.stderr.decode()
    return done


def _code(envelope: dict[str, Any]) -> tuple[str, str | None]:
    return envelope["status"], (envelope.get("error") or {}).get("code")


async def _address(harness: BrokerHarness, credential: str) -> dict[str, Any]:
    return await harness.call(credential, "storage.address", {"slug": "mem/x"})


async def test_agent_remove_revokes_every_credential(broker: BrokerHarness) -> None:
    agent = await broker.human_owned_agent("doomed")
    first = broker.credential(agent, [CHANNEL])
    second = broker.credential(agent, [CHANNEL], actions=["storage.address"])
    assert _code(await _address(broker, first)) == ("succeeded", None)

    done = await _cli(broker, "agent", "remove", "--yes", agent)
    assert done.returncode == 0, done.stderr.decode()
    assert b"revoked 2 credential" in done.stderr

    for credential in (first, second):
        assert _code(await _address(broker, credential)) == ("failed", "unauthenticated")
    listed = await _cli(broker, "credential", "list", "--json")
    rows = [json.loads(line) for line in listed.stdout.decode().splitlines()]
    assert [r["state"] for r in rows if r["agent"] == agent] == ["revoked", "revoked"]


async def _tombstone_from_another_process(harness: BrokerHarness, agent: str) -> None:
    # Another connection, as another process (or a restored keystore) would write it.
    db = sqlite3.connect(harness.state_dir / "keystore.db")
    with db:
        db.execute("UPDATE keys SET sealed = NULL, deleted_at = 1 WHERE pubkey = ?", (agent,))
    db.close()


async def _destroy_in_custody(harness: BrokerHarness, agent: str) -> None:
    await harness.custody.destroy_agent(agent)


@pytest.mark.parametrize("remove", [_destroy_in_custody, _tombstone_from_another_process],
                         ids=["custody in this process", "keystore written by another process"])
async def test_an_agent_removed_by_another_path_authenticates_nothing(
    broker: BrokerHarness, remove: Callable[[BrokerHarness, str], Awaitable[None]],
) -> None:
    agent = await broker.human_owned_agent("gone")
    credential = broker.credential(agent, [CHANNEL])
    # Answered first, so any answer the daemon keeps about this agent is a "live" one.
    assert _code(await _address(broker, credential)) == ("succeeded", None)
    # Not `agent remove`, not agents.delete: no credential is revoked on these paths.
    await remove(broker, agent)
    for action, args in (("storage.address", {"slug": "mem/x"}),
                         ("message.post", {"channelId": CHANNEL, "content": "still here?"})):
        assert _code(await broker.call(credential, action, args)) == ("failed", "unauthenticated")
    # The credential itself was never revoked: the refusal is the liveness check's.
    assert all(info.revoked_at is None for info in broker.app.sessions.list()
               if info.agent == agent)


async def test_a_keystore_fault_at_the_liveness_check_lets_nothing_through(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Liveness fails closed: a keystore that cannot be read says nothing about whether the
    # agent still exists, so the request is `failed` + `internal` and nothing is published.
    agent = await broker.human_owned_agent("unknown")
    channel = str(uuid.uuid4())
    credential = broker.credential(agent, [channel])

    def unreadable(*_: Any) -> int:
        raise CustodyError("the keystore cannot be read")
    with monkeypatch.context() as patch:
        patch.setattr(type(broker.custody), "records_version", unreadable)
        for action, args in (("storage.address", {"slug": "mem/x"}),
                             ("message.post", {"channelId": channel, "content": "blind"})):
            assert _code(await broker.call(credential, action, args)) == ("failed", "internal")
    mine = [{"authors": [agent]}]
    assert await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, mine) == []
    # Mended, the same credential is served (and the relay read above would have seen it).
    posted = await broker.call(credential, "message.post", {"channelId": channel, "content": "ok"})
    assert _code(posted) == ("succeeded", None)
    assert [e["id"] for e in await trio.to_thread.run_sync(nostr_fetch, broker.relay_url, mine)
            ] == [posted["outcome"]["eventId"]]


async def test_agent_remove_asks_first(broker: BrokerHarness) -> None:
    agent = await broker.human_owned_agent("kept")
    credential = broker.credential(agent, [CHANNEL])
    for answer in ("", "no\n", "y\n", "yes please\n"):
        done = await _cli(broker, "agent", "remove", agent, stdin=answer)
        assert done.returncode != 0 and b"not confirmed" in done.stderr, answer
        assert broker.custody.agent(agent) is not None
    assert _code(await _address(broker, credential)) == ("succeeded", None)

    done = await _cli(broker, "agent", "remove", agent, stdin="yes\n")
    assert done.returncode == 0, done.stderr.decode()
    assert broker.custody.agent(agent) is None
    assert _code(await _address(broker, credential)) == ("failed", "unauthenticated")
