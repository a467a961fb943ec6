"""The custodian dies (SIGKILL) and comes back: the pipeline answers `failed` + `internal`
while it is gone, and carries on once it is back, with no restart of its own.

- `test_sigkill_at_each_message`: for every row of the table, a custodian that kills
  itself after doing that request and before answering; the pipeline's client raises
  CustodianUnavailable (a CustodyError: the broker's `internal`), and the same client
  answers again once a custodian is back on the socket (the reconnect).
- `test_the_pipeline_answers_internal_until_the_custodian_is_back`: the whole daemon.
- `test_a_create_whose_custodian_died_after_minting_is_not_failed_and_its_retry_keeps_the_key`:
  agents.create's mint is done and the custodian dies before answering, and is still gone
  when the create ends: its key cannot be looked up, so the answer is `indeterminate` +
  `internal` (not final), never `failed` beside a live key; the identical retry, once the
  custodian is back, carries on with that key.
- `test_a_create_whose_mint_answer_was_lost_destroys_the_key_it_made`: the mint is done
  and its answer lost (as when it comes after the call's deadline) while the custodian
  still answers: the create ends `failed` + `internal` with that key destroyed, and the
  retry replays it.
- `test_a_create_whose_mint_is_made_after_its_lookup_is_not_failed`: the mint is made
  only after the create looked its reference up and found nothing: `indeterminate`, and
  the retry keeps that key.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Mapping
from pathlib import Path

import coincurve
import pyrage
import pytest
import trio

from buzzwire.nostr import owner_tag_digest
from custody import CustodyError, KeyRecord, TokenConfig
from custody.custodian import messages
from custody.custodian.client import CustodianClient, CustodianUnavailable
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.custodian import CustodianProcess, write_custodian_config


def _human() -> str:
    return coincurve.PrivateKey().public_key_xonly.format().hex()


async def _exercise(client: CustodianClient, op: str, agent: str, owner: coincurve.PrivateKey,
                    relay_url: str) -> object:
    """One call of the client that sends exactly one `op` request."""
    # The lookup rows are asked as such: the pipeline's reads answer from its snapshot
    # (custody/custodian/records.py), which asks records_version and agents.
    if op == "records_version":
        return client.lookup(op)
    if op in ("agent", "chain"):
        return client.lookup(op, pubkey=agent, **({"include_deleted": False} if op == "agent" else {}))
    if op == "agents":
        return client.lookup(op, include_deleted=False)
    if op == "relay":
        return await client.require_relay(relay_url)
    if op == "token":
        return await client.check_token()
    if op == "mint":
        return await client.mint_agent(owner=agent, mint_ref=str(uuid.uuid4()))
    if op == "import":
        secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
        return await client.import_agent(secret, owner=_human())
    if op == "destroy":
        return await client.destroy_agent((await client.mint_agent(owner=agent)).pubkey)
    if op == "attach_auth":
        pubkey = owner.public_key_xonly.format().hex()
        sig = owner.sign_schnorr(owner_tag_digest(agent, "")).hex()
        return await client.attach_auth_tag(agent, ["auth", pubkey, "", sig])
    if op == "sign":
        from buzzwire.nostr import UnsignedEvent
        return await client.sign_event(agent, UnsignedEvent(
            pubkey=agent, created_at=1_700_000_000, kind=9, tags=[("h", "c")], content="x"))
    if op == "sign_auth":
        return await client.sign_auth(agent, relay_url, "challenge", 1_700_000_000)
    if op == "memory_address":
        return await client.memory_address(agent, "core")
    if op == "encrypt":
        return await client.encrypt_to_owner(agent, [b"note"])
    if op == "decrypt":
        return await client.decrypt_from_owner_pair(agent, ["AgAA"])
    if op == "backup":
        return await client.backup({agent: ("scout", None)})
    raise AssertionError(op)


@pytest.mark.parametrize("op", sorted(messages.OPS))
async def test_sigkill_at_each_message(op: str, custody_state: tuple[TokenConfig, Path],
                                       local_relay: str, tmp_path: Path) -> None:
    token, state_dir = custody_state
    socket = tmp_path / "custodian.sock"
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    custodian = CustodianProcess(write_custodian_config(
        tmp_path / "custodian.toml", token=token, state_dir=state_dir, socket=socket,
        relay_url=local_relay, backup={"recipients": [recipient], "dir": str(tmp_path / "b"),
                                        # its retry after the restart is the second backup
                                        "min_interval_seconds": 0}),
        socket)
    # One that dies at `op` serves the setup too, unless the setup is `op` itself.
    custodian.start(kill_after=None if op == "import" else op)
    try:
        client = CustodianClient(socket)
        owner = coincurve.PrivateKey()
        agent = (await client.import_agent(
            bytearray(coincurve.PrivateKey().secret.hex().encode("ascii")),
            owner=owner.public_key_xonly.format().hex())).pubkey
        if op == "import":
            custodian.start(kill_after=op)
        with pytest.raises(CustodianUnavailable):
            try:
                await _exercise(client, op, agent, owner, local_relay)
            except CustodianUnavailable:
                raise
            except CustodyError as exc:
                pytest.fail(f"answered instead of dying: {exc!r}")
        assert f"custodian.kill step={op}" in custodian.stderr.read_text()
        with pytest.raises(CustodianUnavailable):  # gone: every call says so, none hangs
            client.records_version()
        custodian.start()
        assert client.agent(agent) is not None  # back: the same client, new connections
        await _exercise(client, op, agent, owner, local_relay)
        await client.aclose()
    finally:
        custodian.stop()


@pytest.fixture
def broker_custody(custodian: CustodianProcess) -> Mapping[str, Mapping[str, object]]:
    return {"custody": {"custodian_socket": str(custodian.socket)}}


async def test_the_pipeline_answers_internal_until_the_custodian_is_back(
        broker: BrokerHarness, custodian: CustodianProcess) -> None:
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    credential = broker.credential(agent, [channel])
    args = {"channelId": channel, "content": "before"}
    assert (await broker.call(credential, "message.post", args))["status"] == "succeeded"
    custodian.kill()
    for attempt in range(2):  # stays so while it is gone, one answer per request
        envelope = await broker.call(credential, "message.post",
                                     {"channelId": channel, "content": f"gone {attempt}"})
        assert envelope["status"] == "failed", envelope
        assert envelope["error"]["code"] == "internal", envelope
    custodian.start()
    envelope = await broker.call(credential, "message.post",
                                 {"channelId": channel, "content": "after"})
    assert envelope["status"] == "succeeded", envelope


def test_a_sighup_is_one_line_and_the_custodian_goes_on_serving(
        custodian: CustodianProcess) -> None:
    """An operator used to the daemon's reload sends the custodian SIGHUP: it says it
    reloads nothing, and answers on. (A review: SIGHUP's default action killed it, with no
    line, its socket file left.)"""
    from tests.custodian.test_refusals import ask

    assert custodian.proc is not None
    custodian.proc.send_signal(signal.SIGHUP)
    assert ask(custodian.socket, "records_version")[0]
    assert custodian.proc.poll() is None
    stderr = custodian.stop()
    assert stderr.count("no reload: restart the custodian to apply its configuration") == 1


def _under(broker: BrokerHarness, mint_ref: str) -> list[KeyRecord]:
    return [r for r in broker.custody.agents(include_deleted=True) if r.mint_ref == mint_ref]


_CREATE = {"displayName": "Helper", "systemPrompt": "be brief", "runtime": "goose"}


async def _a_create(broker: BrokerHarness) -> tuple[str, str, dict[str, object], str]:
    """A requester, its credential for a new channel, agents.create's args there, an id."""
    channel = str(uuid.uuid4())
    requester = await broker.human_owned_agent()
    return (requester, broker.credential(requester, [channel]),
            {"channelId": channel, **_CREATE}, str(uuid.uuid4()))


