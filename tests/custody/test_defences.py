"""Each custody defence proven ALONE, for every seal kind (issue 18 item 7).

`_sealed.unseal` applies four defences in order: format, kek, authentication (the GCM tag
or the HMAC over header, agent pubkey and ciphertext), pubkey (re-derivation). In the old
swap tests each masked the other: a blob moved onto another agent failed the AAD check,
so removing the re-derivation broke nothing. Here each test builds, with custody's own
seal, a blob that passes every defence but the one it names, so removing that defence
alone makes the test fail (each was checked by disabling it; see the issue note).

Every refusal must also: reach the caller as the one opaque `UnsealFailed` (no cause, the
same text), and name its defence in the operator log only (`refused_by`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import custody._sealed as sealed_module
from custody import verify_event
from custody._worker import in_token_worker
from tests.custody._sealing import (
    SEAL_KINDS,
    Held,
    blob_of,
    counting_keystream,
    event,
    held_custody,
    plant_unsafe_kek,
    put_blob,
    refused_by,
    seal_as,
    seal_under_unchecked,
)
from tests.fixtures.broker import BrokerHarness
from tests.fixtures.token import SoftHsmToken


@pytest.fixture(params=SEAL_KINDS)
async def held(request: pytest.FixtureRequest, softhsm_token: SoftHsmToken,
               tmp_path: Path) -> AsyncIterator[Held]:
    async with held_custody(softhsm_token, request.param, tmp_path / "state") as opened:
        yield opened


async def _signs(held: Held, agent: str) -> None:
    signed = await held.custody.sign_event(agent, event(agent))
    assert verify_event(signed.to_json_obj())


async def test_pubkey_rederivation_alone_refuses_a_key_sealed_correctly_for_another_agent(
    held: Held, caplog: pytest.LogCaptureFixture
) -> None:
    """A's secret sealed with B's AAD, on B's record: format, KEK and tag all pass (it IS a
    valid blob for B); only re-deriving the pubkey shows it would sign as A."""
    a_secret, _ = held.a
    _, b = held.b
    put_blob(held.state, b, await seal_as(held, a_secret, b))
    assert await refused_by(held, b, caplog) == "pubkey"


async def test_the_aad_binding_alone_refuses_a_key_sealed_for_another_agent(
    held: Held, caplog: pytest.LogCaptureFixture
) -> None:
    """B's OWN secret, sealed with A's AAD, on B's record: the key inside is right (the
    re-derivation would pass), only the agent pubkey bound in the AAD refuses it."""
    _, a = held.a
    b_secret, b = held.b
    put_blob(held.state, b, await seal_as(held, b_secret, a))
    assert await refused_by(held, b, caplog) == "authentication"
    put_blob(held.state, b, await seal_as(held, b_secret, b))  # control: the same key, own AAD
    await _signs(held, b)


async def test_the_tag_alone_refuses_a_changed_ciphertext_before_anything_is_decrypted(
    held: Held, caplog: pytest.LogCaptureFixture
) -> None:
    """A flipped ciphertext bit: without the tag check it would open to a wrong key that the
    re-derivation catches, so the defence named must be authentication; and for
    encrypt-then-MAC the keystream (the decryption) must never have been asked for."""
    _, b = held.b
    blob = blob_of(held.state, b)
    tampered = bytearray(blob)
    tampered[-40] ^= 0x01  # inside the ciphertext for both kinds (tag: last 16 or 32 bytes)
    put_blob(held.state, b, bytes(tampered))
    with counting_keystream() as keystream_calls:
        assert await refused_by(held, b, caplog) == "authentication"
    assert keystream_calls == []  # MAC before decrypt (GCM: the token checks the tag first)
    put_blob(held.state, b, blob)
    with counting_keystream() as keystream_calls:
        await _signs(held, b)  # control: the spy sees an opening
    assert len(keystream_calls) == (1 if held.kind == "etm" else 0)


@pytest.mark.token_offers("GENERATE_KEY")  # plants an extractable key
async def test_the_kek_check_alone_refuses_a_blob_under_an_unsafe_key(
    held: Held, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A correct blob (right AAD, right key inside) naming a KEK that is in the token but
    EXTRACTABLE: only the KEK's attribute check on first use refuses it."""
    b_secret, b = held.b
    label = f"unsafe-{held.kind}-{tmp_path.name}"[:64]
    await plant_unsafe_kek(held.config, label, held.kind)
    put_blob(held.state, b, await seal_under_unchecked(held, label, b_secret, b))
    assert await refused_by(held, b, caplog) == "kek"


async def test_the_kek_check_refuses_a_blob_naming_a_key_the_token_does_not_hold(
    held: Held, caplog: pytest.LogCaptureFixture
) -> None:
    _, b = held.b
    blob = blob_of(held.state, b)
    n = blob[2]
    renamed = blob[:3] + bytes([blob[3] ^ 0x20]) + blob[4:]  # one letter of the label
    assert renamed[3:3 + n] != blob[3:3 + n]
    put_blob(held.state, b, renamed)
    assert await refused_by(held, b, caplog) == "kek"


@pytest.mark.parametrize("change", ["version", "seal kind", "label length", "truncated",
                                    "empty", "label not printable"])
async def test_the_format_check_alone_refuses_an_unreadable_header(
    held: Held, caplog: pytest.LogCaptureFixture, change: str
) -> None:
    _, b = held.b
    blob = blob_of(held.state, b)
    bad = {
        "version": bytes([3]) + blob[1:],
        "seal kind": blob[:1] + bytes([0x07]) + blob[2:],
        "label length": blob[:2] + bytes([blob[2] + 1]) + blob[3:],
        "truncated": blob[:-1],
        "empty": b"",
        "label not printable": blob[:3] + b"\x00" + blob[4:],
    }[change]
    put_blob(held.state, b, bad)
    assert await refused_by(held, b, caplog) == "format"


async def test_the_daemon_tells_the_agent_nothing_and_the_operator_which_defence(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the real daemon: the agent whose key fails the re-derivation gets the
    ordinary `internal` failure; only the operator log names the defence."""
    a, b = await broker.human_owned_agent("a"), await broker.human_owned_agent("b")
    custody = broker.custody

    def a_key_as_b() -> bytes:
        with custody._unseal(a) as secret:
            return sealed_module.seal(custody._token, secret, b)

    put_blob(broker.state_dir, b, await in_token_worker(a_key_as_b))
    credential = broker.credential(b, [str(uuid.uuid4())])
    with caplog.at_level(logging.INFO):
        envelope = await broker.call(credential, "storage.address", {"slug": "mem/x"})
    assert envelope["status"] == "failed" and envelope["error"]["code"] == "internal"
    told = json.dumps(envelope)
    assert not any(word in told for word in ("defence", "pubkey", "refused", "unseal"))
    assert f"unseal refused for agent {b} by the pubkey defence" in caplog.text
