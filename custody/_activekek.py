"""Where the agents' keys are sealed: the token and KEK the keystore records as active.

Before any rotation the configured token and KEK; after `keys rotate` / `keys migrate`
(`_rotation`, which alone writes these names) the keystore's `custody_meta` says. Every
process that opens custody reads it (`recorded_kek`) and refuses a configuration naming
another token than the one holding the keys. Public facts only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from custody._errors import CustodyError
from custody._keystore import read_meta
from custody._token import TokenConfig

__all__ = ["ActiveKek", "active_kek", "interrupted", "recorded_kek", "require_configured"]

#: custody_meta names (public facts only).
ACTIVE_TOKEN = "active_token"
ACTIVE_KEK = "active_kek"
PLAN_TOKEN = "rotation_target_token"
PLAN_KEK = "rotation_target_kek"
RETIRING_TOKEN = "retiring_token"
RETIRING_KEK = "retiring_kek"


@dataclass(frozen=True, slots=True)
class ActiveKek:
    """Where the agents' blobs are sealed: a token label and a KEK label in it."""

    token_label: str
    kek_label: str


def active_kek(meta: dict[str, str], config: TokenConfig) -> ActiveKek:
    """The keystore's record, else (before any rotation) the configured token and KEK."""
    return ActiveKek(meta.get(ACTIVE_TOKEN, config.token_label),
                     meta.get(ACTIVE_KEK, config.kek_label))


def require_configured(active: ActiveKek, config: TokenConfig) -> None:
    """Refuse a configuration that names another token than the one holding the keys."""
    if active.token_label != config.token_label:
        raise CustodyError(
            f"the agents' keys are sealed in token {active.token_label!r} (moved by `keys "
            f"migrate`), not {config.token_label!r}: point [pkcs11] at that token"
        )


def interrupted(meta: dict[str, str]) -> str | None:
    """What an interrupted rotation or migration left for the next run, if anything."""
    if RETIRING_KEK in meta:
        return (f"the old KEK {meta[RETIRING_KEK]!r} in token {meta[RETIRING_TOKEN]!r} "
                "is not yet recorded as destroyed")
    if PLAN_KEK in meta:
        return (f"a rotation to KEK {meta[PLAN_KEK]!r} in token {meta[PLAN_TOKEN]!r} "
                "did not finish (the agents are still under the old KEK)")
    return None


def recorded_kek(token: TokenConfig, state_dir: Path) -> ActiveKek:
    """The active KEK the keystore records (read-only: creates nothing), checked to be in
    the configured token."""
    active = active_kek(read_meta(state_dir), token)
    require_configured(active, token)
    return active