async def test_a_create_whose_custodian_died_after_minting_is_not_failed_and_its_retry_keeps_the_key(
        broker: BrokerHarness, custodian: CustodianProcess) -> None:
    requester, credential, args, request_id = await _a_create(broker)
    custodian.start(kill_after="mint")
    first = await broker.call(credential, "agents.create", args, request_id=request_id)
    assert "custodian.kill step=mint" in custodian.stderr.read_text()
    assert (first["status"], first["error"]["code"]) == ("indeterminate", "internal"), first
    custodian.start()  # what systemd does
    await broker.custody.records.refreshed()
    [made] = _under(broker, f"{requester}/{request_id}")
    assert made.live  # the key the unanswered mint made: a `failed` here would be a lie

    again = await broker.call(credential, "agents.create", args, request_id=request_id)
    assert again["status"] == "succeeded", again
    assert again["outcome"]["agentPubkey"] == made.pubkey  # that key, not a second one
    assert [r.pubkey for r in _under(broker, f"{requester}/{request_id}")] == [made.pubkey]
    assert await broker.call(credential, "agents.create", args,
                             request_id=request_id) == {**again, "replayed": True}


async def test_a_create_whose_mint_answer_was_lost_destroys_the_key_it_made(
        broker: BrokerHarness, custodian: CustodianProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    requester, credential, args, request_id = await _a_create(broker)
    client = broker.custody
    assert isinstance(client, CustodianClient)
    round_trip = client._round_trip

    async def answer_lost(op: str, frame: bytes, tail: bytearray | None) -> bytes:
        body = await round_trip(op, frame, tail)  # the custodian did it and answered
        if op == "mint":
            raise CustodianUnavailable("the custodian did not answer mint in time")
        return body

    monkeypatch.setattr(client, "_round_trip", answer_lost)
    first = await broker.call(credential, "agents.create", args, request_id=request_id)
    assert (first["status"], first["error"]["code"]) == ("failed", "internal"), first
    await client.records.refreshed()
    [made] = _under(broker, f"{requester}/{request_id}")
    assert not made.live, made  # failed: no effects, the key it made is destroyed
    assert broker.app.directory.agent(made.pubkey) is None
    monkeypatch.undo()
    assert await broker.call(credential, "agents.create", args,
                             request_id=request_id) == {**first, "replayed": True}
    assert [r.live for r in _under(broker, f"{requester}/{request_id}")] == [False]


async def test_a_create_whose_mint_is_made_after_its_lookup_is_not_failed(
        broker: BrokerHarness, custodian: CustodianProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A custodian alive past the call's deadline makes the key after the create has looked
    its reference up and found none: the create cannot promise "no effects", so it is
    `indeterminate` + `internal`, and the identical retry carries on with that key. (On
    the old code it was `failed`, final, and the key came afterwards: a live orphan.)"""
    requester, credential, args, request_id = await _a_create(broker)
    client = broker.custody
    assert isinstance(client, CustodianClient)
    round_trip = client._round_trip
    answered = trio.Event()

    async with trio.open_nursery() as nursery:
        async def made_late(op: str, frame: bytes, tail: bytearray | None) -> bytes:
            if op != "mint":
                return await round_trip(op, frame, tail)

            async def deliver() -> None:  # the custodian gets to it once the create ended
                await answered.wait()
                await round_trip(op, frame, tail)

            nursery.start_soon(deliver)
            raise CustodianUnavailable("the custodian did not answer mint in time")

        monkeypatch.setattr(client, "_round_trip", made_late)
        first = await broker.call(credential, "agents.create", args, request_id=request_id)
        answered.set()
    monkeypatch.undo()
    assert (first["status"], first["error"]["code"]) == ("indeterminate", "internal"), first
    await client.records.refreshed()
    [made] = _under(broker, f"{requester}/{request_id}")
    assert made.live

    again = await broker.call(credential, "agents.create", args, request_id=request_id)
    assert again["status"] == "succeeded", again
    assert again["outcome"]["agentPubkey"] == made.pubkey
    assert [r.pubkey for r in _under(broker, f"{requester}/{request_id}")] == [made.pubkey]


async def test_an_auth_the_custodian_cannot_sign_is_internal_not_the_relays_refusal(
        broker: BrokerHarness, custodian: CustodianProcess) -> None:
    """The custodian dies while the daemon signs a relay's NIP-42 AUTH for an agent with no
    relay session yet: that is the host's custody, as when it dies signing the event, so
    `failed` + `internal` (before: `action_failed`, "the relay could not be read" for a
    reply's parent lookup and "auth-required: ... (AUTH not signed: CustodianUnavailable)"
    for a post), and a retry once it is back succeeds."""
    channel = str(uuid.uuid4())
    author = await broker.human_owned_agent("author")
    posted = await broker.call(broker.credential(author, [channel]), "message.post",
                               {"channelId": channel, "content": "parent"})
    assert posted["status"] == "succeeded", posted
    poster, replier = await broker.human_owned_agent("poster"), await broker.human_owned_agent("replier")
    # Dies doing its first AUTH: the post's event is signed, its AUTH is not.
    custodian.start(kill_after="sign_auth")
    post_id = str(uuid.uuid4())
    post_args = {"channelId": channel, "content": "fresh connection"}
    post_credential = broker.credential(poster, [channel])
    answers = [await broker.call(post_credential, "message.post", post_args,
                                 request_id=post_id)]
    assert "custodian.kill step=sign_auth" in custodian.stderr.read_text()
    answers.append(await broker.call(
        broker.credential(replier, [channel]), "message.reply",
        {"channelId": channel, "replyToEventId": posted["outcome"]["eventId"],
         "content": "fresh connection"}))
    for envelope in answers:
        assert (envelope["status"], envelope["error"]["code"]) == ("failed", "internal"), envelope
    custodian.start()
    again = await broker.call(post_credential, "message.post", post_args, request_id=post_id)
    assert (again["status"], again["error"]["code"], again.get("replayed")) == (
        "failed", "internal", True), again  # recorded, as a signing fault's is
