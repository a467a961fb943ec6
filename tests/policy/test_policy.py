"""Authorization, driven by the same tables daemon/pipeline/policy reads, over real Principals
(issued and authenticated by a real SessionStore) and real contract Requests."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import coincurve
import pytest

from daemon.config import PolicyConfig
from buzzwire.contract import (
    ACTIONS,
    PAIRING,
    AgentsDeleteArgs,
    AgentsUpdateArgs,
    ContractError,
    ErrorCode,
    Request,
    Status,
    build_request,
)
from daemon.pipeline.policy import (
    CHANNEL_ACTIONS,
    CHECKS,
    CHOICE_ACTIONS,
    CHOICES,
    REFUSALS,
    RUNTIME_ACTIONS,
    TARGET_ACTIONS,
    Authorized,
    Refusal,
    authorize,
    resolve_target,
)
from daemon.state.sessions import Principal, SessionStore

CHANNEL = "123e4567-e89b-12d3-a456-426614174000"
OTHER_CHANNEL = "223e4567-e89b-12d3-a456-426614174000"
EVENT = "ee" * 32
NOW = 1_800_000_000


def pubkey(n: int) -> str:
    # The x coordinate of a real secp256k1 point: the contract accepts only those.
    return coincurve.PrivateKey(n.to_bytes(32, "big")).public_key.format()[1:].hex()


HUMAN = pubkey(1)
ME = pubkey(2)  # owned by HUMAN: depth 1
CHILD = pubkey(3)  # owned by ME: depth 2
DEAD_CHILD = pubkey(4)  # owned by ME, deleted
FOREIGN = pubkey(5)  # owned by HUMAN, not by ME
UNKNOWN = pubkey(6)  # held by nobody
TWIN_A, TWIN_B = pubkey(7), pubkey(8)  # two of ME's agents with one name


@dataclass(frozen=True)
class Record:
    """Test data with the public fields of custody's AgentRecord."""

    pubkey: str
    owner: str
    name: str
    depth: int
    deleted_at: int | None = None


class Directory:
    """An agent directory holding fixed test records (the agent()/agents() read surface)."""

    def __init__(self, records: Sequence[Record]) -> None:
        self._records = {r.pubkey: r for r in records}

    def agent(self, pubkey: str) -> Record | None:
        return self._records.get(pubkey)

    def agents(self, *, include_deleted: bool = False) -> list[Record]:
        return [r for r in self._records.values() if include_deleted or r.deleted_at is None]


AGENTS = Directory(
    [
        Record(ME, HUMAN, "me", 1),
        Record(CHILD, ME, "child", 2),
        Record(DEAD_CHILD, ME, "ghost", 2, deleted_at=NOW - 10),
        Record(FOREIGN, HUMAN, "child", 1),
        Record(TWIN_A, ME, "twin", 2),
        Record(TWIN_B, ME, "twin", 2),
    ]
)

HOST = PolicyConfig(disabled_actions=frozenset(), max_agent_depth=3, runtimes=frozenset({"goose"}),
                    providers=frozenset({"acme"}), models=frozenset({"m-1"}))

#: One valid argument object per action, inside CHANNEL where there is a channel.
ARGS: dict[str, dict[str, object]] = {
    "channel.read": {"channelId": CHANNEL},
    "message.post": {"channelId": CHANNEL, "content": "hello"},
    "message.reply": {"channelId": CHANNEL, "replyToEventId": EVENT, "content": "hi"},
    "reaction.add": {"channelId": CHANNEL, "targetEventId": EVENT, "reaction": "+"},
    "profile.set": {"displayName": "me"},
    "storage.address": {"slug": "core"},
    "storage.get": {"slug": "core"},
    "storage.put": {"slug": "core", "value": "I am a test agent."},
    "agents.create": {"channelId": CHANNEL, "displayName": "kid", "systemPrompt": "be kind"},
    "agents.update": {"target": {"pubkey": CHILD}, "displayName": "kid 2"},
    "agents.delete": {"target": {"pubkey": CHILD}},
    "presence.set": {"status": "online"},
    "typing.set": {"channelId": CHANNEL},
    "observer.emit": {"frames": [{"kind": "k", "payload": "p"}]},
    "liveness.ping": {"channelId": CHANNEL, "turnId": "t"},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SessionStore]:
    s = SessionStore.open(tmp_path_factory.mktemp("sessions"))
    yield s
    s.close()


def principal(
    store: SessionStore,
    *,
    agent: str = ME,
    actions: frozenset[str] = frozenset(ACTIONS),
    channels: frozenset[str] = frozenset({CHANNEL}),
) -> Principal:
    _, token = store.issue(
        agent=agent, channels=channels, actions=actions, ttl_seconds=None, uid=None, now=NOW
    )
    p = store.authenticate(f"Bearer {token}", None, NOW)
    assert p is not None
    return p


