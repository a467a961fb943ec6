"""Test helpers that build sealed blobs custody itself would never write, in the token worker.

Each defence test needs a blob that gets past every defence but one; these helpers make
them with custody's own seal (`_sealed.seal`) and raw token handles, never a copy of it.
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
from collections.abc import AsyncIterator, Iterator
from typing import Any
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from coincurve._libsecp256k1 import ffi
from pkcs11 import Attribute, KeyType, MechanismFlag, ObjectClass

import custody._sealed as sealed_module
import custody._kekinit as kekinit_module
import custody._token as token_module
from custody import Custody, TokenConfig, UnsealFailed, UnsignedEvent, init_kek
from custody._secret import Secret
from custody._worker import in_token_worker
from tests.custody._secrets import PUB_1, PUB_2, SECRET_1, SECRET_2
from tests.fixtures.token import SoftHsmToken, in_session

#: Every seal kind custody writes; each defence test runs for each the session token offers.
SEAL_KINDS = (pytest.param("gcm", marks=pytest.mark.token_offers("AES_GCM")), "etm")
HUMAN = "f9308a019258c31049344f85f89d5229b531c845836f99b08601f113bce036f9"
_REFUSAL = "unseal refused for agent {agent} by the {defence} defence"


@dataclass
class Held:
    custody: Custody
    config: TokenConfig
    state: Path
    kind: str
    #: (secret hex, pubkey) of two agents held.
    a: tuple[str, str] = (SECRET_1, PUB_1)
    b: tuple[str, str] = (SECRET_2, PUB_2)


def config_for(token: SoftHsmToken, kind: str, label: str) -> TokenConfig:
    return dataclasses.replace(token.config(kek_label=label), seal=kind)


@asynccontextmanager
async def held_custody(token: SoftHsmToken, kind: str, state: Path,
                       label: str | None = None) -> AsyncIterator[Held]:
    """Custody sealing with `kind`, agents A and B imported."""
    config = config_for(token, kind, label or f"sealing-{kind}")
    await init_kek(config)
    opened = await Custody.open(config, state)
    try:
        held = Held(opened, config, state, kind)
        for secret, _ in (held.a, held.b):
            await opened.import_agent(bytearray(secret.encode()), owner=HUMAN)
        yield held
    finally:
        await opened.aclose()


def secret_of(hex_secret: str) -> Secret:
    secret = Secret()
    ffi.memmove(secret.cdata, bytes.fromhex(hex_secret), 32)
    return secret


async def seal_as(held: Held, hex_secret: str, agent: str) -> bytes:
    """`hex_secret` sealed by custody's own seal with `agent`'s AAD (the key's own or not)."""
    def work() -> bytes:
        with secret_of(hex_secret) as secret:
            return sealed_module.seal(held.custody._token, secret, agent)

    return await in_token_worker(work)


def blob_of(state: Path, agent: str) -> bytes:
    db = sqlite3.connect(state / "keystore.db")
    try:
        return bytes(db.execute("SELECT sealed FROM keys WHERE pubkey = ?", (agent,))
                     .fetchone()[0])
    finally:
        db.close()


def put_blob(state: Path, agent: str, blob: bytes) -> None:
    db = sqlite3.connect(state / "keystore.db", isolation_level=None)
    try:
        db.execute("UPDATE keys SET sealed = ? WHERE pubkey = ?", (blob, agent))
    finally:
        db.close()


def event(agent: str) -> UnsignedEvent:
    return UnsignedEvent(agent, 1_700_000_000, 1, (), "defence")


async def refused_by(held: Held, agent: str, caplog: pytest.LogCaptureFixture) -> str:
    """Sign as `agent`, which must fail with the one opaque UnsealFailed; return the name of
    the defence the operator log says refused."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="buzz_broker.custody"):
        with pytest.raises(UnsealFailed) as raised:
            await held.custody.sign_event(agent, event(agent))
    # What the caller (and so an agent) learns: the same text for every defence, no cause.
    assert str(raised.value) == f"sealed key of agent {agent} failed to open"
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    named = [d for d in sealed_module.DEFENCES
             if _REFUSAL.format(agent=agent, defence=d) in caplog.text]
    assert len(named) == 1, caplog.text
    return named[0]


@contextmanager
def counting_keystream() -> Iterator[list[int]]:
    """Count calls of the token's keystream (the decrypting half of encrypt-then-MAC)."""
    calls: list[int] = []
    original = token_module.Token.keystream

    def counted(self: token_module.Token, label: str, blocks: bytes) -> bytes:
        calls.append(1)
        return original(self, label, blocks)

    token_module.Token.keystream = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        token_module.Token.keystream = original  # type: ignore[method-assign]


async def plant_unsafe_kek(config: TokenConfig, label: str, kind: str) -> None:
    """A KEK (both halves for etm) labelled `label` that is right in every way but one:
    its AES key is EXTRACTABLE."""
    def plant(session: Any) -> None:
        template = dict(kekinit_module.KEK_TEMPLATE) | {Attribute.EXTRACTABLE: True}
        session.generate_key(KeyType.AES, 256, label=label, store=True,
                             capabilities=MechanismFlag.ENCRYPT
                             | MechanismFlag.DECRYPT, template=template)
        if kind == "etm":
            session.generate_key(
                KeyType.GENERIC_SECRET, 256, label=token_module.mac_label(label),
                store=True, capabilities=MechanismFlag.SIGN | MechanismFlag.VERIFY,
                template=kekinit_module.MAC_KEY_TEMPLATE)

    await in_session(config, plant)


async def seal_under_unchecked(held: Held, label: str, hex_secret: str, agent: str) -> bytes:
    """Custody's own seal, with the KEK `label` handed to the token WITHOUT its checks."""
    def work() -> bytes:
        token = held.custody._token
        session = token_module._PROCESS.sessions[token._key].session
        aes = token_module._find_key(session, held.config.token_label, label,
                                     token_module.AES_KEY_TYPES)
        mac = token_module._find_key(session, held.config.token_label,
                                     token_module.mac_label(label),
                                     token_module.MAC_KEY_TYPES)
        saved = token.active
        token._keks[(label, held.kind)] = token_module._Kek(aes, mac)
        token.active = label
        try:
            with secret_of(hex_secret) as secret:
                return sealed_module.seal(token, secret, agent)
        finally:
            token.active = saved
            del token._keks[(label, held.kind)]

    return await in_token_worker(work)


#: What `keys init` gives a KEK's AES half.
KEK_FLAGS = MechanismFlag.ENCRYPT | MechanismFlag.DECRYPT


def make_key(session: Any, key_type: KeyType, bits: int, label: str,
             capabilities: MechanismFlag, template: dict[Attribute, object],
             set_later: dict[Attribute, object] | None = None) -> Any:
    """A token key as an operator's tool leaves it, made with `template`. With `set_later`
    it is made MODIFIABLE under a scratch label, changed, and copied to `label` unmodifiable
    (C_CopyObject), the scratch key destroyed: ALWAYS_SENSITIVE and NEVER_EXTRACTABLE then
    record the value it once had. Run in the token worker."""
    if not set_later:
        return session.generate_key(key_type, bits, label=label, store=True,
                                    capabilities=capabilities, template=template)
    scratch = session.generate_key(key_type, bits, label="scratch-" + label, store=True,
                                   capabilities=capabilities,
                                   template=template | {Attribute.MODIFIABLE: True})
    try:
        for attribute, value in set_later.items():
            scratch[attribute] = value
        return scratch.copy({Attribute.LABEL: label, Attribute.MODIFIABLE: False})
    finally:
        scratch.destroy()


def make_aes_kek(session: Any, label: str) -> Any:
    """A KEK's AES half as `keys init` makes it. Run in the token worker."""
    return make_key(session, KeyType.AES, 256, label, KEK_FLAGS, kekinit_module.KEK_TEMPLATE)


def import_key(session: Any, key_type: KeyType, label: str,
               template: dict[Attribute, object]) -> tuple[object, object]:
    """A token key made with C_CreateObject from a value its maker chose (and so knows),
    with `template`; returns what the token says of it: (ALWAYS_SENSITIVE,
    NEVER_EXTRACTABLE). Run in the token worker."""
    imported = session.create_object(
        {Attribute.CLASS: ObjectClass.SECRET_KEY, Attribute.KEY_TYPE: key_type,
         Attribute.VALUE: bytes(range(32)), Attribute.LABEL: label} | template
        | {Attribute.TOKEN: True})
    return imported[Attribute.ALWAYS_SENSITIVE], imported[Attribute.NEVER_EXTRACTABLE]
