"""Relay data is checked before it is signed over (issue 13, item 6).

Attack: a malicious relay answers the daemon's reads with events of its choosing, so that
an owner re-signs what the relay picked:
- agents.update merges "the previous 30177 record" and the owner signs the merge. The relay
  substitutes another agent's record (same owner, another `d`), a record by another author
  for this agent, or another kind of event by the owner. Each is `failed` + `action_failed`.
- message.reply copies its parent's root `e` value into the signed reply. The relay serves a
  (validly signed) parent whose root is not an event id, names a root no event has, a root
  in another channel or one that is itself a reply, names two roots, or threads by NIP-10's
  positional `e` tags (NIP-BA: missing or inconsistent ancestry fails before publication,
  and a nested parent is never taken for the root). `failed` + `action_failed`.
- message.reply and reaction.add build on an event carrying the channel's `h` tag beside
  another channel's, in either order. `failed` + `action_failed`, as channel.read drops it.
In every refused case nothing is signed and nothing is published. Positive controls (the
exact record; a root in the channel, as Buzz writes its threads) succeed through the same
rig, so a refusal here is the check's and not a broken rig's.

The relay is tests/scripted_relay.py: it answers every REQ with every event it holds,
unfiltered, which is exactly a relay that substitutes.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from custody import TokenConfig, UnsignedEvent
from daemon.pipeline import signing
from daemon.wiring import running
from daemon.config import load_config
from daemon.http import HttpLimits, action_routes, serve
from tests.fixtures.broker import BrokerHarness, write_config
from tests.fixtures.relay import TestKey, free_port
from tests.scripted_relay import Script, ScriptedRelay

CHANNEL = str(uuid.uuid4())
KIND_RECORD = 30177


@dataclass
class Rig:
    harness: BrokerHarness
    relay: ScriptedRelay
    signed: list[int]  # one entry per SigningBatcher.sign call, with its batch size

    def published(self) -> list[dict[str, Any]]:
        return [m[1] for m in self.relay.received if m[0] == "EVENT"]

    async def sign_as(self, author: str, kind: int, tags: list[list[str]], content: str
                      ) -> dict[str, Any]:
        """An event signed in custody by an agent this daemon holds (the owner)."""
        event = await self.harness.custody.sign_event(author, UnsignedEvent(
            pubkey=author, created_at=1_700_000_000, kind=kind,
            tags=tuple(tuple(t) for t in tags), content=content))
        return dict(event.to_json_obj())

    def serve(self, event: dict[str, Any]) -> None:
        self.relay.stored[event["id"]] = event


@pytest.fixture
async def rig(nursery: trio.Nursery, custody_state: tuple[TokenConfig, Path],
              monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    token, state_dir = custody_state
    relay = ScriptedRelay(Script())
    await nursery.start(relay.serve, free_port())
    signed: list[int] = []
    real_sign = signing.SigningBatcher.sign

    async def counting(self: signing.SigningBatcher, requests: Any) -> Any:
        signed.append(len(requests))
        return await real_sign(self, requests)

    monkeypatch.setattr(signing.SigningBatcher, "sign", counting)
    with tempfile.TemporaryDirectory(prefix="bb-sub-") as short:
        socket = Path(short) / "b.sock"
        config_path = write_config(Path(short) / "broker.toml", token=token, state_dir=state_dir,
                                   socket=socket, relay_url=relay.url, relay_timeout=2.0,
                                   # the model the updates name, declared (NIP-BA)
                                   sections={"policy": {"models": ["m2"]}})
        config = load_config(str(config_path), environ={})
        async with running(config) as app:
            async with trio.open_nursery() as inner:
                control = await inner.start(serve, action_routes(app), str(socket),
                                            HttpLimits(request_timeout=10.0, shutdown_grace=2.0))
                yield Rig(BrokerHarness(socket=socket, config=config, config_path=config_path,
                                        state_dir=state_dir, relay_url=relay.url, app=app,
                                        control=control, custody=app.custody,
                                        _sessions=app.sessions), relay, signed)
                inner.cancel_scope.cancel()


async def _owner_and_agents(rig: Rig) -> tuple[str, str, str, str]:
    """An owner held here with two managed agents, and the owner's credential."""
    h = rig.harness
    owner = await h.human_owned_agent("owner")
    target = (await h.custody.mint_agent(owner=owner,
                                         mint_ref=None)).pubkey
    other = (await h.custody.mint_agent(owner=owner,
                                        mint_ref=None)).pubkey
    return owner, target, other, h.credential(owner, [CHANNEL])


