"""Portable sealing (issue 18 item 4): the seal chosen by what the token offers, the
encrypt-then-MAC construction byte for byte, format-1 blobs still opening, and keys a
token cannot generate (a TPM's) found by label and checked."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from pkcs11 import Attribute, KeyType, Mechanism, MechanismFlag, ObjectClass

import custody._sealed as sealed_module
import custody._kekinit as kekinit_module
import custody._token as token_module
from custody import Custody, CustodyError, TokenConfig, init_keys
from custody._token import choose_seal
from custody._worker import in_token_worker
from tests.custody._sealing import (
    SEAL_KINDS,
    blob_of,
    import_key,
    make_aes_kek,
    make_key,
    config_for,
    event,
    held_custody,
    put_blob,
    secret_of,
)
from tests.custody._secrets import PUB_2, SECRET_2
from tests.fixtures.token import SoftHsmToken, in_session
from tests.tokens.kinds import KINDS

_KEY = bytes(range(32))
_NONCE = bytes.fromhex("000102030405060708090a0b")


# --- the construction, byte for byte ---------------------------------------------------

@pytest.mark.token_offers("CREATE_AES_KEY")
async def test_the_token_keystream_is_aes_ctr_byte_for_byte(softhsm_token: SoftHsmToken) -> None:
    """CKM_AES_ECB in SoftHSM over nonce||BE32(0), nonce||BE32(1) (custody's counter
    blocks) equals `cryptography`'s AES-CTR from nonce||0^32, under one known key."""
    config = softhsm_token.config()

    def ecb(session: Any) -> bytes:
        known = session.create_object({  # a session object: gone at logout
            Attribute.CLASS: ObjectClass.SECRET_KEY, Attribute.KEY_TYPE: KeyType.AES,
            Attribute.VALUE: _KEY, Attribute.ENCRYPT: True, Attribute.TOKEN: False,
        })
        try:
            result: bytes = known.encrypt(sealed_module._counter_blocks(_NONCE),
                                          mechanism=Mechanism.AES_ECB)
            return result
        finally:
            known.destroy()

    reference = Cipher(algorithms.AES(_KEY), modes.CTR(_NONCE + bytes(4))).encryptor()
    assert await in_session(config, ecb) == reference.update(bytes(32))


class _ReferenceToken:
    """The token's two mechanisms done by `cryptography` with known keys, so the blob
    custody builds from them can be checked against the construction in the docstring."""

    seal = "etm"
    active = "ref-kek"
    legacy_kek = "ref-kek"
    mac_key = bytes(range(100, 132))

    def keystream(self, label: str, blocks: bytes) -> bytes:
        encryptor = Cipher(algorithms.AES(_KEY), modes.ECB()).encryptor()
        return encryptor.update(blocks) + encryptor.finalize()

    def mac(self, label: str, data: bytes) -> bytes:
        return hmac.digest(self.mac_key, data, hashlib.sha256)


@pytest.mark.token_independent
def test_an_etm_blob_is_ctr_ciphertext_and_hmac_over_len_aad_aad_nonce_ct() -> None:
    token = _ReferenceToken()
    with secret_of(SECRET_2) as secret:
        blob = sealed_module.seal(token, secret, PUB_2)  # type: ignore[arg-type]
    header = bytes([2, 2, len(token.active)]) + token.active.encode()
    assert blob.startswith(header)
    nonce = blob[len(header):len(header) + 12]
    ciphertext, tag = blob[len(header) + 12:-32], blob[-32:]
    ctr = Cipher(algorithms.AES(_KEY), modes.CTR(nonce + bytes(4))).encryptor()
    assert ciphertext == ctr.update(bytes.fromhex(SECRET_2))
    aad = b"buzz-broker/agent-key/v2\x00" + header + bytes.fromhex(PUB_2)
    mac_input = len(aad).to_bytes(4, "big") + aad + nonce + ciphertext
    assert tag == hmac.digest(token.mac_key, mac_input, hashlib.sha256)
    with sealed_module.unseal(token, blob, PUB_2) as opened:  # type: ignore[arg-type]
        assert bytes(opened.cdata) == bytes.fromhex(SECRET_2)


# --- format 1 keeps opening -------------------------------------------------------------

