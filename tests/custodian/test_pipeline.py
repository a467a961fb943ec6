"""The daemon's normal flows through the custodian: existing end-to-end tests, run again
with `[custody] custodian_socket` set, so every signature, NIP-44 payload, NIP-AE address,
mint and destroy crosses the custodian's socket and passes its checks.

The tests are the e2e suite's own functions, imported here; this module overrides the
`broker_custody` fixture (tests/fixtures/broker.py) so its `broker` is the custodian's.
Under one uid (as the tests run) the boundary is a process boundary only.
"""

from __future__ import annotations

from collections.abc import Mapping

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
from custody.custodian.ledger import verify_chain
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
]


@pytest.fixture
def broker_custody(custodian: CustodianProcess) -> Mapping[str, Mapping[str, object]]:
    return {"custody": {"custodian_socket": str(custodian.socket)}}


@pytest.fixture(autouse=True)
def _signed_through_the_custodian(custodian: CustodianProcess) -> object:
    """After each test: the custodian's own log holds what was signed, as a whole chain."""
    yield None
    log = custodian.config.parent / "state" / "custodian" / "signed.jsonl"
    assert verify_chain(log) > 0
