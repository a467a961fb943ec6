"""Published vectors: BIP-340 vector 0, NIP-AE K_c and d-tags, NIP-OA, and secret parsing."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import coincurve
import nostr_sdk
import pytest

from custody import CustodyError, owner_tag_digest, verify_owner_tag
from custody._nipae import d_tag
from custody._nip44 import conversation_key as _conversation_key
from custody._secp256k1 import schnorr_sign, xonly_pubkey
from custody._secret import Secret, parse_secret_text
from custody._signer import make_owner_tag
from tests.custody._secrets import PUB_1, PUB_2, SECRET_1, SECRET_2, SECRET_3, SECRET_X

#: Opens no session token: the other-token runs deselect it (tests/fixtures/token.py).
pytestmark = pytest.mark.token_independent


def secret(hex_text: str) -> Secret:
    return parse_secret_text(bytearray(hex_text.encode()))


def test_bip340_vector_0() -> None:
    with secret(SECRET_3) as s:
        sig = schnorr_sign(s, bytes(32), bytes(32))
        assert xonly_pubkey(s).hex().upper() == (
            "F9308A019258C31049344F85F89D5229B531C845836F99B08601F113BCE036F9"
        )
    assert sig.hex().upper() == (
        "E907831F80848D1069A5371B402410364BDF1C5F8307B0084C55F1CE2DCA8215"
        "25F66A4A85EA8B71E482A74F382D2CE5EBEEE8FDB2172F477DF4900D310536C0"
    )


def test_nip_ae_conversation_key_and_d_tags() -> None:
    with secret(SECRET_1) as agent:
        assert _conversation_key(agent, PUB_2).hex() == (
            "c41c775356fd92eadc63ff5a0dc1da211b268cbea22316767095b2871ea1412d"
        )
        assert d_tag(agent, PUB_2, "core") == (
            "bdc233238ffe52e272b44cc233c8f33a2bc510b08be04495b225964283be4a90"
        )
        assert d_tag(agent, PUB_2, "mem/example") == (
            "72d4f9629106451505d7d341ea85bb3ebad4f654fcfd2aad100d5a35f8a85cba"
        )
        assert d_tag(agent, PUB_2, "mem/notes/2026-05-12") == (
            "31651571a312780cfdc1f0b706b682ac9f3f51a053e8dca76fe57710bae5a4d4"
        )


@pytest.mark.parametrize("slug", ["", "Core", "mem/", "mem/Upper", "mem/a//b", "x" * 300, "mem/" + "a" * 65])
def test_nip_ae_refuses_bad_slugs(slug: str) -> None:
    with secret(SECRET_1) as agent, pytest.raises(ValueError):
        d_tag(agent, PUB_2, slug)


NIP_OA_CONDITIONS = "kind=1&created_at<1713957000"
NIP_OA_SIG = (
    "8b7df2575caf0a108374f8471722b233c53f9ff827a8b0f91861966c3b9dd5cb"
    "2e189eae9f49d72187674c2f5bd244145e10ff86c9f257ffe65a1ee5f108b369"
)


def test_nip_oa_published_vector() -> None:
    digest = owner_tag_digest(PUB_2, NIP_OA_CONDITIONS)
    assert digest.hex() == "08cdecd55af4c28d3801fd69615dcf5cc04fab3bc134b38a840bf157197069a6"
    assert digest == hashlib.sha256(
        f"nostr:agent-auth:{PUB_2}:{NIP_OA_CONDITIONS}".encode()
    ).digest()
    assert verify_owner_tag(["auth", PUB_1, NIP_OA_CONDITIONS, NIP_OA_SIG], PUB_2)
    # The same signature does not transfer: other conditions, other agent, swapped roles.
    assert not verify_owner_tag(["auth", PUB_1, "", NIP_OA_SIG], PUB_2)
    assert not verify_owner_tag(["auth", PUB_1, NIP_OA_CONDITIONS, NIP_OA_SIG], PUB_1)
    assert not verify_owner_tag(["auth", PUB_2, NIP_OA_CONDITIONS, NIP_OA_SIG], PUB_2)


def test_our_owner_tags_verify() -> None:
    with secret(SECRET_1) as owner:
        tag = make_owner_tag(owner, PUB_1, PUB_2)
        fixed = make_owner_tag(owner, PUB_1, PUB_2, _aux=bytes(32))
    assert tag[:3] == ("auth", PUB_1, "")
    assert verify_owner_tag(tag, PUB_2) and verify_owner_tag(fixed, PUB_2)
    assert tag != fixed  # random aux in production


def test_owner_cannot_own_itself() -> None:
    with secret(SECRET_1) as owner, pytest.raises(ValueError):
        make_owner_tag(owner, PUB_1, PUB_1)


def _signed(owner_secret: str, digest: bytes) -> str:
    with secret(owner_secret) as owner:
        return schnorr_sign(owner, digest, bytes(32)).hex()


#: A NIP-OA tag wrong in one way, around a valid signature by its owner PUB_1 -> (the tag
#: around the signature, the agent it is checked for, the agent and conditions signed).
_WRONG_OWNER_TAGS: dict[str, tuple[Callable[[str], list[object]], str, str, str]] = {
    # NIP-OA: the owner is not the agent; an agent vouching for itself vouches for nothing.
    "owner is the agent": (lambda sig: ["auth", PUB_1, "", sig], PUB_1, PUB_1, ""),
    "not named auth": (lambda sig: ["delegation", PUB_1, "", sig], PUB_2, PUB_2, ""),
    # The digest formats whatever it is given: 0 would be taken as the conditions "0".
    "conditions not a string": (lambda sig: ["auth", PUB_1, 0, sig], PUB_2, PUB_2, "0"),
    "a fifth item": (lambda sig: ["auth", PUB_1, "", sig, ""], PUB_2, PUB_2, ""),
    "no conditions": (lambda sig: ["auth", PUB_1, sig], PUB_2, PUB_2, ""),
}


@pytest.mark.parametrize("wrong", list(_WRONG_OWNER_TAGS))
def test_a_validly_signed_owner_tag_wrong_in_one_way_does_not_verify(wrong: str) -> None:
    tag_around, agent, signed_agent, signed_conditions = _WRONG_OWNER_TAGS[wrong]
    digest = owner_tag_digest(signed_agent, signed_conditions)
    sig = _signed(SECRET_1, digest)
    # Positive control: the signature is PUB_1's, valid over what it signed.
    assert coincurve.PublicKeyXOnly(bytes.fromhex(PUB_1)).verify(bytes.fromhex(sig), digest)
    assert not verify_owner_tag(tag_around(sig), agent)  # type: ignore[arg-type]


#: NIP-OA's conditions grammar: `""` or `&`-joined `kind=N` (0..65535), `created_at<T`,
#: `created_at>T` (0..2^32-1), decimals canonical, no whitespace; its invalid vectors first.
_CONDITIONS = {
    "kind=1&": False, "kind=01": False, "&kind=1": False, "kind=1&&kind=2": False,
    " kind=1": False, "kind=1 ": False, "Kind=1": False, "kind= 1": False, "kind=+1": False,
    "kind=-1": False, "foo=1": False, "kind<1": False, "kind=65536": False,
    "created_at<4294967296": False, "created_at>99999999999": False, "kind=": False,
    "kind=١": False, "&": False,
    "": True, "kind=0": True, "kind=65535": True, "created_at>0": True,
    "created_at<4294967295": True, "kind=1&kind=1&created_at>5": True,
}


@pytest.mark.parametrize("conditions", list(_CONDITIONS))
def test_an_owner_tag_verifies_only_with_conditions_nip_oa_can_read(conditions: str) -> None:
    """NIP-OA: verifiers MUST reject an unsupported clause or a malformed decimal, whatever
    the signature says; the signature here is valid over the conditions as written."""
    sig = _signed(SECRET_1, owner_tag_digest(PUB_2, conditions))
    assert verify_owner_tag(["auth", PUB_1, conditions, sig], PUB_2) is _CONDITIONS[conditions]


@pytest.mark.parametrize("secret_hex", [SECRET_1, SECRET_2, SECRET_X])
def test_secret_text_forms_agree(secret_hex: str) -> None:
    nsec = nostr_sdk.SecretKey.parse(secret_hex).to_bech32()
    forms = [secret_hex, secret_hex.upper(), f"  {secret_hex}\n", nsec, nsec.upper(), nsec + "\r\n"]
    pubs = set()
    for form in forms:
        text = bytearray(form.encode())
        with parse_secret_text(text) as s:
            pubs.add(xonly_pubkey(s).hex())
        assert text == bytearray(len(text)), "the input buffer must be zeroed"
    assert pubs == {nostr_sdk.Keys.parse(secret_hex).public_key().to_hex()}


N = "FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "zz",
        SECRET_1[:-1],
        SECRET_1 + "0",
        SECRET_1[:-1] + "g",
        "0" * 64,  # zero is not a key
        N,  # the group order is not a key
        nostr_sdk.SecretKey.parse(SECRET_X).to_bech32()[:-1] + "q",  # checksum broken
        "Nsec1" + nostr_sdk.SecretKey.parse(SECRET_X).to_bech32()[5:],  # mixed case
        "npub1" + nostr_sdk.SecretKey.parse(SECRET_X).to_bech32()[5:],  # wrong prefix
    ],
)
def test_malformed_secret_text_is_refused_without_echo(text: str) -> None:
    buf = bytearray(text.encode())
    with pytest.raises(CustodyError, match="malformed secret") as caught:
        parse_secret_text(buf)
    assert buf == bytearray(len(buf))
    if text:
        assert text not in str(caught.value)


def test_secret_repr_redacts() -> None:
    with secret(SECRET_X) as s:
        assert "redacted" in repr(s) and SECRET_X not in repr(s) + str(s)


def test_custody_imports_nothing_from_daemon() -> None:
    import ast
    from pathlib import Path

    import custody

    for path in Path(custody.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "daemon" or n.startswith("daemon.") for n in names), path.name
