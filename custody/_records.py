"""Custody's public values: what it tells the pipeline about a key, and where a memory note
lives. No secret, and nothing here imports code that handles one, so the pipeline's client
of the custodian (custody/custodian/client.py) holds these without loading the curve, the
secret buffers or NIP-44.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KeyRecord", "MemoryAddress"]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """Custody's public facts about one agent key. `deleted_at` is set on a tombstone (the
    key is destroyed). No secret, and nothing custody does not need (no name, no depth)."""

    pubkey: str
    owner: str
    auth_tag: tuple[str, str, str, str] | None
    created_at: int
    deleted_at: int | None
    mint_ref: str | None = None

    @property
    def live(self) -> bool:
        return self.deleted_at is None


@dataclass(frozen=True, slots=True)
class MemoryAddress:
    """Where an agent's memory note lives on the relay. Public."""

    author_pubkey: str
    kind: int
    d_tag: str