def _record(name: str, prompt: str) -> str:
    return json.dumps({"name": name, "system_prompt": prompt, "parallelism": 1,
                       "respond_to": "owner-only"})


def _refused(envelope: dict[str, Any]) -> None:
    assert envelope["status"] == "failed", envelope
    assert envelope["error"]["code"] == "action_failed", envelope


#: name -> how the relay's substitute is made: (rig, owner, target, other) -> event
Substitute = Callable[[Rig, str, str, str], Any]
SUBSTITUTES: dict[str, Substitute] = {
    "another agent's record": lambda rig, owner, target, other: rig.sign_as(
        owner, KIND_RECORD, [["d", other]], _record("other", "the other agent's prompt")),
    "another author's record": lambda rig, owner, target, other: _signed_by_stranger(
        KIND_RECORD, [["d", target]], _record("target", "a stranger's prompt")),
    "another kind by the owner": lambda rig, owner, target, other: rig.sign_as(
        owner, 30078, [["d", target]], _record("target", "not a managed record")),
    "the record without its d tag": lambda rig, owner, target, other: rig.sign_as(
        owner, KIND_RECORD, [], _record("target", "no d tag")),
}


async def _signed_by_stranger(kind: int, tags: list[list[str]], content: str) -> dict[str, Any]:
    return TestKey().sign(kind, content, tags, created_at=1_700_000_000)


@pytest.mark.parametrize("substitute", sorted(SUBSTITUTES))
async def test_a_substituted_record_is_refused_and_nothing_signed(
    rig: Rig, substitute: str
) -> None:
    owner, target, other, credential = await _owner_and_agents(rig)
    rig.serve(await SUBSTITUTES[substitute](rig, owner, target, other))
    signs_before, published_before = len(rig.signed), len(rig.published())

    _refused(await rig.harness.call(credential, "agents.update",
                                    {"target": {"pubkey": target}, "model": "m2"}))
    assert len(rig.signed) == signs_before, "nothing may be signed over a substituted record"
    assert len(rig.published()) == published_before, "nothing may be published"


async def test_control_the_exact_record_is_merged(rig: Rig) -> None:
    owner, target, _other, credential = await _owner_and_agents(rig)
    rig.serve(await rig.sign_as(owner, KIND_RECORD, [["d", target]],
                                _record("target", "kept prompt")))
    answer = await rig.harness.call(credential, "agents.update",
                                    {"target": {"pubkey": target}, "model": "m2"})
    assert answer["status"] == "succeeded", answer
    [record] = [e for e in rig.published() if e["kind"] == KIND_RECORD]
    assert record["pubkey"] == owner and ["d", target] in record["tags"]
    content = json.loads(record["content"])
    assert (content["system_prompt"], content["model"]) == ("kept prompt", "m2")


#: name -> the parent's thread tags (after its `h` tag); each names a root that is no event id.
BAD_ROOTS: dict[str, list[list[str]]] = {
    "not hex": [["e", "not-an-event-id", "", "root"]],
    "uppercase hex": [["e", "AB" * 32, "", "root"]],
    "63 hex": [["e", "a" * 63, "", "root"]],
    "65 hex": [["e", "a" * 65, "", "root"]],
    "empty": [["e", "", "", "root"]],
    "bad reply-marked root": [["e", "zz" * 32, "", "reply"]],
}


async def _reply_refused_unsigned(rig: Rig, credential: str, parent: dict[str, Any],
                                  what: str) -> None:
    """A reply to `parent` is refused, and nothing is signed or published over `what`."""
    signs_before, published_before = len(rig.signed), len(rig.published())
    _refused(await rig.harness.call(credential, "message.reply", {
        "channelId": CHANNEL, "replyToEventId": parent["id"], "content": "hi"}))
    assert len(rig.signed) == signs_before, f"nothing may be signed over {what}"
    assert len(rig.published()) == published_before, "nothing may be published"


