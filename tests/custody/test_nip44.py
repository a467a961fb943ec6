"""NIP-44 v2: every official vector, NIP-AE's pinned events, nostr-sdk both ways, and the
custody intents on a real SoftHSM2 token (one unseal per call, owner pair only, bounds)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import nostr_sdk
import pytest

import custody._facade as facade
from custody import Custody, UnknownAgent
from custody._nipae import d_tag_of
from custody._nip44 import (
    DecryptFailed,
    UnsupportedVersion,
    conversation_key,
    decrypt,
    encrypt,
    message_keys,
    padded_length,
)
from custody._secret import Secret
from tests.custody._secrets import PUB_1, PUB_2, SECRET_1, SECRET_2, SECRET_X
from tests.custody.test_unsealed_cache import unseals  # noqa: F401 - the fixture

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).parent / "vectors" / "nip44.vectors.json").read_text()
)["v2"]
VALID, INVALID = VECTORS["valid"], VECTORS["invalid"]


def raw_secret(hex_text: str) -> Secret:
    """Any 32 bytes in a Secret, in range or not (the invalid vectors need both)."""
    from coincurve._libsecp256k1 import ffi

    secret = Secret()
    ffi.memmove(secret.cdata, bytes.fromhex(hex_text), 32)
    return secret


def pub_of(hex_secret: str) -> str:
    return str(nostr_sdk.Keys.parse(hex_secret).public_key().to_hex())


@pytest.mark.token_independent
@pytest.mark.parametrize("case", VALID["get_conversation_key"], ids=lambda c: c["pub2"][:8])
def test_conversation_key_vectors(case: dict[str, str]) -> None:
    with raw_secret(case["sec1"]) as secret:
        assert conversation_key(secret, case["pub2"]).hex() == case["conversation_key"]


@pytest.mark.token_independent
@pytest.mark.parametrize("case", INVALID["get_conversation_key"], ids=lambda c: c["note"])
def test_conversation_key_refusals(case: dict[str, str]) -> None:
    with raw_secret(case["sec1"]) as secret, pytest.raises(ValueError):
        conversation_key(secret, case["pub2"])


@pytest.mark.token_independent
def test_message_key_vectors() -> None:
    conv = bytes.fromhex(VALID["get_message_keys"]["conversation_key"])
    for case in VALID["get_message_keys"]["keys"]:
        keys = message_keys(conv, bytes.fromhex(case["nonce"]))
        assert tuple(k.hex() for k in keys) == (
            case["chacha_key"], case["chacha_nonce"], case["hmac_key"])


@pytest.mark.token_independent
@pytest.mark.parametrize(("unpadded", "padded"), VALID["calc_padded_len"])
def test_padded_length_vectors(unpadded: int, padded: int) -> None:
    assert padded_length(unpadded) == padded


@pytest.mark.token_independent
@pytest.mark.parametrize("case", VALID["encrypt_decrypt"], ids=lambda c: c["nonce"][-6:])
def test_encrypt_decrypt_vectors(case: dict[str, str]) -> None:
    with raw_secret(case["sec1"]) as one, raw_secret(case["sec2"]) as two:
        forward = conversation_key(one, pub_of(case["sec2"]))
        backward = conversation_key(two, pub_of(case["sec1"]))
    assert forward.hex() == backward.hex() == case["conversation_key"]
    plaintext = case["plaintext"].encode()
    assert encrypt(forward, plaintext, bytes.fromhex(case["nonce"])) == case["payload"]
    assert decrypt(backward, case["payload"]) == plaintext


@pytest.mark.token_independent
@pytest.mark.parametrize("case", VALID["encrypt_decrypt_long_msg"], ids=lambda c: str(c["repeat"]))
def test_long_message_vectors(case: dict[str, Any]) -> None:
    plaintext = (case["pattern"] * case["repeat"]).encode()
    assert hashlib.sha256(plaintext).hexdigest() == case["plaintext_sha256"]
    conv = bytes.fromhex(case["conversation_key"])
    payload = encrypt(conv, plaintext, bytes.fromhex(case["nonce"]))
    assert hashlib.sha256(payload.encode()).hexdigest() == case["payload_sha256"]
    assert decrypt(conv, payload) == plaintext


@pytest.mark.token_independent
@pytest.mark.parametrize("length", INVALID["encrypt_msg_lengths"])
def test_plaintext_lengths_nip44_refuses(length: int) -> None:
    with pytest.raises(ValueError):
        encrypt(bytes(32), b"x" * length, bytes(32))


@pytest.mark.token_independent
@pytest.mark.parametrize("case", INVALID["decrypt"], ids=lambda c: c["note"])
def test_decrypt_refusals(case: dict[str, str]) -> None:
    expected = UnsupportedVersion if "version" in case["note"] else DecryptFailed
    with pytest.raises(expected) as caught:
        decrypt(bytes.fromhex(case["conversation_key"]), case["payload"])
    # Fernet's rule: one opaque message, nothing about the key, nonce or plaintext.
    assert case["plaintext"] not in str(caught.value)
    assert case["conversation_key"] not in str(caught.value)


@pytest.mark.token_independent
@pytest.mark.parametrize("payload", ["", "#", "#AgAAAA"])
def test_an_empty_or_hash_payload_is_an_unknown_version_as_nip44_decodes_it(payload: str) -> None:
    # NIP-44's decode_payload: `if plen == 0 or payload[0] == '#': raise 'unknown version'`
    # (a review found the empty one said as any other failure).
    with pytest.raises(UnsupportedVersion):
        decrypt(bytes(32), payload)


@pytest.mark.token_independent
def test_unsupported_version_is_also_a_decrypt_failure() -> None:
    # Callers that only care "does it open" catch one class.
    assert issubclass(UnsupportedVersion, DecryptFailed)


@pytest.mark.token_independent
def test_nip_ae_pinned_events_encrypt_exactly() -> None:
    """NIP-AE's reference events 1 and 4: body, nonce and K_c give the published content."""
    pinned = [
        ('{"slug":"mem/example","value":"hello, agent memory"}', 1, "ff680a293019af12709972ae68b6ee79a47f354381a94ca4074d8e0fe3c8bb50"),
        ('{"slug":"core","profile":"test agent. see [[mem/example]] and [[mem/notes/2026-05-12]]."}', 4,
         "070f0f3e2e2bdc016b3ae06e8754e7814ffd4e98f0d5a70d75d1e8eab0d0e474"),
    ]
    with raw_secret(SECRET_1) as agent:
        k_c = conversation_key(agent, PUB_2)
    assert d_tag_of(k_c, "mem/example") == "72d4f9629106451505d7d341ea85bb3ebad4f654fcfd2aad100d5a35f8a85cba"
    for body, nonce, content_sha in pinned:
        content = encrypt(k_c, body.encode(), (nonce).to_bytes(32, "big"))
        assert hashlib.sha256(content.encode()).hexdigest() == content_sha
        assert decrypt(k_c, content) == body.encode()