def request(action: str, **overrides: object) -> Request:
    return build_request(action, {**ARGS[action], **overrides}, request_id="r-1")


# -- the tables agree with the contract ------------------------------------------------


def _actions_with(member: str) -> frozenset[str]:
    return frozenset(
        name
        for name, spec in ACTIONS.items()
        if member in spec.arg_members.required | spec.arg_members.optional
    )


def test_tables_match_the_contract() -> None:
    assert CHANNEL_ACTIONS == _actions_with("channelId")
    assert RUNTIME_ACTIONS == _actions_with("runtime") == CHOICE_ACTIONS["runtime"]
    for arg, _field in CHOICES:
        assert CHOICE_ACTIONS[arg] == _actions_with(arg) == {"agents.create", "agents.update"}
    assert TARGET_ACTIONS == _actions_with("target")
    assert set(ARGS) == set(ACTIONS)


@pytest.mark.parametrize("name", list(REFUSALS))
def test_every_refusal_is_a_failed_verdict(name: str) -> None:
    assert Status.FAILED in PAIRING[REFUSALS[name].code]


# -- each check, over every action it governs --------------------------------------------


@pytest.mark.parametrize("action", list(ACTIONS))
def test_allowed_request_passes(store: SessionStore, action: str) -> None:
    assert isinstance(authorize(principal(store), request(action), HOST, AGENTS), Authorized)


@pytest.mark.parametrize("action", list(ACTIONS))
def test_action_outside_credential(store: SessionStore, action: str) -> None:
    p = principal(store, actions=frozenset(ACTIONS) - {action})
    assert authorize(p, request(action), HOST, AGENTS) == REFUSALS["action"]


@pytest.mark.parametrize("action", sorted(CHANNEL_ACTIONS))
def test_channel_outside_credential(store: SessionStore, action: str) -> None:
    req = request(action, channelId=OTHER_CHANNEL)
    assert authorize(principal(store), req, HOST, AGENTS) == REFUSALS["channel"]
    # The same request is fine for a credential bound to both channels.
    both = principal(store, channels=frozenset({CHANNEL, OTHER_CHANNEL}))
    assert isinstance(authorize(both, req, HOST, AGENTS), Authorized)


def test_channel_normalized_before_the_check(store: SessionStore) -> None:
    req = request("message.post", channelId=CHANNEL.upper())
    assert authorize(principal(store), req, HOST, AGENTS) == Authorized()


@pytest.mark.parametrize("action", list(ACTIONS))
def test_host_switched_off(store: SessionStore, action: str) -> None:
    host = dataclasses.replace(HOST, disabled_actions=frozenset({action}))
    refusal = authorize(principal(store), request(action), host, AGENTS)
    assert refusal == REFUSALS["disabled"] and refusal.code is ErrorCode.UNSUPPORTED


#: Names that are no action of this host (nor of NIP-BA): never resolved, never offered.
UNKNOWN_NAMES = ("message.delete", "Message.Post", "sign", "storage.delete", "presence.get")

#: (switched off?, credential holds it?, channel in scope?) -> the answer, for every action:
#: switched off wins over every credential fact (NIP-BA: `unsupported` for every
#: credential); an offered action the credential lacks is `unauthorized`.
SWITCH_ROWS: list[tuple[bool, bool, bool, Refusal | None]] = [
    (True, True, True, REFUSALS["disabled"]),
    (True, False, True, REFUSALS["disabled"]),
    (True, True, False, REFUSALS["disabled"]),
    (True, False, False, REFUSALS["disabled"]),
    (False, False, True, REFUSALS["action"]),
    (False, False, False, REFUSALS["action"]),
    (False, True, True, None),
]


@pytest.mark.parametrize("action", list(ACTIONS))
@pytest.mark.parametrize("off,held,in_scope,want", SWITCH_ROWS)
def test_switched_off_is_unsupported_for_every_credential(
    store: SessionStore, action: str, off: bool, held: bool, in_scope: bool,
    want: Refusal | None,
) -> None:
    others = frozenset(ACTIONS) - {action}
    p = principal(store, actions=others | {action} if held else others)
    host = dataclasses.replace(HOST, disabled_actions=frozenset({action}) if off else frozenset())
    overrides: dict[str, object] = {}
    if not in_scope and action in CHANNEL_ACTIONS:
        overrides["channelId"] = OTHER_CHANNEL
    answer = authorize(p, request(action, **overrides), host, AGENTS)
    if want is None:
        assert isinstance(answer, Authorized)
    else:
        assert answer == want