@pytest.mark.token_offers("AES_GCM")
async def test_a_format_1_blob_still_opens_and_signs(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    """A blob exactly as the format-1 code wrote it (0x01 || IV || AES-GCM(KEK, AAD =
    "buzz-broker/agent-key/v1:" || pubkey)), under the configured KEK, signs."""
    async with held_custody(softhsm_token, "gcm", tmp_path / "state") as held:
        token = held.custody._token

        def v1_blob() -> bytes:
            iv = bytes(range(12))
            plaintext = bytearray(bytes.fromhex(SECRET_2))
            body = token.gcm_encrypt(token.legacy_kek, iv, plaintext,
                                     b"buzz-broker/agent-key/v1:" + bytes.fromhex(PUB_2))
            return b"\x01" + iv + body

        blob = await in_token_worker(v1_blob)
        assert len(blob) == 61
        put_blob(held.state, PUB_2, blob)
        signed = await held.custody.sign_event(PUB_2, event(PUB_2))
        assert signed.pubkey == PUB_2
        # A format-1 blob carried onto another agent still fails (its AAD names the agent).
        put_blob(held.state, held.a[1], blob)
        with pytest.raises(CustodyError):
            await held.custody.sign_event(held.a[1], event(held.a[1]))


@pytest.mark.parametrize("kind", SEAL_KINDS)
async def test_new_blobs_record_their_seal_and_kek_and_every_kind_signs(
    softhsm_token: SoftHsmToken, tmp_path: Path, kind: str
) -> None:
    async with held_custody(softhsm_token, kind, tmp_path / "state") as held:
        blob = blob_of(held.state, PUB_2)
        label = held.config.kek_label.encode()
        assert blob[:3 + len(label)] == bytes([2, sealed_module.SEAL_CODES[kind], len(label)]) + label
        assert len(blob) == 3 + len(label) + 12 + 32 + (16 if kind == "gcm" else 32)
        assert (await held.custody.sign_event(PUB_2, event(PUB_2))).pubkey == PUB_2


@pytest.mark.token_offers("AES_GCM")
async def test_blobs_of_both_kinds_open_side_by_side(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    """A keystore that switched from gcm to etm (config change) keeps signing with both:
    each blob names its own seal."""
    async with held_custody(softhsm_token, "gcm", tmp_path / "state", label="switch") as held:
        pass
    config = config_for(softhsm_token, "etm", "switch")
    await init_keys(config)  # adds the HMAC half
    opened = await Custody.open(config, tmp_path / "state")
    try:
        minted = await opened.mint_agent(owner=PUB_2,
                                         mint_ref=None)
        assert blob_of(tmp_path / "state", minted.pubkey)[1] == sealed_module.SEAL_CODES["etm"]
        assert blob_of(tmp_path / "state", PUB_2)[1] == sealed_module.SEAL_CODES["gcm"]
        for agent in (minted.pubkey, PUB_2):
            assert (await opened.sign_event(agent, event(agent))).pubkey == agent
    finally:
        await opened.aclose()


# --- the choice, never a silent downgrade -------------------------------------------------

@pytest.mark.parametrize(("wanted", "offered", "chosen"), [
    ("auto", {"gcm", "etm"}, "gcm"),   # SoftHSM
    ("auto", {"etm"}, "etm"),          # TPM, opencryptoki, p11-kit 0.24
    ("etm", {"gcm", "etm"}, "etm"),    # forced by configuration
    ("gcm", {"gcm"}, "gcm"),
    ("gcm", {"etm"}, None),            # forced, absent: refused, never replaced
    ("etm", {"gcm"}, None),
    ("auto", set(), None),
    ("aes-cbc", {"gcm", "etm"}, None),
])
@pytest.mark.token_independent
def test_the_seal_is_chosen_by_what_the_token_offers(
    wanted: str, offered: set[str], chosen: str | None
) -> None:
    if chosen is None:
        with pytest.raises(CustodyError):
            choose_seal(wanted, frozenset(offered), "t")
    else:
        assert choose_seal(wanted, frozenset(offered), "t") == chosen


@pytest.mark.parametrize("kind", ["auto", *SEAL_KINDS])
async def test_keys_init_reports_what_the_token_offers_and_the_seal_it_uses(
    softhsm_token: SoftHsmToken, kind: str, tmp_path: Path
) -> None:
    config = config_for(softhsm_token, kind, f"report-{kind}-{tmp_path.name}"[:60])
    report = await init_keys(config)
    offers = KINDS[softhsm_token.kind].offers  # what the probe measured (tests/tokens)
    assert report.offered == (("gcm",) if offers["AES_GCM"] else ()) + ("etm",)
    assert report.can_generate is offers["GENERATE_KEY"]
    assert report.seal == (("gcm" if offers["AES_GCM"] else "etm") if kind == "auto" else kind)
    made = (config.kek_label,) + ((config.kek_label + "-mac",) if report.seal == "etm" else ())
    # A token that cannot generate keys has the operator's (made by `config_for`).
    assert report.created == (made if report.can_generate else ())
    assert (await init_keys(config)).created == ()  # found and checked the second time


# --- keys the operator made (a TPM cannot generate them through PKCS#11) ------------------

async def _plant_pair(config: TokenConfig, *, mac_flags: MechanismFlag,
                      mac_changes: dict[Attribute, object] | None = None,
                      mac_later: dict[Attribute, object] | None = None) -> None:
    """What `tpm2_ptool addkey --algorithm=aes256` / `hmac:sha256` leave: two keys by label.

    `mac_changes` are attributes the HMAC key is made with; `mac_later` are set after it
    was made, so that ALWAYS_SENSITIVE or NEVER_EXTRACTABLE records the value it once had:
    the key is made MODIFIABLE under a scratch label, changed, and copied to its label
    unmodifiable (C_CopyObject), the scratch key destroyed.
    """
    def plant(session: Any) -> None:
        make_aes_kek(session, config.kek_label)
        template: dict[Attribute, object] = {
            Attribute.SENSITIVE: True, Attribute.EXTRACTABLE: False,
            Attribute.PRIVATE: True, Attribute.MODIFIABLE: False, **(mac_changes or {})}
        make_key(session, KeyType.GENERIC_SECRET, 256,
                 token_module.mac_label(config.kek_label), mac_flags, template, mac_later)

    await in_session(config, plant)


@pytest.mark.token_offers("GENERATE_KEY")
async def test_keys_init_finds_operator_made_keys_by_label_and_makes_none(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    config = config_for(softhsm_token, "etm", f"made-{tmp_path.name}"[:60])
    await _plant_pair(config, mac_flags=MechanismFlag.SIGN | MechanismFlag.VERIFY)
    report = await init_keys(config)
    assert report.created == () and report.seal == "etm"
    opened = await Custody.open(config, tmp_path / "state")
    await opened.aclose()


_SIGNS = MechanismFlag.SIGN | MechanismFlag.VERIFY
#: `MAC_REQUIRED` row -> an HMAC key right in every way but that row: (capabilities, the
#: attributes it is made with, those set after it was made).
_MAC_WRONG: dict[Attribute, tuple[MechanismFlag, dict[Attribute, object],
                                  dict[Attribute, object]]] = {
    Attribute.EXTRACTABLE: (_SIGNS, {Attribute.EXTRACTABLE: True}, {}),
    # Not sensitive means never always-sensitive either: refused by the first, by name.
    Attribute.SENSITIVE: (_SIGNS, {Attribute.SENSITIVE: False}, {}),
    # Readable once, sensitive now: its value may be known outside the token.
    Attribute.ALWAYS_SENSITIVE: (_SIGNS, {Attribute.SENSITIVE: False},
                                 {Attribute.SENSITIVE: True}),
    # Extractable once, locked now: it may have been wrapped out meanwhile.
    Attribute.NEVER_EXTRACTABLE: (_SIGNS, {Attribute.EXTRACTABLE: True},
                                  {Attribute.EXTRACTABLE: False}),
    Attribute.PRIVATE: (_SIGNS, {Attribute.PRIVATE: False}, {}),
    # A session object: it lives only while the `custody` fixture holds the session open.
    Attribute.TOKEN: (_SIGNS, {Attribute.TOKEN: False}, {}),
    Attribute.VALUE_LEN: (_SIGNS, {Attribute.VALUE_LEN: 16}, {}),  # a 128-bit key
    Attribute.SIGN: (MechanismFlag.VERIFY, {}, {}),
    Attribute.ENCRYPT: (_SIGNS | MechanismFlag.ENCRYPT, {}, {}),
    Attribute.DECRYPT: (_SIGNS | MechanismFlag.DECRYPT, {}, {}),
    Attribute.DERIVE: (_SIGNS | MechanismFlag.DERIVE, {}, {}),
    Attribute.WRAP: (_SIGNS | MechanismFlag.WRAP, {}, {}),
    Attribute.UNWRAP: (_SIGNS | MechanismFlag.UNWRAP, {}, {}),
    Attribute.MODIFIABLE: (_SIGNS, {Attribute.MODIFIABLE: True}, {}),
}
#: Every row of `MAC_REQUIRED`, then any planted above that it lacks: a row added there
#: with no key planted here fails, and so does a row dropped there (its key is accepted).
_MAC_ROWS = [*token_module.MAC_REQUIRED,
             *(row for row in _MAC_WRONG if row not in token_module.MAC_REQUIRED)]


@pytest.mark.token_offers("GENERATE_KEY")
@pytest.mark.parametrize("wrong", _MAC_ROWS, ids=lambda row: row.name)
async def test_an_operator_made_hmac_key_wrong_in_one_attribute_is_refused_by_name(
    softhsm_token: SoftHsmToken, tmp_path: Path, wrong: Attribute, custody: Custody,
) -> None:
    assert wrong in _MAC_WRONG, f"MAC_REQUIRED has a row {wrong.name} no test plants a key for"
    flags, made_with, set_later = _MAC_WRONG[wrong]
    config = config_for(softhsm_token, "etm", f"bad-{wrong.name}-{tmp_path.name}"[:60])
    await _plant_pair(config, mac_flags=flags, mac_changes=made_with, mac_later=set_later)
    # Every MAC_REQUIRED refusal starts with the attribute's name; ": " tells SENSITIVE
    # from ALWAYS_SENSITIVE.
    refusal = re.escape(f"refusing KEK HMAC key {token_module.mac_label(config.kek_label)!r}: "
                        f"{wrong.name} is")
    with pytest.raises(CustodyError, match=refusal):
        await init_keys(config)
    with pytest.raises(CustodyError, match=refusal):
        await Custody.open(config, tmp_path / "state")


@pytest.mark.token_offers("CREATE_AES_KEY", "MARKS_IMPORTED_KEYS")
async def test_an_imported_hmac_key_is_refused_as_once_readable(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    """An HMAC key made with C_CreateObject from a value its maker chose (and so knows),
    right in every attribute that can be set: the token marks it neither ALWAYS_SENSITIVE
    nor NEVER_EXTRACTABLE, and it is refused for that."""
    config = config_for(softhsm_token, "etm", f"imported-{tmp_path.name}"[:60])
    label = token_module.mac_label(config.kek_label)

    def plant(session: Any) -> tuple[object, object]:
        make_aes_kek(session, config.kek_label)
        return import_key(session, KeyType.GENERIC_SECRET, label,
                          {Attribute.SIGN: True, Attribute.VERIFY: True}
                          | kekinit_module.MAC_KEY_TEMPLATE)

    assert await in_session(config, plant) == (False, False)
    once_readable = re.escape(f"refusing KEK HMAC key {label!r}: ") + (
        "(ALWAYS_SENSITIVE|NEVER_EXTRACTABLE) is false")
    with pytest.raises(CustodyError, match=once_readable):
        await init_keys(config)
    with pytest.raises(CustodyError, match=once_readable):
        await Custody.open(config, tmp_path / "state")


@pytest.mark.token_offers("GENERATE_KEY")
async def test_an_aes_key_under_the_hmac_label_is_not_the_hmac_half(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    """The HMAC half is looked up only among MAC_KEY_TYPES: an AES key labelled `L-mac`,
    right in every MAC_REQUIRED row (it may SIGN: AES-CMAC), is not found as L's HMAC key.
    `keys init` then makes the HMAC half beside it, and L opens."""
    config = config_for(softhsm_token, "etm", f"aesmac-{tmp_path.name}"[:60])
    label = token_module.mac_label(config.kek_label)

    def plant(session: Any) -> None:
        make_aes_kek(session, config.kek_label)
        session.generate_key(KeyType.AES, 256, label=label, store=True,
                             capabilities=_SIGNS,
                             template=kekinit_module.MAC_KEY_TEMPLATE)

    await in_session(config, plant)
    with pytest.raises(CustodyError, match=re.escape(
            f"has the AES key {config.kek_label!r} but not its HMAC key {label!r}")):
        await Custody.open(config, tmp_path / "state")
    assert (await init_keys(config)).created == (label,)
    opened = await Custody.open(config, tmp_path / "state")
    await opened.aclose()


async def test_a_forced_seal_the_token_lacks_is_refused_at_init_and_open(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token that lists no AES-GCM (as the TPM, opencryptoki and p11-kit 0.24): "gcm"
    forced is refused; "auto" takes encrypt-then-MAC and says so."""
    for module in (token_module, kekinit_module):  # Token.open's check, and keys init's
        monkeypatch.setattr(module, "_offered_seals", lambda session: frozenset({"etm"}))
    forced = config_for(softhsm_token, "gcm", f"nogcm-{tmp_path.name}"[:60])
    with pytest.raises(CustodyError, match="does not offer the mechanisms of seal 'gcm'"):
        await init_keys(forced)
    auto = dataclasses.replace(forced, seal="auto")
    report = await init_keys(auto)
    assert report.seal == "etm" and report.offered == ("etm",)
    with pytest.raises(CustodyError, match="does not offer"):
        await Custody.open(forced, tmp_path / "state")