# --- an independent implementation: rust-nostr's NIP-44, both directions ---------------

SAMPLES = ["a", "emoji 🐝🧠 and ZWJ 👩‍💻", '{"slug":"mem/x","value":"v"}', "x" * 1000, "é" * 20_000]


@pytest.mark.token_independent
@pytest.mark.parametrize("text", SAMPLES, ids=lambda t: str(len(t)))
def test_nostr_sdk_reads_ours_and_we_read_nostr_sdks(text: str) -> None:
    with raw_secret(SECRET_X) as agent:
        k_c = conversation_key(agent, PUB_2)
    sdk_owner = nostr_sdk.SecretKey.parse(SECRET_2)
    sdk_agent = nostr_sdk.PublicKey.parse(pub_of(SECRET_X))
    ours = encrypt(k_c, text.encode(), bytes(range(32)))
    assert nostr_sdk.nip44_decrypt(sdk_owner, sdk_agent, ours) == text
    theirs = nostr_sdk.nip44_encrypt(sdk_owner, sdk_agent, text, nostr_sdk.Nip44Version.V2)
    assert decrypt(k_c, theirs) == text.encode()


#: rust-nostr (nostr-sdk 0.45) refuses to *encrypt* plaintexts above 65,408 bytes, where
#: NIP-44 and NIP-BA allow 65,535; it decrypts all of them. So a record this host writes in
#: the band 65,409..65,535 is readable by a rust-nostr owner (Buzz Desktop), and the host
#: accepts the whole NIP-BA range (docs/protocol.md, "storage.put"). This test pins both
#: halves, so a nostr-sdk that starts refusing to read the band fails here first.
RUST_NOSTR_MAX = 65_408