@pytest.mark.parametrize("bad", sorted(BAD_ROOTS))
async def test_a_parent_with_a_bad_root_id_is_refused_and_nothing_signed(
    rig: Rig, bad: str
) -> None:
    author = await rig.harness.human_owned_agent("replier")
    credential = rig.harness.credential(author, [CHANNEL])
    parent = TestKey().sign(9, "parent", [["h", CHANNEL], *BAD_ROOTS[bad]])
    rig.serve(parent)
    await _reply_refused_unsigned(rig, credential, parent, "a bad root id")


OTHER_CHANNEL = str(uuid.uuid4())


def _event(content: str, channel: str, *threading: list[str]) -> dict[str, Any]:
    """A stranger's kind 9 in `channel` with `threading` (its `e` tags) after its `h` tag."""
    return TestKey().sign(9, content, [["h", channel], *threading])


def _marked(event_id: str, marker: str) -> list[str]:
    return ["e", event_id, "", marker]


def _root_elsewhere() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    root = _event("root", OTHER_CHANNEL)
    return [root], _event("parent", CHANNEL, _marked(root["id"], "root"))


def _root_that_replies() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    top = _event("top", CHANNEL)
    root = _event("root", CHANNEL, _marked(top["id"], "reply"))
    return [top, root], _event("parent", CHANNEL, _marked(root["id"], "root"))


def _positional(*extra: str) -> Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]]:
    def build() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        root = _event("root", CHANNEL)
        return [root], _event("parent", CHANNEL, ["e", root["id"], *extra])
    return build


def _two(marker: str) -> Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]]:
    def build() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        first, second = _event("first", CHANNEL), _event("second", CHANNEL)
        return [first, second], _event("parent", CHANNEL, _marked(first["id"], marker),
                                       _marked(second["id"], marker))
    return build


#: name -> (the events the relay also holds, the parent); each parent's ancestry is missing,
#: elsewhere, unreadable or inconsistent (NIP-BA "Channel and messages").
BAD_ANCESTRY: dict[str, Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]]] = {
    "a root no event has": lambda: ([], _event("parent", CHANNEL, _marked("ab" * 32, "root"))),
    "a reply-marked root no event has": lambda: (
        [], _event("parent", CHANNEL, _marked("ab" * 32, "reply"))),
    "a root in another channel": _root_elsewhere,
    "a root that is itself a reply": _root_that_replies,
    "a positional e tag": _positional(),
    "a positional e tag with a relay hint": _positional("wss://relay.example"),
    "an e tag with an empty marker": _positional("", ""),
    "an e tag with an unknown marker": _positional("", "quote"),
    "two different roots": _two("root"),
    "two different parents and no root": _two("reply"),
}


@pytest.mark.parametrize("bad", sorted(BAD_ANCESTRY))
async def test_a_parent_with_bad_ancestry_is_refused_and_nothing_signed(
    rig: Rig, bad: str
) -> None:
    author = await rig.harness.human_owned_agent("replier")
    credential = rig.harness.credential(author, [CHANNEL, OTHER_CHANNEL])
    held, parent = BAD_ANCESTRY[bad]()
    for event in (*held, parent):
        rig.serve(event)
    await _reply_refused_unsigned(rig, credential, parent, "bad ancestry")


def _threads(root: str, parent: str) -> list[list[str]]:
    return [_marked(root, "root"), _marked(parent, "reply")]


#: name -> the parent's e tags given the root's id; each is how a Buzz thread is written (or
#: reads the same), and the reply names that root.
GOOD_ANCESTRY: dict[str, Callable[[str], list[list[str]]]] = {
    "a root-marked root": lambda root: [_marked(root, "root")],
    "Buzz's direct reply: only reply-marked": lambda root: [_marked(root, "reply")],
    "Buzz's nested reply: root, then reply": lambda root: _threads(root, "cd" * 32),
    "the same root twice": lambda root: [_marked(root, "root"), _marked(root, "root")],
    "a root and a mention": lambda root: [_marked(root, "root"), _marked("cd" * 32, "mention")],
}


