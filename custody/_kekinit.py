"""Making and destroying key-encryption keys: `keys init`, and rotation's KEK steps.

What runs only with an operator at the keyboard, never in a process serving requests: the
custodian and the daemon open a KEK (`_token.Token.open`), they never make or destroy one,
so they do not load this module (tests/custodian/test_size.py counts what the custodian
loads).

Rules:
- Keys are generated with `KEK_TEMPLATE` / `MAC_KEY_TEMPLATE`: not extractable, sensitive,
  private, no WRAP/UNWRAP/DERIVE, not modifiable. WARNING: they must produce keys that
  `_token`'s attribute tables (KEK_REQUIRED, GCM_REQUIRED, MAC_REQUIRED) accept.
- Where the token cannot generate keys (a TPM through tpm2-pkcs11), the operator makes
  both halves (`tpm2_ptool addkey --algorithm=aes256 --key-label=L` and
  `--algorithm=hmac:sha256 --key-label=L-mac`; docs/install.md) and `init_kek` finds and
  checks them like generated ones: only missing halves are generated.
- Every function runs in the token worker (`_token`'s session helpers require the lock).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pkcs11
from pkcs11 import Attribute, KeyType, Mechanism, MechanismFlag

from custody._errors import CustodyError
from custody._token import (
    AES_KEY_TYPES,
    KEK_BITS,
    MAC_KEY_BITS,
    MAC_KEY_TYPES,
    SEAL_PREFERENCE,
    TokenConfig,
    _acquire_session,
    _find_key,
    _load_kek,
    _offered_seals,
    _release_session,
    choose_seal,
    mac_label,
    require_kek_label,
)

__all__ = ["KEK_TEMPLATE", "MAC_KEY_TEMPLATE", "TokenReport", "destroy_kek", "init_kek",
           "kek_obtainable", "kek_present"]

log = logging.getLogger("buzz_broker.custody")

#: The templates `keys init` generates with (in addition to label, store and the size).
KEK_TEMPLATE: dict[Attribute, Any] = {
    Attribute.SENSITIVE: True,
    Attribute.EXTRACTABLE: False,
    Attribute.PRIVATE: True,
    Attribute.WRAP: False,
    Attribute.UNWRAP: False,
    Attribute.DERIVE: False,  # the PKCS#11 default, stated: KEK_REQUIRED refuses true
    Attribute.MODIFIABLE: False,
}
MAC_KEY_TEMPLATE: dict[Attribute, Any] = KEK_TEMPLATE | {
    Attribute.ENCRYPT: False,
    Attribute.DECRYPT: False,
}


@dataclass(frozen=True, slots=True)
class TokenReport:
    """What `keys init` tells the operator: public facts about the token and its KEK."""

    token_label: str
    kek_label: str
    offered: tuple[str, ...]
    can_generate: bool
    seal: str
    created: tuple[str, ...]


@contextmanager
def _logged_in(config: TokenConfig) -> Iterator[Any]:
    """The process's logged-in session for `config`, held for the block."""
    key, shared = _acquire_session(config)
    try:
        yield shared.session
    finally:
        _release_session(key)


def _can_generate(session: Any) -> bool:
    """Whether the token lists the key generation mechanisms both KEK halves need."""
    try:
        mechanisms = set(session.token.slot.get_mechanisms())
    except pkcs11.PKCS11Error:
        return False
    return Mechanism.AES_KEY_GEN in mechanisms and Mechanism.GENERIC_SECRET_KEY_GEN in mechanisms


def _generate(session: Any, config: TokenConfig, label: str, key_type: Any, bits: int,
              flags: Any, template: dict[Attribute, Any]) -> Any:
    try:
        return session.generate_key(key_type, bits, label=label, store=True,
                                    capabilities=flags, template=template)
    except pkcs11.PKCS11Error as exc:
        raise CustodyError(
            f"token {config.token_label!r} refused to generate key {label!r} "
            f"({type(exc).__name__}); on a token that cannot generate keys (a TPM), make "
            "them as docs/install.md says and run this again"
        ) from None


def init_kek(config: TokenConfig, kek_label: str | None = None) -> TokenReport:
    """Create the KEK (both halves for encrypt-then-MAC) where absent, else check it.

    Keys already in the token (a TPM's, made by the operator) are found by label and
    checked like generated ones; only missing halves are generated.

    Raises:
        CustodyError: as `Token.open`, or the token refused to generate a missing key.
    """
    label = kek_label or config.kek_label
    require_kek_label(label)
    with _logged_in(config) as session:
        offered = _offered_seals(session)
        seal = choose_seal(config.seal, offered, config.token_label)
        created: list[str] = []
        if _find_key(session, config.token_label, label, AES_KEY_TYPES) is None:
            _generate(session, config, label, KeyType.AES, KEK_BITS,
                      MechanismFlag.ENCRYPT | MechanismFlag.DECRYPT, KEK_TEMPLATE)
            created.append(label)
        if seal == "etm" and _find_key(session, config.token_label, mac_label(label),
                                       MAC_KEY_TYPES) is None:
            _generate(session, config, mac_label(label), KeyType.GENERIC_SECRET,
                      MAC_KEY_BITS, MechanismFlag.SIGN | MechanismFlag.VERIFY,
                      MAC_KEY_TEMPLATE)
            created.append(mac_label(label))
        if _load_kek(session, config, label, seal) is None:
            raise CustodyError(f"token {config.token_label!r} lost key {label!r}")
        for made in created:
            log.info("created key %r in token %r", made, config.token_label)
        return TokenReport(
            token_label=config.token_label, kek_label=label,
            offered=tuple(k for k in SEAL_PREFERENCE if k in offered),
            can_generate=_can_generate(session), seal=seal, created=tuple(created),
        )


def kek_obtainable(config: TokenConfig, label: str) -> bool:
    """Whether KEK `label` is in the token already or the token can generate it."""
    with _logged_in(config) as session:
        return (_find_key(session, config.token_label, label, AES_KEY_TYPES) is not None
                or _can_generate(session))


def kek_present(config: TokenConfig, label: str) -> bool:
    """Whether the token holds KEK `label`'s AES key (its checks are `Token.open`'s)."""
    with _logged_in(config) as session:
        return _find_key(session, config.token_label, label, AES_KEY_TYPES) is not None


def destroy_kek(config: TokenConfig, label: str) -> tuple[str, ...]:
    """Destroy KEK `label` (both halves) in `config`'s token. Returns the labels
    destroyed (none if already gone). The caller makes sure it is not the active KEK
    (`_rotation`: only a KEK the keystore records as retiring).

    Raises:
        CustodyError: the token refused to destroy a key.
    """
    with _logged_in(config) as session:
        destroyed = []
        for name, key_types in ((label, AES_KEY_TYPES), (mac_label(label), MAC_KEY_TYPES)):
            found = _find_key(session, config.token_label, name, key_types)
            if found is None:
                continue
            try:
                found.destroy()
            except pkcs11.PKCS11Error as exc:
                raise CustodyError(
                    f"token {config.token_label!r} refused to destroy key {name!r} "
                    f"({type(exc).__name__})"
                ) from None
            log.info("destroyed key %r in token %r", name, config.token_label)
            destroyed.append(name)
        return tuple(destroyed)