@pytest.mark.token_independent
@pytest.mark.parametrize("length", [RUST_NOSTR_MAX, RUST_NOSTR_MAX + 1, 65_535])
def test_the_rust_nostr_band(length: int) -> None:
    with raw_secret(SECRET_X) as agent:
        k_c = conversation_key(agent, PUB_2)
    plaintext = b"m" * length
    payload = encrypt(k_c, plaintext, bytes(32))
    assert decrypt(k_c, payload) == plaintext
    sdk_owner = nostr_sdk.SecretKey.parse(SECRET_2)
    sdk_agent = nostr_sdk.PublicKey.parse(pub_of(SECRET_X))
    # rust-nostr reads every length NIP-44 allows...
    assert nostr_sdk.nip44_decrypt(sdk_owner, sdk_agent, payload) == plaintext.decode()
    # ...but writes only up to its own cap.
    if length <= RUST_NOSTR_MAX:
        assert decrypt(k_c, nostr_sdk.nip44_encrypt(
            sdk_owner, sdk_agent, plaintext.decode(), nostr_sdk.Nip44Version.V2)) == plaintext
    else:
        with pytest.raises(nostr_sdk.NostrSdkError):
            nostr_sdk.nip44_encrypt(sdk_owner, sdk_agent, plaintext.decode(), nostr_sdk.Nip44Version.V2)


# --- the custody intents on a real token ----------------------------------------------------


async def owned_agent(custody: Custody) -> str:
    """SECRET_X's agent, owned by PUB_2 (whose secret the test holds, as the owner would)."""
    record = await custody.import_agent(bytearray(SECRET_X.encode()), owner=PUB_2)
    return record.pubkey


async def test_encrypt_to_owner_is_one_unseal_and_the_owner_reads_it(
    custody: Custody, unseals: list[str]
) -> None:
    agent = await owned_agent(custody)
    unseals.clear()
    texts = [f"frame {n} 🐝".encode() for n in range(40)]
    payloads = await custody.encrypt_to_owner(agent, texts)
    assert unseals == [agent]
    assert len(set(payloads)) == len(payloads)  # a fresh nonce each
    owner = nostr_sdk.SecretKey.parse(SECRET_2)
    agent_pub = nostr_sdk.PublicKey.parse(agent)
    assert [nostr_sdk.nip44_decrypt(owner, agent_pub, p).encode() for p in payloads] == texts
    assert await custody.encrypt_to_owner(agent, []) == ()
    assert unseals == [agent]  # nothing to encrypt, nothing unsealed


async def test_decrypt_from_owner_pair_opens_only_the_pair(
    custody: Custody, unseals: list[str]
) -> None:
    agent = await owned_agent(custody)
    owner = nostr_sdk.SecretKey.parse(SECRET_2)
    agent_pub = nostr_sdk.PublicKey.parse(agent)
    from_owner = nostr_sdk.nip44_encrypt(owner, agent_pub, "from the owner", nostr_sdk.Nip44Version.V2)
    # Another pair: a third key writing to the agent. Custody must not open it.
    stranger = nostr_sdk.SecretKey.parse(SECRET_1)
    from_stranger = nostr_sdk.nip44_encrypt(stranger, agent_pub, "not yours", nostr_sdk.Nip44Version.V2)
    (from_agent,) = await custody.encrypt_to_owner(agent, [b"from the agent"])
    unseals.clear()
    opened = await custody.decrypt_from_owner_pair(
        agent, [from_owner, from_stranger, from_agent, "not a payload", "#future"])
    assert opened == (b"from the owner", None, b"from the agent", None, None)
    assert unseals == [agent]


async def test_bounds_and_unknown_agents(custody: Custody) -> None:
    agent = await owned_agent(custody)
    assert len(await custody.encrypt_to_owner(agent, [b"x" * 65_535])) == 1
    for bad in ([b""], [b"x" * 65_536]):
        with pytest.raises(ValueError):
            await custody.encrypt_to_owner(agent, bad)
    with pytest.raises(TypeError):
        await custody.encrypt_to_owner(agent, ["text"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        await custody.encrypt_to_owner(agent, [b"x"] * (facade.MAX_PAYLOADS_PER_CALL + 1))
    with pytest.raises(ValueError):
        await custody.decrypt_from_owner_pair(agent, ["x"] * (facade.MAX_PAYLOADS_PER_CALL + 1))
    with pytest.raises(UnknownAgent):
        await custody.encrypt_to_owner(PUB_1, [b"x"])
    with pytest.raises(UnknownAgent):
        await custody.decrypt_from_owner_pair(PUB_1, ["x"])
