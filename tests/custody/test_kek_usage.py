"""The KEK check refuses every usage beyond encrypt/decrypt, one attribute at a time, and
a KEK usable without login (PRIVATE false).

Security review: `_check_kek` looked only at whether the key could leave the token, so a
planted or hand-made key that may DERIVE, WRAP or UNWRAP, or is MODIFIABLE, was used. Each
row plants a key under its own label that is right in every way but one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from custody import Custody, CustodyError, init_kek
from tests.fixtures.token import SoftHsmToken, plant_aes_key

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
