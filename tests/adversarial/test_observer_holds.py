"""observer.emit's held frames belong to the request that took them in, and only it settles
them (daemon/pipeline/observer.py, "Held until recorded").

The ledger keys a request outside its credential's scope `<agent>/<credential>`
(daemon/pipeline/broker.py `_ledger_principal`), so two credentials of one agent can have
a request with the same requestId in flight at once. Frames were held under (agent,
requestId): the out-of-scope request's refusal settled that key and dropped the frames the
other request had taken in, which then answered (and replayed) `accepted: 1` for a frame
that never reached the relay.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import trio

from daemon.state.ledger import Ledger
from tests.fixtures.broker import BrokerHarness, request_body


async def test_another_credentials_refusal_with_the_same_request_id_drops_nothing(
    broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent("a")
    wide = broker.credential(agent, [channel])
    narrow = broker.credential(agent, [channel], actions=["message.post"])
    queue = broker.app._observer.queue  # type: ignore[union-attr]
    published: list[str] = []
    forward = queue._publish

    async def spy(author: str, event: Any) -> Any:
        published.append(event.id)
        return await forward(author, event)
    queue._publish = spy
    # The wide credential's request waits at its verdict's record, frames held.
    at_finish, go_on = trio.Event(), trio.Event()
    finish = Ledger.finish

    async def slow_finish(self: Ledger, ticket: Any, *args: Any, **kwargs: Any) -> Any:
        if ticket.key.principal == agent and ticket.key.request_id == "obs-same":
            at_finish.set()
            await go_on.wait()
        return await finish(self, ticket, *args, **kwargs)
    monkeypatch.setattr(Ledger, "finish", slow_finish)
    mine = request_body("observer.emit", {"frames": [{"kind": "k", "payload": "mine"}]},
                        request_id="obs-same")
    theirs = request_body("observer.emit", {"frames": [{"kind": "k", "payload": "theirs"}]},
                          request_id="obs-same")
    dropped = queue.counts.dropped_unsettled
    answers: dict[str, Any] = {}

    async def held() -> None:
        answers["wide"] = (await broker.post(mine, wide))[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(held)
        await at_finish.wait()
        answers["narrow"] = (await broker.post(theirs, narrow))[1]
        go_on.set()
    refused, accepted = answers["narrow"], answers["wide"]
    assert (refused["status"], refused["error"]["code"]) == ("failed", "unauthorized")
    assert accepted["status"] == "succeeded" and accepted["outcome"] == {"accepted": 1}
    assert queue.counts.dropped_unsettled == dropped, "the refusal dropped another's frames"
    with trio.fail_after(5):
        while not published:
            await trio.sleep(0.05)
    assert len(published) == 1
    _, replay = await broker.post(mine, wide)
    assert replay == {**accepted, "replayed": True}
    await trio.sleep(0.3)
    assert len(published) == 1 and not queue._held