@pytest.mark.parametrize("name", UNKNOWN_NAMES)
def test_unknown_name_stays_unknown_action(name: str) -> None:
    # Judged by the contract before policy runs: no switch or credential can change it.
    with pytest.raises(ContractError) as caught:
        build_request(name, {}, request_id="r-1")
    assert caught.value.code is ErrorCode.UNKNOWN_ACTION


#: (requester, max_agent_depth, refused?) — a human-owned agent is depth 1.
DEPTH_ROWS = [
    (ME, 3, False),  # creates depth 2
    (ME, 2, False),  # creates depth 2, at the limit
    (ME, 1, True),
    (CHILD, 3, False),  # creates depth 3
    (CHILD, 2, True),
    (ME, 0, True),
]


@pytest.mark.parametrize(("requester", "limit", "refused"), DEPTH_ROWS)
def test_depth_limit(store: SessionStore, requester: str, limit: int, refused: bool) -> None:
    host = dataclasses.replace(HOST, max_agent_depth=limit)
    refusal = authorize(principal(store, agent=requester), request("agents.create"), host, AGENTS)
    if refused:
        assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.UNAUTHORIZED
        assert str(limit) in refusal.message  # names the limit
    else:
        # What the operation receives: the requester's own record, resolved here once.
        assert isinstance(refusal, Authorized) and refusal.target is None
        assert refusal.requester is not None and refusal.requester.pubkey == requester


@pytest.mark.parametrize("requester", [UNKNOWN, DEAD_CHILD])
def test_requester_not_held_cannot_create(store: SessionStore, requester: str) -> None:
    refusal = authorize(principal(store, agent=requester), request("agents.create"), HOST, AGENTS)
    assert refusal == REFUSALS["requester"]


#: The one choice of each argument HOST declares.
OFFERED = {"runtime": "goose", "provider": "acme", "model": "m-1"}


def test_every_choice_has_its_config_list_and_its_refusal() -> None:
    # The table names real fields and one refusal each, in the runtime refusal's style.
    assert [arg for arg, _ in CHOICES] == list(OFFERED)
    for arg, field in CHOICES:
        assert getattr(HOST, field) == {OFFERED[arg]}
        assert REFUSALS[arg] == Refusal(ErrorCode.INVALID_REQUEST,
                                        f"{arg} is not offered by this host")


@pytest.mark.parametrize("arg", list(OFFERED))
@pytest.mark.parametrize("action", ["agents.create", "agents.update"])
def test_a_choice_must_be_offered(store: SessionStore, action: str, arg: str) -> None:
    """NIP-BA: runtime/provider/model are host-declared; an unknown one is refused
    (`invalid_request`), never passed on to the owner-signed record."""
    p = principal(store)
    assert isinstance(authorize(p, request(action, **{arg: OFFERED[arg]}), HOST, AGENTS),
                      Authorized)
    refusal = authorize(p, request(action, **{arg: "skynet"}), HOST, AGENTS)
    assert refusal == REFUSALS[arg] and refusal.code is ErrorCode.INVALID_REQUEST
    # Exact: another case of a declared name is another name.
    assert authorize(p, request(action, **{arg: OFFERED[arg].upper()}), HOST, AGENTS) \
        == REFUSALS[arg]


@pytest.mark.parametrize("action", ["agents.create", "agents.update"])
def test_each_choice_is_checked_whatever_the_others(store: SessionStore, action: str) -> None:
    p = principal(store)
    assert isinstance(authorize(p, request(action, **OFFERED), HOST, AGENTS), Authorized)
    for arg in OFFERED:
        # One unknown among declared ones is enough, and it is the one named.
        assert authorize(p, request(action, **{**OFFERED, arg: "skynet"}), HOST, AGENTS) \
            == REFUSALS[arg]


@pytest.mark.parametrize("action", ["agents.create", "agents.update"])
def test_an_empty_list_offers_none_and_naming_none_is_fine(store: SessionStore,
                                                           action: str) -> None:
    p = principal(store)
    bare = dataclasses.replace(HOST, runtimes=frozenset(), providers=frozenset(),
                               models=frozenset())
    for arg in OFFERED:
        assert authorize(p, request(action, **{arg: OFFERED[arg]}), bare, AGENTS) \
            == REFUSALS[arg]
    # A request that chooses nothing is the host's own default: nothing to substitute.
    assert isinstance(authorize(p, request(action), bare, AGENTS), Authorized)


# -- targets ---------------------------------------------------------------------------

