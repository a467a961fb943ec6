"""The daemon's normal flows through the custodian: existing end-to-end tests, run again
with `[custody] custodian_socket` set, so every signature, NIP-44 payload, NIP-AE address,
mint and destroy crosses the custodian's socket and passes its checks.

The tests are the e2e suite's own functions, imported here; this module overrides the
`broker_custody` fixture (tests/fixtures/broker.py) so its `broker` is the custodian's.
Under one uid (as the tests run) the boundary is a process boundary only.

The pipeline (the daemon, in this test's process) never opens the keystore file: an
audit hook (PEP 578: every `open`, `os.open` and `sqlite3.connect` of the process) notes
each opening of `keys.db` from before the daemon starts until it has stopped, and every
test here ends with none noted (`test_the_pipeline_never_opens_the_keystore_file` also
checks that the hook does see one). The directory's key records come through the
custodian's record lookups (custody/custodian/records.py).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.e2e.test_idempotency import test_hundred_concurrent_identical_requests_execute_once
from tests.e2e.test_memory import (
    test_a_sealed_verdict_opens_only_in_custody_for_its_agent,
    test_put_then_get_round_trips_and_the_owner_decrypts,
)
from tests.e2e.test_observer import test_each_frame_reaches_the_relay_as_24200_the_owner_decrypts
from tests.e2e.test_operations import (
    test_agents_create_update_delete,
    test_post_reply_and_read_the_thread_back,
    test_reaction_and_profile,
    test_storage_address_matches_the_nip_ae_vector,
)
from custody import KeyIndex
from custody._keystore import KEYSTORE_FILE
from custody.custodian.verify import verify_chain
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.custodian import CustodianProcess

__all__ = [
    "test_a_sealed_verdict_opens_only_in_custody_for_its_agent",
    "test_agents_create_update_delete",
    "test_each_frame_reaches_the_relay_as_24200_the_owner_decrypts",
    "test_hundred_concurrent_identical_requests_execute_once",
    "test_post_reply_and_read_the_thread_back",
    "test_put_then_get_round_trips_and_the_owner_decrypts",
    "test_reaction_and_profile",
    "test_storage_address_matches_the_nip_ae_vector",
    "test_the_pipeline_never_opens_the_keystore_file",
]

#: While a list is here, the audit hook appends to it each keystore opening it sees.
_noting: list[list[str]] = []


def _note_keystore_opens(event: str, args: tuple[object, ...]) -> None:
    if (_noting and event in ("open", "sqlite3.connect") and args
            and KEYSTORE_FILE in str(args[0])):
        _noting[-1].append(f"{event} {args[0]}")


sys.addaudithook(_note_keystore_opens)  # process-wide and permanent (PEP 578); idle when off


@pytest.fixture
def keystore_opens() -> Iterator[list[str]]:
    """The keystore openings of this process while the fixture lasts."""
    noted: list[str] = []
    _noting.append(noted)
    yield noted
    _noting.remove(noted)


@pytest.fixture
def broker_custody(custodian: CustodianProcess, keystore_opens: list[str]
                   ) -> Iterator[Mapping[str, Mapping[str, object]]]:
    # The broker fixture uses this one: noting starts before the daemon does, and the
    # check runs after it has stopped.
    yield {"custody": {"custodian_socket": str(custodian.socket)}}
    assert keystore_opens == [], "the pipeline opened the keystore file"


@pytest.fixture(autouse=True)
def _signed_through_the_custodian(custodian: CustodianProcess) -> object:
    """After each test: the custodian's own log holds what was signed, as a whole chain."""
    yield None
    log = custodian.config.parent / "state" / "custodian" / "signed.jsonl"
    assert verify_chain(log) > 0


async def test_the_pipeline_never_opens_the_keystore_file(
        broker: BrokerHarness, keystore_opens: list[str]) -> None:
    """A daemon that starts, imports and names an agent, lists and looks it up, and posts
    for it: no opening of keys.db noted; and the in-process reader's opening is noted."""
    agent = await broker.human_owned_agent("scout")
    record = broker.app.directory.agent(agent)
    assert record is not None and record.name == "scout" and record.depth == 1
    assert [r.pubkey for r in broker.app.directory.agents()] == [agent]
    channel = str(uuid.uuid4())
    credential = broker.credential(agent, [channel])
    envelope = await broker.call(credential, "message.post",
                                 {"channelId": channel, "content": "no keystore here"})
    assert envelope["status"] == "succeeded", envelope
    assert keystore_opens == []
    index = KeyIndex.open(Path(broker.state_dir))  # what the directory used to read
    try:
        assert [r.pubkey for r in index.all()] == [agent]
    finally:
        index.close()
    assert keystore_opens and all(KEYSTORE_FILE in line for line in keystore_opens)
    keystore_opens.clear()  # the fixture's own check is about the pipeline
