"""The runtime record and the revocation of a removed agent's credentials are written off
the event loop (issue 22, L6).

Each write commits with `synchronous=FULL`, so it blocks for an fsync: on the loop it
stalls every connection the daemon serves for as long as the disk takes. Proven against
the daemon in this process (real token, real LocalRelay, real socket) by recording which
thread each write ran in, for every path that makes one: agents.create (the runtime, after
publishing), agents.update with only a new runtime (written by the operation itself),
agents.update with a new name and runtime (after publishing), and agents.delete (the
revocation). Then each write is checked to have happened.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from daemon.state.runtimes import RuntimeStore
from daemon.state.sessions import SessionStore
from tests.fixtures.broker import BrokerHarness


async def test_runtime_and_revocation_writes_run_in_worker_threads(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()
    writes: list[tuple[str, bool]] = []
    real_set, real_revoke = RuntimeStore.set, SessionStore.revoke_agent

    def set_spy(self: RuntimeStore, *args: Any) -> None:
        writes.append(("runtime", threading.get_ident() == loop_thread))
        real_set(self, *args)

    def revoke_spy(self: SessionStore, *args: Any, **kwargs: Any) -> int:
        writes.append(("revoke", threading.get_ident() == loop_thread))
        return real_revoke(self, *args, **kwargs)

    monkeypatch.setattr(RuntimeStore, "set", set_spy)
    monkeypatch.setattr(SessionStore, "revoke_agent", revoke_spy)

    channel = str(uuid.uuid4())
    owner = await broker.human_owned_agent("owner")
    cred = broker.credential(owner, [channel])

    async def ok(action: str, args: dict[str, Any]) -> dict[str, Any]:
        answer = await broker.call(cred, action, args)
        assert answer["status"] == "succeeded", answer
        return answer

    made = await ok("agents.create", {"channelId": channel, "displayName": "kid",
                                      "systemPrompt": "p", "runtime": "goose"})
    kid = made["outcome"]["agentPubkey"]
    kid_cred = broker.credential(kid, [channel], actions=["storage.address"])
    await ok("agents.update", {"target": {"pubkey": kid}, "runtime": "codex"})
    assert broker.app.runtimes.get(kid) == "codex"
    await ok("agents.update", {"target": {"pubkey": kid}, "displayName": "kid2",
                               "runtime": "goose"})
    assert broker.app.runtimes.get(kid) == "goose"
    await ok("agents.delete", {"target": {"pubkey": kid}})

    assert [name for name, _ in writes] == ["runtime", "runtime", "runtime", "revoke"]
    assert [on_loop for _, on_loop in writes] == [False] * 4, writes
    # The revocation, written on another connection, holds from the next request on.
    refused = await broker.call(kid_cred, "storage.address", {"slug": "core"})
    assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthenticated")