#: (target, expected): a pubkey string = resolved to that agent, else the refusal's name.
TARGET_ROWS: list[tuple[dict[str, str], str]] = [
    ({"pubkey": CHILD}, CHILD),
    ({"pubkey": DEAD_CHILD}, "not_owned"),
    ({"pubkey": FOREIGN}, "not_owned"),
    ({"pubkey": UNKNOWN}, "not_owned"),
    ({"pubkey": ME}, "not_owned"),  # an agent does not own itself
    ({"name": "child"}, CHILD),  # FOREIGN is also "child" but not ME's: not a match
    ({"name": "ghost"}, "no_such_name"),  # deleted
    ({"name": "nobody"}, "no_such_name"),
    ({"name": "twin"}, "ambiguous"),
]


@pytest.mark.parametrize(("target", "expected"), TARGET_ROWS, ids=repr)
@pytest.mark.parametrize("action", sorted(TARGET_ACTIONS))
def test_targets(store: SessionStore, action: str, target: dict[str, str], expected: str) -> None:
    p = principal(store)
    req = request(action, target=target)
    assert isinstance(req.args, (AgentsUpdateArgs, AgentsDeleteArgs))
    found = resolve_target(p, req.args.target, AGENTS)
    refusal = authorize(p, req, HOST, AGENTS)
    if expected in REFUSALS:
        assert found == REFUSALS[expected] == refusal
    else:
        # The operation acts on the record authorize resolved (issue 16: one resolution).
        assert isinstance(found, Record) and found.pubkey == expected
        assert isinstance(refusal, Authorized) and refusal.target is found


def test_foreign_agents_are_not_revealed(store: SessionStore) -> None:
    p = principal(store)
    answers = {
        authorize(p, request("agents.delete", target={"pubkey": pk}), HOST, AGENTS)
        for pk in (DEAD_CHILD, FOREIGN, UNKNOWN)
    }
    assert len(answers) == 1  # unknown, deleted and foreign look the same
    (refusal,) = answers
    assert isinstance(refusal, Refusal)
    for secret in (FOREIGN, HUMAN, DEAD_CHILD):
        assert secret not in refusal.message


# -- order: the first failing check in CHECKS wins --------------------------------------


def test_first_check_in_table_order_wins(store: SessionStore) -> None:
    # A request that fails every check at once.
    p = principal(store, agent=CHILD, actions=frozenset({"channel.read"}))
    host = PolicyConfig(
        disabled_actions=frozenset({"agents.create"}), max_agent_depth=1, runtimes=frozenset()
    )
    req = request("agents.create", channelId=OTHER_CHANNEL, runtime="skynet")
    expected = [REFUSALS["disabled"], REFUSALS["action"], REFUSALS["channel"]]
    names = [name for name, _ in CHECKS]
    # NIP-BA: switched off is `unsupported` for every credential, so the host's switch
    # comes first; then the credential (its actions, then its channels).
    assert names[:2] == ["disabled", "credential"]
    for i, want in enumerate(expected):
        # Remove the earlier failures one at a time; the next check in the table answers.
        assert authorize(p, req, host, AGENTS) == want
        if i == 0:
            host = dataclasses.replace(host, disabled_actions=frozenset())
        elif i == 1:
            p = principal(store, agent=CHILD)
    p = principal(store, agent=CHILD, channels=frozenset({OTHER_CHANNEL}))
    depth = authorize(p, req, host, AGENTS)
    assert isinstance(depth, Refusal) and "1" in depth.message
    host = dataclasses.replace(host, max_agent_depth=3)
    assert authorize(p, req, host, AGENTS) == REFUSALS["runtime"]


@pytest.mark.parametrize(("reaction", "allowed"), [
    ("\U0001F44D" * 64, True), ("a" * 64, True),
    ("\U0001F44D" * 65, False), ("\U0001F44D\U0001F3FD" * 33, False),  # 66: NIP-BA's bound
], ids=["64 emoji", "64 letters", "65", "66"])
def test_a_reaction_longer_than_buzzs_relay_takes_is_refused_before_it_runs(
        store: SessionStore, reaction: str, allowed: bool) -> None:
    # NIP-BA and the contract allow 66 scalars; Buzz's relay refuses a kind 7 of more than
    # 64 (ingest.rs MAX_REACTION_EMOJI_CHARS). NIP-BA lets a host restrict the vocabulary.
    answer = authorize(principal(store), request("reaction.add", reaction=reaction), HOST, AGENTS)
    if allowed:
        assert answer == Authorized()
    else:
        assert answer == REFUSALS["reaction"] and answer.code is ErrorCode.INVALID_REQUEST
        assert "64" in answer.message
