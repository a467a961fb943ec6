"""A custodian that stops answering (SIGSTOP: hung; or restarting under socket activation,
where the socket accepts and nothing answers yet) holds up only the requests that need it.

- `test_requests_that_sign_nothing_are_answered_while_the_custodian_is_stopped`: a
  liveness.ping and a channel.read of a warm window need only the key records, which the
  daemon reads from its snapshot (custody/custodian/records.py): both are answered while
  the custodian is still stopped.
- `test_a_signing_request_while_stopped_fails_internal_and_holds_up_no_one`: a message.post
  needs a signature; it gets `failed` + `internal` once the client's deadline for a call
  passes (custody/custodian/client.py CALL_TIMEOUT), and other connections are answered
  meanwhile; once the custodian runs again, posts succeed.
- `test_an_agent_minted_beside_the_daemon_is_seen_once_the_custodian_answers_again`: after
  SIGCONT, a key minted over the custodian's socket by another client reaches the daemon's
  records within a few refresh periods.
- `test_callers_queued_for_one_hop_all_fail_with_it_when_the_custodian_is_gone`: the
  signing batcher hands CustodianUnavailable to every caller of the failed hop instead of
  signing each alone (which, against a hung custodian, would cost a deadline per caller).

The deadline around each test (`HANG_GUARD`) only turns a hang into a failure: nothing here
asserts how long anything took.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import trio

from buzzwire.nostr import SignedEvent, UnsignedEvent
from custody.custodian.client import CustodianClient, CustodianUnavailable
from custody.custodian.records import RECHECK_SECONDS
from daemon.pipeline.signing import SigningBatcher
from tests.custodian.test_refusals import ask, held, human
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.custodian import CustodianProcess

#: Seconds before a test that hangs is failed (no timing is asserted: see the docstring).
HANG_GUARD = 30


@pytest.fixture
def broker_custody(custodian: CustodianProcess) -> Mapping[str, Mapping[str, object]]:
    return {"custody": {"custodian_socket": str(custodian.socket)}}


def _stopped(custodian: CustodianProcess) -> bool:
    """The process is in state T (stopped), read from /proc."""
    assert custodian.proc is not None
    stat = Path(f"/proc/{custodian.proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def _warm(broker: BrokerHarness) -> tuple[str, str]:
    """An agent's credential and channel, with one post signed and a read window open."""
    agent = await broker.human_owned_agent()
    channel = str(uuid.uuid4())
    credential = broker.credential(agent, [channel])
    posted = await broker.call(credential, "message.post", {"channelId": channel,
                                                            "content": "before"})
    assert posted["status"] == "succeeded", posted
    for _ in range(2):  # the second is answered from the window the first opened
        read = await broker.call(credential, "channel.read", {"channelId": channel, "limit": 100})
        assert read["status"] == "succeeded", read
    windows = broker.app._relay.windows
    assert windows is not None and len(windows) == 1
    return credential, channel


async def _ping(broker: BrokerHarness, credential: str, channel: str) -> dict[str, object]:
    return await broker.call(credential, "liveness.ping", {"channelId": channel, "turnId": "t"})


async def test_requests_that_sign_nothing_are_answered_while_the_custodian_is_stopped(
        broker: BrokerHarness, custodian: CustodianProcess) -> None:
    credential, channel = await _warm(broker)
    custodian.freeze()
    try:
        with trio.fail_after(HANG_GUARD):
            # Past one refresh period, so a check of the records is due (before the fix it
            # was made on the request's own path, blocking the event loop).
            await trio.sleep(2 * RECHECK_SECONDS)
            for _ in range(3):
                ping = await _ping(broker, credential, channel)
                assert ping["status"] == "failed", ping
                assert ping["error"]["code"] == "unsupported", ping  # type: ignore[index]
                read = await broker.call(credential, "channel.read",
                                         {"channelId": channel, "limit": 100})
                assert read["status"] == "succeeded", read
                assert [m["content"] for m in read["outcome"]["messages"]] == ["before"]
                assert _stopped(custodian)  # answered while it still answers nothing
                await trio.sleep(RECHECK_SECONDS)
    finally:
        custodian.thaw()