@pytest.mark.parametrize("good", sorted(GOOD_ANCESTRY))
async def test_control_a_root_in_the_channel_is_copied(rig: Rig, good: str) -> None:
    author = await rig.harness.human_owned_agent("replier")
    credential = rig.harness.credential(author, [CHANNEL])
    root = _event("root", CHANNEL, _marked("ef" * 32, "mention"))  # a mention keeps a root one
    parent = _event("parent", CHANNEL, *GOOD_ANCESTRY[good](root["id"]))
    rig.serve(root)
    rig.serve(parent)
    answer = await rig.harness.call(credential, "message.reply", {
        "channelId": CHANNEL, "replyToEventId": parent["id"], "content": "hi"})
    assert answer["status"] == "succeeded", answer
    [reply] = [e for e in rig.published() if e["pubkey"] == author]
    assert [t for t in reply["tags"] if t[0] == "e"] == _threads(root["id"], parent["id"])


async def test_control_a_reply_to_a_root_names_only_its_parent(rig: Rig) -> None:
    author = await rig.harness.human_owned_agent("replier")
    credential = rig.harness.credential(author, [CHANNEL])
    parent = _event("top", CHANNEL, _marked("ef" * 32, "mention"))
    rig.serve(parent)
    answer = await rig.harness.call(credential, "message.reply", {
        "channelId": CHANNEL, "replyToEventId": parent["id"], "content": "hi"})
    assert answer["status"] == "succeeded", answer
    [reply] = [e for e in rig.published() if e["pubkey"] == author]
    assert [t for t in reply["tags"] if t[0] == "e"] == [_marked(parent["id"], "reply")]


#: action -> its args naming `target` in CHANNEL.
BUILDS_ON: dict[str, Callable[[str], dict[str, str]]] = {
    "message.reply": lambda target: {"channelId": CHANNEL, "replyToEventId": target,
                                     "content": "hi"},
    "reaction.add": lambda target: {"channelId": CHANNEL, "targetEventId": target,
                                    "reaction": "+"},
}


@pytest.mark.parametrize("mine_first", [True, False], ids=["mine first", "mine second"])
@pytest.mark.parametrize("action", sorted(BUILDS_ON))
async def test_an_event_in_two_channels_is_not_built_on_in_either_order(
    rig: Rig, action: str, mine_first: bool
) -> None:
    # channel.read drops such an event (`_channel_ok`); a reply or reaction must not build
    # on it either, whatever order its author gave the h tags (one rule: `in_channel`).
    author = await rig.harness.human_owned_agent("builder")
    credential = rig.harness.credential(author, [CHANNEL])
    channels = [CHANNEL, OTHER_CHANNEL] if mine_first else [OTHER_CHANNEL, CHANNEL]
    target = TestKey().sign(9, "filed twice", [["h", channel] for channel in channels])
    rig.serve(target)
    signs_before, published_before = len(rig.signed), len(rig.published())

    _refused(await rig.harness.call(credential, action, BUILDS_ON[action](target["id"])))
    assert len(rig.signed) == signs_before, "nothing may be signed over another channel's event"
    assert len(rig.published()) == published_before, "nothing may be published"


# --- issue 22, defences no test guarded (docs/reliability.md "Defences and the tests that
# guard them", rows 1-3). Each test below fails when its one defence alone is disabled.

def _with_bad_id(event: dict[str, Any], content: str) -> dict[str, Any]:
    """The event with `content` changed and its id and signature kept: the id no longer
    binds the content (the signature is still valid over the id)."""
    return {**event, "content": content}


def _with_bad_sig(event: dict[str, Any], content: str) -> dict[str, Any]:
    """The event with `content` changed and its id recomputed: the id is right, the
    signature is over another id."""
    from tests.scripted_relay import _event_id

    forged = {**event, "content": content}
    forged["id"] = _event_id(forged)
    return forged


