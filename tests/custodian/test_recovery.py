"""The custodian dies (SIGKILL) and comes back: the pipeline answers `failed` + `internal`
while it is gone, and carries on once it is back, with no restart of its own.

- `test_sigkill_at_each_message`: for every row of the table, a custodian that kills
  itself after doing that request and before answering; the pipeline's client raises
  CustodianUnavailable (a CustodyError: the broker's `internal`), and the same client
  answers again once a custodian is back on the socket (the reconnect).
- `test_the_pipeline_answers_internal_until_the_custodian_is_back`: the whole daemon.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path

import coincurve
import pyrage
import pytest

from buzzwire.nostr import owner_tag_digest
from custody import CustodyError, TokenConfig
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
