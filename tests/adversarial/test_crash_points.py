"""Crash points (issue 8 item 2; issue 4 and 5's SIGKILL tests, end to end).

The daemon runs as its own process (`tests.adversarial.crashing_daemon`) against a real
LocalRelay through `KillingProxy`. The relay behind the proxy is the open one (no NIP-42):
LocalRelay refuses an AUTH whose ``relay`` tag names the proxy rather than itself, and the
crash points concern the ledger and the relay's copy, not authentication. For message.post,
message.reply, agents.create, storage.put and typing.set (a live signal: ephemeral, so the
relay keeps no copy to count, and the retry must finish with the committed event, never a
new one) it is SIGKILLed at each step of the pipeline:

    before_pending  the plan is signed (agents.create: the key is minted), nothing durable
    after_pending   the pending record is committed, nothing sent
    event_unsent    the daemon sent EVENT; it never reached the relay
    event_stored    the relay stored the event and said OK; the daemon never saw the OK
    ok_delivered    the OK is in the daemon's socket; it never recorded the verdict
    after_verdict   the verdict is committed; the response was never written

agents.create publishes three events; the relay-side points are also taken at its second
and third event (a crash between events of one ledger entry).

After each kill: the client got no answer, the daemon is restarted on the same state dir,
and the IDENTICAL bytes are sent again. Required: `succeeded`; on the relay (read directly,
by an independent nostr-sdk client) every effect exactly once; when a pending record was
committed, the events on the relay are exactly its events (the original ids, never
re-signed ones); at most one minted agent for the owner, the one the outcome names; for
storage.put, at every point, the memory value and slug in no file of the state directory.

A relay refusal at the first event, then a kill at `before_verdict` (the rollback has run:
agents.create's key destroyed; the `failed` verdict not yet recorded): the retry, with the
relay taking everything now, must replay `failed` and put nothing on the relay
(`test_refused_then_killed_before_its_verdict_is_never_published`).
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_websocket

from custody import TokenConfig
from daemon.state.directory import AgentDirectory
from tests.adversarial._daemon import (
    AgentState,
    DaemonProcess,
    KillingProxy,
    Moment,
    envelope,
    pending_event_ids,
    post,
    request_body,
    setup_state,
)
from tests.adversarial._secrets import files_under
from tests.fixtures.broker import write_config
from tests.fixtures.relay import TestKey, free_port, nostr_fetch, nostr_publish, nostr_verify

#: (point, index of the EVENT frame for relay-side points)
POINTS: tuple[tuple[str, int], ...] = (
    ("before_pending", 0),
    ("after_pending", 0),
    ("event_unsent", 0),
    ("event_stored", 0),
    ("ok_delivered", 0),
    ("after_verdict", 0),
)
#: agents.create's extra points: between its first and second, and after its last event.
CREATE_EXTRA: tuple[tuple[str, int], ...] = (("event_stored", 1), ("ok_delivered", 2))
CASES = [(a, p, i) for a in ("message.post", "message.reply", "agents.create", "storage.put",
                             "typing.set")
         for p, i in POINTS] + [("agents.create", p, i) for p, i in CREATE_EXTRA]
CHECKPOINT_STEPS = {"before_pending", "after_pending", "after_verdict"}
SIGKILLED = -9
#: storage.put's plaintexts: never in the state directory, whatever point it died at.
MEMORY_VALUE = "crash-point memory plaintext: kestrel 7391"
MEMORY_SLUG = "mem/crash/slug-kestrel"


class RefusingProxy(KillingProxy):
    """A `KillingProxy` that answers the next `refuse` EVENT frames itself, OK false
    (`blocked:`), and never forwards them: a relay refusal at a frame boundary."""

    refuse = 0

    async def _pump_up(self, client: Any, up: Any, scope: trio.CancelScope) -> None:
        try:
            while True:
                text = await client.get_message()
                frame = json.loads(text)
                if self.refuse and frame[0] == "EVENT":
                    self.refuse -= 1
                    await client.send_message(json.dumps(
                        ["OK", frame[1]["id"], False, "blocked: refused by the crash test"]))
                    continue
                await up.send_message(text)
        except trio_websocket.ConnectionClosed:
            scope.cancel()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="bb-crash-") as name:
        yield Path(name)


@pytest.fixture
async def proxy(nursery: trio.Nursery, local_relay_open: str) -> AsyncIterator[KillingProxy]:
    relay_proxy = KillingProxy(local_relay_open)
    await nursery.start(relay_proxy.serve, free_port())
    yield relay_proxy


def _fetch(url: str, flt: dict[str, Any]) -> Any:
    return trio.to_thread.run_sync(nostr_fetch, url, [flt])


@dataclass(frozen=True)
class Scene:
    body: bytes
    request_id: str
    channel: str


@dataclass(frozen=True, slots=True)
class Stage:
    """What a crash test runs against: an agent and its credential, a daemon's socket and
    configuration (its relay behind `relay_url`), and the request it sends."""

    requester: AgentState
    socket: Path
    config: Path
    scene: Scene


async def _stage(action: str, custody_state: tuple[TokenConfig, Path], short_dir: Path,
                 relay_url: str, local_relay_open: str) -> Stage:
    token, state_dir = custody_state
    channel = str(uuid.uuid4())
    requester = await setup_state(token, state_dir, [channel])
    socket = short_dir / "b.sock"
    config = write_config(short_dir / "broker.toml", token=token, state_dir=state_dir,
                          socket=socket, relay_url=relay_url)
    return Stage(requester, socket, config, await _scene(action, channel, local_relay_open))


async def _scene(action: str, channel: str, relay_url: str) -> Scene:
    request_id = str(uuid.uuid4())
    if action == "message.post":
        args: dict[str, Any] = {"channelId": channel, "content": f"crash test {request_id}"}
    elif action == "storage.put":
        args = {"slug": f"{MEMORY_SLUG}-{request_id}", "value": MEMORY_VALUE}
    elif action == "message.reply":
        # The parent is published by an independent key straight to the relay, so the
        # daemon under test passes no checkpoint before the request that crashes it.
        author = TestKey()
        parent = author.sign(9, "parent", [["h", channel]])
        assert await trio.to_thread.run_sync(nostr_publish, relay_url, parent, author.secret_hex)
        args = {"channelId": channel, "replyToEventId": parent["id"], "content": "a reply"}
    elif action == "typing.set":
        args = {"channelId": channel}
    else:
        args = {"channelId": channel, "displayName": "Minted", "systemPrompt": "be brief"}
    return Scene(request_body(action, args, request_id=request_id), request_id, channel)


@pytest.mark.parametrize(("action", "point", "index"), CASES,
                         ids=[f"{a}-{p}-{i}" for a, p, i in CASES])
async def test_sigkill_then_identical_retry_finishes_exactly_once(
    action: str, point: str, index: int, custody_state: tuple[TokenConfig, Path],
    local_relay_open: str, proxy: KillingProxy, short_dir: Path,
) -> None:
    state_dir = custody_state[1]
    stage = await _stage(action, custody_state, short_dir, proxy.url, local_relay_open)
    requester, socket, config, scene = stage.requester, stage.socket, stage.config, stage.scene
    channel = scene.channel

    step = point if point in CHECKPOINT_STEPS else "none"
    first = await DaemonProcess.start(config, socket, step=step)
    try:
        if step == "none":
            proxy.arm(first.pid, Moment(point), index)
        answer = await post(socket, scene.body, requester.credential)
        assert answer is None, f"killed at {point}, yet answered: {answer}"
        assert await first.wait_exit(10.0) == SIGKILLED, first.log()[-2000:]
        if step == "none":
            assert proxy.fired.is_set()
    finally:
        first.kill()
    pending = pending_event_ids(state_dir, requester.agent, scene.request_id)
    assert (pending is None) == (point == "before_pending"), pending
    if action == "storage.put":
        # The pending record holds the signed ciphertext event, never the arguments.
        for path, data in files_under(state_dir):
            assert MEMORY_VALUE.encode() not in data and MEMORY_SLUG.encode() not in data, path

    second = await DaemonProcess.start(config, socket)
    try:
        retried = envelope(await post(socket, scene.body, requester.credential))
        assert retried["status"] == "succeeded", (retried.get("error"), second.log()[-3000:])
        assert retried["requestId"] == scene.request_id
        assert retried.get("replayed", False) is (point == "after_verdict")
        again = envelope(await post(socket, scene.body, requester.credential))
        assert again == {**retried, "replayed": True}
        assert await second.stop() == 0
    finally:
        second.kill()

    outcome = retried["outcome"]
    if action == "typing.set":
        # A live signal is ephemeral: the relay forwards it and keeps nothing, so there is
        # no copy to count. What a crash must not do is sign a second signal: the retry
        # finishes with the very event the pending record committed.
        assert outcome["kind"] == 20002
        if pending is not None:
            assert sorted(pending) == [outcome["eventId"]]
        return
    if action == "storage.put":
        found = await _fetch(local_relay_open, {"kinds": [30174], "authors": [requester.agent]})
        assert [e["id"] for e in found] == [outcome["eventId"]], found
        on_relay = {e["id"]: e for e in found}
    elif action == "agents.create":
        on_relay = await _created_effects(local_relay_open, state_dir, requester.agent, channel,
                                           outcome)
    else:
        on_relay = await _message_effects(local_relay_open, channel, outcome, action)
    if pending is not None:
        # The retry re-sent exactly the committed events: the original ids, nothing new.
        assert sorted(on_relay) == sorted(pending)
    for event in on_relay.values():
        assert nostr_verify(event)


async def _message_effects(relay: str, channel: str, outcome: dict[str, Any],
                           action: str) -> dict[str, dict[str, Any]]:
    found = await _fetch(relay, {"kinds": [9], "#h": [channel]})
    ours = [e for e in found if e["content"] != "parent"]
    assert len(found) == (2 if action == "message.reply" else 1), found
    assert len(ours) == 1, ours
    assert ours[0]["id"] == outcome["eventId"]
    return {e["id"]: e for e in ours}


async def _created_effects(relay: str, state_dir: Path, owner: str, channel: str,
                           outcome: dict[str, Any]) -> dict[str, dict[str, Any]]:
    minted = [r for r in AgentDirectory.open(state_dir).agents(include_deleted=True)
              if r.owner == owner]
    assert [r.pubkey for r in minted] == [outcome["agentPubkey"]], minted
    assert minted[0].deleted_at is None
    agent = outcome["agentPubkey"]
    put_user = await _fetch(relay, {"kinds": [9000], "#h": [channel]})
    records = await _fetch(relay, {"kinds": [30177], "authors": [owner]})
    profiles = await _fetch(relay, {"kinds": [0], "authors": [agent]})
    for found in (put_user, records, profiles):
        assert len(found) == 1, found
    assert put_user[0]["tags"] == [["h", channel], ["p", agent], ["role", "bot"]]
    assert json.loads(records[0]["content"])["name"] == "Minted"
    return {e["id"]: e for e in (*put_user, *records, *profiles)}


def _created_by(state_dir: Path, owner: str) -> list[Any]:
    directory = AgentDirectory.open(state_dir)
    try:
        return [a for a in directory.agents(include_deleted=True) if a.owner == owner]
    finally:
        directory.close()


#: What the daemon restarted after a kill at before_pending runs under, and what the
#: identical retry of the create must then answer: (config sections, an unrelated create
#: first, the retry's (status, code)).
RECORDED_RETRIES: dict[str, tuple[dict[str, dict[str, object]], bool, tuple[str, str | None]]] = {
    # The killed attempt paid the day's one create; the other create pays again, and the
    # retry of the reserved record pays nothing (docs/operations.md "A replay costs no quota").
    "quota_spent": ({"limits": {"rules": ["agents.create=1/day"]}}, True, ("succeeded", None)),
    # Policy changed while it was down: refused before it runs, the earlier key destroyed.
    "now_disabled": ({"policy": {"disabled_actions": ["agents.create"]}}, False,
                     ("failed", "unsupported")),
}


@pytest.mark.parametrize("restart", sorted(RECORDED_RETRIES))
async def test_create_killed_before_pending_then_retried_leaves_no_orphan_key(
    restart: str, custody_state: tuple[TokenConfig, Path], local_relay_open: str,
    short_dir: Path,
) -> None:
    sections, other_first, expected = RECORDED_RETRIES[restart]
    token, state_dir = custody_state
    channel = str(uuid.uuid4())
    requester = await setup_state(token, state_dir, [channel])
    socket = short_dir / "b.sock"
    plain = write_config(short_dir / "a.toml", token=token, state_dir=state_dir,
                         socket=socket, relay_url=local_relay_open)
    changed = write_config(short_dir / "b.toml", token=token, state_dir=state_dir,
                           socket=socket, relay_url=local_relay_open, sections=sections)
    args = {"channelId": channel, "displayName": "Helper", "systemPrompt": "be brief"}
    body = request_body("agents.create", args)
    first = await DaemonProcess.start(plain, socket, step="before_pending")
    try:
        assert await post(socket, body, requester.credential) is None
        assert await first.wait_exit(10.0) == SIGKILLED, first.log()[-2000:]
    finally:
        first.kill()
    [killed] = _created_by(state_dir, requester.agent)  # minted, bound to its reserved record

    second = await DaemonProcess.start(changed, socket)
    try:
        if other_first:
            other = envelope(await post(socket, request_body("agents.create", args),
                                        requester.credential))
            assert other["status"] == "succeeded", other
        retried = envelope(await post(socket, body, requester.credential))
        assert (retried["status"], retried.get("error", {}).get("code")) == expected, retried
        again = envelope(await post(socket, body, requester.credential))
        assert again == {**retried, "replayed": True}
        assert await second.stop() == 0
    finally:
        second.kill()

    live = {a.pubkey for a in _created_by(state_dir, requester.agent) if a.live}
    if retried["status"] == "succeeded":
        # The retry carried on with the key the killed attempt minted, not a second one.
        assert retried["outcome"]["agentPubkey"] == killed.pubkey
        assert killed.pubkey in live and len(live) == 2
    else:
        # failed promises nothing happened: the killed attempt's key is destroyed too.
        assert live == set()


@pytest.mark.parametrize("action", ["message.post", "agents.create"])
async def test_refused_then_killed_before_its_verdict_is_never_published(
    action: str, nursery: trio.Nursery, custody_state: tuple[TokenConfig, Path],
    local_relay_open: str, short_dir: Path,
) -> None:
    from daemon.state.ledger import State, read_record

    refusing = RefusingProxy(local_relay_open)
    await nursery.start(refusing.serve, free_port())
    state_dir = custody_state[1]
    stage = await _stage(action, custody_state, short_dir, refusing.url, local_relay_open)
    requester, socket, config, scene = stage.requester, stage.socket, stage.config, stage.scene
    channel = scene.channel

    refusing.refuse = 1
    first = await DaemonProcess.start(config, socket, step="before_verdict")
    try:
        assert await post(socket, scene.body, requester.credential) is None
        assert await first.wait_exit(10.0) == SIGKILLED, first.log()[-2000:]
    finally:
        first.kill()
    assert refusing.refuse == 0
    record = read_record(state_dir / "ledger.db", requester.agent, scene.request_id)
    assert record is not None and record[0] is State.ROLLED_BACK, record

    second = await DaemonProcess.start(config, socket)
    try:
        retried = envelope(await post(socket, scene.body, requester.credential))
        assert (retried["status"], retried["error"]["code"]) == ("failed", "action_failed"), (
            retried, second.log()[-3000:])
        assert retried.get("replayed") is True
        again = envelope(await post(socket, scene.body, requester.credential))
        assert again == retried
        assert await second.stop() == 0
    finally:
        second.kill()

    # Nothing of the request on the relay, read directly by an independent client.
    assert await _fetch(local_relay_open, {"kinds": [9, 9000], "#h": [channel]}) == []
    if action == "agents.create":
        assert await _fetch(local_relay_open, {"kinds": [30177],
                                               "authors": [requester.agent]}) == []
        [made] = _created_by(state_dir, requester.agent)  # the one key, destroyed
        assert not made.live