FORGERIES: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    "bad id": _with_bad_id,
    "bad signature": _with_bad_sig,
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
async def test_agents_update_does_not_merge_a_forged_record(rig: Rig, forgery: str) -> None:
    # Defence 1 (operations/_events.py `verified`): the owner's record with a forged prompt.
    owner, target, _other, credential = await _owner_and_agents(rig)
    genuine = await rig.sign_as(owner, KIND_RECORD, [["d", target]], _record("target", "kept"))
    rig.serve(FORGERIES[forgery](genuine, _record("target", "FORGED prompt")))
    answer = await rig.harness.call(credential, "agents.update",
                                    {"target": {"pubkey": target}, "model": "m2"})
    assert answer["status"] == "succeeded", answer
    [record] = [e for e in rig.published() if e["kind"] == KIND_RECORD]
    assert "FORGED" not in record["content"], "a forged record was merged and re-signed"


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
async def test_profile_set_does_not_merge_a_forged_profile(rig: Rig, forgery: str) -> None:
    # Defence 1: the agent's own kind 0 with a forged lud16.
    agent = await rig.harness.human_owned_agent("profiled")
    credential = rig.harness.credential(agent, [CHANNEL])
    genuine = await rig.sign_as(agent, 0, [], json.dumps({"name": "profiled"}))
    rig.serve(FORGERIES[forgery](genuine, json.dumps({"lud16": "FORGED@example.org"})))
    answer = await rig.harness.call(credential, "profile.set", {"about": "new"})
    assert answer["status"] == "succeeded", answer
    [profile] = [e for e in rig.published() if e["kind"] == 0 and e["pubkey"] == agent]
    assert "FORGED" not in profile["content"], "a forged profile was merged and re-signed"


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
@pytest.mark.parametrize("action", ["message.reply", "reaction.add"])
async def test_a_forged_target_event_is_not_built_on(rig: Rig, action: str, forgery: str) -> None:
    # Defence 1: the event replied or reacted to does not verify: it is "not found".
    author = await rig.harness.human_owned_agent("builder")
    credential = rig.harness.credential(author, [CHANNEL])
    genuine = TestKey().sign(9, "parent", [["h", CHANNEL]])
    forged = FORGERIES[forgery](genuine, "FORGED parent")
    rig.serve(forged)
    signs_before, published_before = len(rig.signed), len(rig.published())
    args = ({"channelId": CHANNEL, "replyToEventId": forged["id"], "content": "hi"}
            if action == "message.reply" else
            {"channelId": CHANNEL, "targetEventId": forged["id"], "reaction": "+"})
    _refused(await rig.harness.call(credential, action, args))
    assert len(rig.signed) == signs_before, "nothing may be signed over a forged event"
    assert len(rig.published()) == published_before, "nothing may be published"


#: name -> a validly signed event that is not the agent's kind 0: (rig, agent) -> event
NOT_THE_PROFILE: dict[str, Callable[[Rig, str], Any]] = {
    "a foreign author's kind 0": lambda rig, agent: _signed_by_stranger(
        0, [], json.dumps({"lud16": "STRANGER@example.org", "nip05": "STRANGER@example.org"})),
    "the agent's own event of another kind": lambda rig, agent: rig.sign_as(
        agent, 30078, [["d", "x"]], json.dumps({"lud16": "STRANGER@example.org"})),
}


@pytest.mark.parametrize("which", sorted(NOT_THE_PROFILE))
async def test_profile_set_merges_only_the_agents_own_kind_0(rig: Rig, which: str) -> None:
    # Defence 2 (operations/profile_set.py `current_profile`'s author and kind filter): the
    # relay answers the kind-0 query with something else, newer than anything real.
    agent = await rig.harness.human_owned_agent("profiled")
    credential = rig.harness.credential(agent, [CHANNEL])
    rig.serve(await NOT_THE_PROFILE[which](rig, agent))
    answer = await rig.harness.call(credential, "profile.set", {"about": "mine"})
    assert answer["status"] == "succeeded", answer
    [profile] = [e for e in rig.published() if e["kind"] == 0 and e["pubkey"] == agent]
    assert "STRANGER" not in profile["content"], "another event was merged into the profile"
    assert json.loads(profile["content"]) == {"about": "mine"}


async def test_a_cached_signature_does_not_vouch_for_changed_content(rig: Rig) -> None:
    # Defence 3 (operations/channel_read.py `JudgedCache`): once an event's signature
    # is cached, the relay serves the same id and signature over other content.
    reader = await rig.harness.human_owned_agent("reader")
    credential = rig.harness.credential(reader, [CHANNEL])
    genuine = TestKey().sign(9, "genuine words", [["h", CHANNEL]])
    rig.serve(genuine)
    # A limit above the read windows' depth (daemon/relay/windows.py): both reads go to the
    # relay, which is where the substitution happens.
    read = {"channelId": CHANNEL, "limit": 200}
    first = await rig.harness.call(credential, "channel.read", read)
    assert first["status"] == "succeeded", first
    assert [m["content"] for m in first["outcome"]["messages"]] == ["genuine words"]
    rig.relay.stored[genuine["id"]] = {**genuine, "content": "FORGED words"}
    second = await rig.harness.call(credential, "channel.read", read)
    assert second["status"] == "succeeded", second
    assert second["outcome"]["messages"] == [], "a cache hit delivered content never signed"


