"""The contract's tables and shared/spec/wire-schema.md cannot drift (issue 15 item 1).

Three sources name the same member sets: wire-schema.md (what Buzz's own wire-schema test
pins), the contract's `ActionSpec` table, and the hand transcriptions the conformance and
contract tests check the code against. Each is compared with the file here, and the
envelope members with what `encode_response` really writes.
"""

from __future__ import annotations

import pytest

from buzzwire.contract import (
    ACTIONS, ErrorCode, Verdict, encode_response, mark_replayed, parse_response,
)
from tests.conformance import _spec
from tests.contract import test_responses
from tests.contract.vectors import REQUEST_ID, VALID_OUTCOMES
from tests.contract.wire_schema_md import WireSchema, load, skip_reason

_FORBIDDEN = ("secret", "private", "nsec", "seckey", "credential", "token")


@pytest.fixture(scope="module")
def schema() -> WireSchema:
    loaded = load()
    if loaded is None:
        pytest.skip(skip_reason())
    return loaded


def test_the_contract_spells_every_member_as_wire_schema_md(schema: WireSchema) -> None:
    # wire-schema.md pins Buzz's nine; the actions NIP-BA added after them are held to
    # NIP-BA's own table by tests/conformance/test_nip_ba_vectors.py.
    assert set(schema.actions) <= set(ACTIONS)
    assert set(ACTIONS) - set(schema.actions) <= _spec.NIP_BA_ADDED
    for name, (args, outcome) in schema.actions.items():
        spec = ACTIONS[name]
        assert spec.arg_members.all == args, name
        assert spec.outcome_members.all == outcome, name


def test_the_transcriptions_the_tests_use_match_wire_schema_md(schema: WireSchema) -> None:
    for name, (args, outcome) in schema.actions.items():
        required, optional = _spec.OUTCOME_MEMBERS[name]
        assert required | optional == outcome, name
        a_req, a_opt, o_req, o_opt = test_responses.SPEC_MEMBERS[name]
        assert (a_req | a_opt, o_req | o_opt) == (args, outcome), name
    assert schema.responses["succeeded"] == _spec.SUCCEEDED_MEMBERS
    assert schema.responses["failed"] == schema.responses["indeterminate"] == _spec.ERROR_MEMBERS
    assert schema.responses["error object"] == _spec.ERROR_OBJECT_MEMBERS


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_a_real_succeeded_envelope_has_the_members_wire_schema_md_names(
    schema: WireSchema, action: str
) -> None:
    import json

    if action not in schema.actions:
        # One of NIP-BA's additions, which wire-schema.md predates: its succeeded envelope
        # is held to NIP-BA's table instead (the same member sets for every status).
        assert action in _spec.NIP_BA_ADDED

    outcome = parse_response(json.dumps({
        "type": "broker_result", "protocolVersion": 1, "requestId": REQUEST_ID,
        "status": "succeeded", "action": action, "outcome": VALID_OUTCOMES[action],
    }).encode()).outcome
    assert outcome is not None
    body = json.loads(encode_response(REQUEST_ID, Verdict.succeeded(action, outcome)))
    assert set(body) == schema.responses["succeeded"]
    assert set(body["outcome"]) <= (schema.actions[action][1] if action in schema.actions
                                    else set(_spec.NIP_BA_OUTCOMES[action][0]
                                             | _spec.NIP_BA_OUTCOMES[action][1]))
    replayed = json.loads(mark_replayed(encode_response(REQUEST_ID, Verdict.succeeded(action, outcome))))
    assert set(replayed) == schema.responses["succeeded"] | {"replayed"}


def test_error_envelopes_have_the_members_wire_schema_md_names(schema: WireSchema) -> None:
    import json

    for verdict in (Verdict.failed(ErrorCode.ACTION_FAILED), Verdict.indeterminate(ErrorCode.INTERNAL)):
        body = json.loads(encode_response(REQUEST_ID, verdict))
        assert set(body) == schema.responses[verdict.status.value]
        assert set(body["error"]) == schema.responses["error object"]


def test_no_member_name_reads_as_secret_material(schema: WireSchema) -> None:
    names = {n for spec in ACTIONS.values() for n in spec.member_names | spec.outcome_members.all}
    names |= {n for members in schema.responses.values() for n in members}
    for name in names:
        assert not any(word in name.lower() for word in _FORBIDDEN), name
