"""The KEK check refuses every usage beyond encrypt/decrypt, one attribute at a time, and
a KEK usable without login (PRIVATE false).

Security review: `_check_kek` looked only at whether the key could leave the token, so a
planted or hand-made key that may DERIVE, WRAP or UNWRAP, or is MODIFIABLE, was used. Each
row plants a key under its own label that is right in every way but one.

A mutation review then found the rows about the key itself unguarded: one that is, or once
was, readable or extractable (SENSITIVE, ALWAYS_SENSITIVE, NEVER_EXTRACTABLE; a key
imported with C_CreateObject), a session object (TOKEN), an AES-128 key (VALUE_LEN). Those
are `_MATERIAL`; between them the two tables plant a key for every row of `KEK_REQUIRED`
and `GCM_REQUIRED`, and a test says so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pkcs11 import Attribute, KeyType

import custody._kekinit as kekinit_module
import custody._token as token_module
from custody import Custody, CustodyError, TokenConfig, init_kek
from tests.custody._sealing import KEK_FLAGS, import_key, make_key
from tests.fixtures.token import SoftHsmToken, in_session, plant_aes_key

#: The one wrong attribute -> (capabilities, template changes) that make it wrong.
_WRONG: dict[str, tuple[tuple[str, ...], dict[str, bool]]] = {
    "DERIVE": (("ENCRYPT", "DECRYPT", "DERIVE"), {}),
    "WRAP": (("ENCRYPT", "DECRYPT", "WRAP"), {}),
    "UNWRAP": (("ENCRYPT", "DECRYPT", "UNWRAP"), {}),
    "MODIFIABLE": (("ENCRYPT", "DECRYPT"), {"MODIFIABLE": True}),
    # Not a usage, but the same kind of hole: a public key object is usable by any
    # session on the token, logged in or not (issue 22: no test guarded it).
    "PRIVATE": (("ENCRYPT", "DECRYPT"), {"PRIVATE": False}),
    "ENCRYPT": (("DECRYPT",), {}),
    "DECRYPT": (("ENCRYPT",), {}),
}


# DECRYPT is required only where the KEK opens AES-GCM (encrypt-then-MAC never decrypts).
@pytest.mark.parametrize("wrong", [
    pytest.param(w, marks=pytest.mark.token_offers("AES_GCM")) if w == "DECRYPT" else w
    for w in _WRONG])
async def test_a_kek_wrong_in_one_usage_attribute_is_refused_by_name(
    softhsm_token: SoftHsmToken, tmp_path: Path, wrong: str
) -> None:
    config = softhsm_token.config(kek_label=f"usage-{wrong.lower()}")
    flags, changes = _WRONG[wrong]
    await plant_aes_key(config, capabilities=flags, **({"MODIFIABLE": False} | changes))
    with pytest.raises(CustodyError, match=f"{wrong} is"):
        opened = await Custody.open(config, tmp_path / "state")
        await opened.aclose()
    with pytest.raises(CustodyError, match=f"{wrong} is"):
        await init_kek(config)  # keys init checks a present key the same way


@pytest.mark.token_offers("GENERATE_KEY")
async def test_the_kek_keys_init_makes_passes_every_check(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    config = softhsm_token.config(kek_label="usage-made-by-init")
    assert await init_kek(config) is True
    assert await init_kek(config) is False  # found again and checked
    opened = await Custody.open(config, tmp_path / "state")
    await opened.aclose()


@pytest.mark.token_offers("GENERATE_KEY")
async def test_a_refused_twin_kek_search_leaves_the_shared_session_usable(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    """Two keys under one label: refused, and the search is finished at once, so the next
    search on the process's shared session (another Custody held open) is not blocked by
    an operation left active until the garbage collector runs."""
    import gc

    good = softhsm_token.config(kek_label="usage-good")
    twin = softhsm_token.config(kek_label="usage-twin")
    assert await init_kek(good) is True
    assert await init_kek(twin) is True
    await plant_aes_key(twin, MODIFIABLE=False)
    held = await Custody.open(good, tmp_path / "held")  # keeps the shared session alive
    gc.disable()  # a collection must not be what finishes the search
    try:
        for _ in range(3):
            with pytest.raises(CustodyError, match="more than one"):
                await Custody.open(twin, tmp_path / "twin")
            again = await Custody.open(good, tmp_path / "again")
            await again.aclose()
    finally:
        gc.enable()
        await held.aclose()


#: The rows about the key itself rather than its usage: the one wrong attribute -> (bits,
#: attributes it is made with, attributes set after it was made, what the refusal says).
#: A key changed after it was made is copied to its label unmodifiable (C_CopyObject), so
#: ALWAYS_SENSITIVE and NEVER_EXTRACTABLE keep the value it once had.
_MATERIAL: dict[str, tuple[int, dict[str, bool], dict[str, bool], str]] = {
    "EXTRACTABLE": (256, {"EXTRACTABLE": True}, {}, "EXTRACTABLE is true"),
    # Not sensitive means never always-sensitive either: refused by the first, by name.
    "SENSITIVE": (256, {"SENSITIVE": False}, {}, "SENSITIVE is false"),
    # Readable once, sensitive now: its value may be known outside the token.
    "ALWAYS_SENSITIVE": (256, {"SENSITIVE": False}, {"SENSITIVE": True},
                         "ALWAYS_SENSITIVE is false"),
    # Extractable once, locked now: it may have been wrapped out meanwhile.
    "NEVER_EXTRACTABLE": (256, {"EXTRACTABLE": True}, {"EXTRACTABLE": False},
                          "NEVER_EXTRACTABLE is false"),
    # A session object: it lives only while the `custody` fixture holds the session open.
    "TOKEN": (256, {"TOKEN": False}, {}, "TOKEN is false"),
    "VALUE_LEN": (128, {}, {}, "it is not a 256-bit key"),
}


@pytest.mark.token_independent
def test_every_kek_row_has_a_key_planted_wrong_in_it() -> None:
    rows = token_module.KEK_REQUIRED | token_module.GCM_REQUIRED
    assert {row.name for row in rows} == _WRONG.keys() | _MATERIAL.keys()


async def _plant(config: TokenConfig, bits: int, made_with: dict[str, bool],
                 set_later: dict[str, bool]) -> None:
    """An AES key labelled `config.kek_label`, as `keys init` makes one but for `made_with`
    and `set_later`."""
    def plant(session: Any) -> None:
        make_key(session, KeyType.AES, bits, config.kek_label, KEK_FLAGS,
                 kekinit_module.KEK_TEMPLATE
                 | {Attribute[name]: value for name, value in made_with.items()},
                 {Attribute[name]: value for name, value in set_later.items()})

    await in_session(config, plant)


@pytest.mark.token_offers("GENERATE_KEY")
@pytest.mark.parametrize("wrong", list(_MATERIAL))
async def test_a_kek_that_is_or_was_readable_or_is_not_aes_256_is_refused_by_name(
    softhsm_token: SoftHsmToken, tmp_path: Path, wrong: str, custody: Custody
) -> None:
    config = softhsm_token.config(kek_label=f"material-{wrong.lower()}")
    bits, made_with, set_later, says = _MATERIAL[wrong]
    await _plant(config, bits, made_with, set_later)
    refusal = re.escape(f"refusing KEK {config.kek_label!r}: {says}")
    with pytest.raises(CustodyError, match=refusal):
        opened = await Custody.open(config, tmp_path / "state")
        await opened.aclose()
    with pytest.raises(CustodyError, match=refusal):
        await init_kek(config)


@pytest.mark.token_offers("CREATE_AES_KEY", "MARKS_IMPORTED_KEYS")
async def test_an_imported_kek_is_refused_as_once_readable(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    """A KEK made with C_CreateObject from a value its maker chose (and so knows), right
    in every attribute that can be set: the token marks it neither ALWAYS_SENSITIVE nor
    NEVER_EXTRACTABLE, and it is refused for that."""
    config = softhsm_token.config(kek_label="material-imported")

    def plant(session: Any) -> tuple[object, object]:
        return import_key(session, KeyType.AES, config.kek_label,
                          {Attribute.ENCRYPT: True, Attribute.DECRYPT: True}
                          | kekinit_module.KEK_TEMPLATE)

    assert await in_session(config, plant) == (False, False)
    once_readable = re.escape(f"refusing KEK {config.kek_label!r}: ") + (
        "(ALWAYS_SENSITIVE|NEVER_EXTRACTABLE) is false")
    with pytest.raises(CustodyError, match=once_readable):
        opened = await Custody.open(config, tmp_path / "state")
        await opened.aclose()
    with pytest.raises(CustodyError, match=once_readable):
        await init_kek(config)