# --- issue 22 L4: a relay that withholds the latest version -------------------------------

def _withhold(rig: Rig, event: dict[str, Any]) -> None:
    """The relay forgets `event` (it serves only what it held before)."""
    del rig.relay.stored[event["id"]]


async def test_agents_update_refuses_to_build_on_an_older_record(rig: Rig) -> None:
    owner, target, _other, credential = await _owner_and_agents(rig)
    rig.serve(await rig.sign_as(owner, KIND_RECORD, [["d", target]], _record("target", "old")))
    answer = await rig.harness.call(credential, "agents.update", {
        "target": {"pubkey": target}, "systemPrompt": "the new prompt"})
    assert answer["status"] == "succeeded", answer
    [latest] = [e for e in rig.published() if e["kind"] == KIND_RECORD]
    _withhold(rig, latest)  # the relay now calls the "old" prompt's version newest
    signs_before, published_before = len(rig.signed), len(rig.published())

    _refused(await rig.harness.call(credential, "agents.update",
                                    {"target": {"pubkey": target}, "model": "m2"}))
    assert len(rig.signed) == signs_before, "nothing may be signed over an older version"
    assert len(rig.published()) == published_before, "nothing may be published"
    rig.serve(latest)  # control: the relay serves the latest again, and it is built on
    answer = await rig.harness.call(credential, "agents.update",
                                    {"target": {"pubkey": target}, "model": "m2"})
    assert answer["status"] == "succeeded", answer
    newest_record = [e for e in rig.published() if e["kind"] == KIND_RECORD][-1]
    assert json.loads(newest_record["content"])["system_prompt"] == "the new prompt"


@pytest.mark.parametrize("served", ["an older version", "nothing"])
async def test_profile_set_refuses_to_build_on_an_older_profile(rig: Rig, served: str) -> None:
    agent = await rig.harness.human_owned_agent("profiled")
    credential = rig.harness.credential(agent, [CHANNEL])
    old = await rig.sign_as(agent, 0, [], json.dumps({"lud16": "old@example.org"}))
    rig.serve(old)
    answer = await rig.harness.call(credential, "profile.set", {"about": "latest"})
    assert answer["status"] == "succeeded", answer
    [latest] = [e for e in rig.published() if e["kind"] == 0 and e["pubkey"] == agent]
    _withhold(rig, latest)
    if served == "nothing":
        _withhold(rig, old)
    signs_before, published_before = len(rig.signed), len(rig.published())

    _refused(await rig.harness.call(credential, "profile.set", {"about": "again"}))
    assert len(rig.signed) == signs_before, "nothing may be signed over an older version"
    assert len(rig.published()) == published_before, "nothing may be published"


# --- issue 22 M2 end to end: a relay whose events decode to far more than their frames -----

async def test_a_tag_flood_read_fails_cleanly_and_the_daemon_serves_on(rig: Rig) -> None:
    # Two events of 100,000 one-letter tags each: ~600 KB frames, ~14 MiB decoded each, so
    # together past the query's 16 MiB bound although their frames are 1.2 MB.
    reader = await rig.harness.human_owned_agent("reader")
    credential = rig.harness.credential(reader, [CHANNEL])
    flood = [TestKey().sign(9, f"flood {n}", [["h", CHANNEL]] + [["a"]] * 100_000)
             for n in range(2)]
    for event in flood:
        rig.serve(event)
    pool = rig.harness.app._relay  # the daemon's own pool: its budget's accounting
    _refused(await rig.harness.call(credential, "channel.read", {"channelId": CHANNEL}))
    assert pool.result_bytes_held == 0, "the failed read holds nothing"
    for event in flood:
        _withhold(rig, event)
    rig.serve(TestKey().sign(9, "honest", [["h", CHANNEL]]))
    answer = await rig.harness.call(credential, "channel.read", {"channelId": CHANNEL})
    assert answer["status"] == "succeeded", answer
    assert [m["content"] for m in answer["outcome"]["messages"]] == ["honest"]