async def test_a_signing_request_while_stopped_fails_internal_and_holds_up_no_one(
        broker: BrokerHarness, custodian: CustodianProcess) -> None:
    credential, channel = await _warm(broker)
    answers: dict[str, dict[str, object]] = {}
    custodian.freeze()
    try:
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:

                async def post() -> None:
                    answers["post"] = await broker.call(
                        credential, "message.post", {"channelId": channel, "content": "stopped"})

                nursery.start_soon(post)
                for _ in range(3):  # other connections are answered meanwhile
                    ping = await _ping(broker, credential, channel)
                    assert ping["error"]["code"] == "unsupported", ping  # type: ignore[index]
                    await trio.sleep(RECHECK_SECONDS)
                assert "post" not in answers and _stopped(custodian)
            envelope = answers["post"]
            assert envelope["status"] == "failed", envelope
            assert envelope["error"]["code"] == "internal", envelope  # type: ignore[index]
            assert _stopped(custodian)
    finally:
        custodian.thaw()
    with trio.fail_after(HANG_GUARD):  # running again: the same daemon signs again
        envelope = await broker.call(credential, "message.post",
                                     {"channelId": channel, "content": "after"})
    assert envelope["status"] == "succeeded", envelope


async def test_an_agent_minted_beside_the_daemon_is_seen_once_the_custodian_answers_again(
        broker: BrokerHarness, custodian: CustodianProcess) -> None:
    credential, channel = await _warm(broker)
    custodian.freeze()
    try:
        await trio.sleep(2 * RECHECK_SECONDS)  # the daemon's check is now waiting on it
    finally:
        custodian.thaw()
    with trio.fail_after(HANG_GUARD):
        # Another client, straight over the socket: the daemon is not told of this key.
        ok, record = await trio.to_thread.run_sync(
            lambda: ask(custodian.socket, "mint", owner=human(), mint_ref=None))
        assert ok and isinstance(record, dict), record
        minted = str(record["pubkey"])
        other = broker.credential(minted, [channel])
        # Until its records show the key, the daemon refuses the credential as the
        # agent's that is gone (unauthenticated); then liveness.ping's own answer.
        while (await _ping(broker, other, channel))["error"]["code"] != "unsupported":  # type: ignore[index]
            await trio.sleep(RECHECK_SECONDS)
        assert broker.custody.agent(minted) is not None
        assert broker.app.directory.agent(minted) is not None
        ping = await _ping(broker, credential, channel)  # the first agent is still served
        assert ping["error"]["code"] == "unsupported", ping  # type: ignore[index]


class _Counted:
    """The real client, its sign_events calls counted."""

    def __init__(self, client: CustodianClient) -> None:
        self.client, self.calls = client, 0

    async def sign_events(self, requests: Sequence[tuple[str, UnsignedEvent]]
                          ) -> list[SignedEvent]:
        self.calls += 1
        return await self.client.sign_events(requests)


async def test_callers_queued_for_one_hop_all_fail_with_it_when_the_custodian_is_gone(
        custodian: CustodianProcess, nursery: trio.Nursery) -> None:
    client = await CustodianClient.open(custodian.socket)
    agents = [await held(client, human()) for _ in range(3)]
    counted = _Counted(client)
    batcher = SigningBatcher(counted)  # type: ignore[arg-type]
    await nursery.start(batcher.run)
    custodian.kill()
    failed: list[BaseException] = []

    async def caller(agent: str) -> None:
        with pytest.raises(CustodianUnavailable) as raised:
            await batcher.sign([(agent, UnsignedEvent(pubkey=agent, created_at=1_700_000_000,
                                                      kind=9, tags=(("h", "c"),), content="x"))])
        failed.append(raised.value)

    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as callers:
            for agent in agents:  # all queued before the batcher's task runs: one hop
                callers.start_soon(caller, agent)
    assert len(failed) == 3 and len({id(e) for e in failed}) == 3
    assert counted.calls == 1  # the hop that failed, and no hop per caller after it
    await client.aclose()
