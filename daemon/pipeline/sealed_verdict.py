"""Verdicts that hold a secret, kept sealed in the ledger: a storage.get's decrypted value.

Rules (NIP-BA: memory payloads "MUST be protected in transit, logs, and retry storage"):
- Since issue 24 a read leaves no ledger record (daemon/pipeline/recorder.py, `keeping`),
  so no new sealed verdict is written: storage.get's value is in no retry storage at all.
  Records an earlier version wrote still replay until they expire (the `[state]` read
  retention); this module opens them, and `seal` stays the one statement of their form.
- An earlier version stored a storage.get's succeeded verdict as `SEALED_MARK` followed
  by NIP-44 v2 payloads of the response bytes (chunks of at most 65,535 bytes, each cut
  between characters, newline-separated), encrypted in custody from the agent to its
  owner (`Custody.encrypt_to_owner`, one unseal). The key is the agent↔owner conversation
  key, which exists only inside custody (derived from the agent's secret, sealed under
  the token's KEK): the ledger file alone does not open it. The owner can open it, as it
  can open every memory record of the pair.
- A replay opens it again in custody (`decrypt_from_owner_pair`, one unseal) and answers
  the very same bytes. A stored form that does not open answers `failed` + `internal`
  (a read: nothing happened), never the ciphertext.
- `SEALED_MARK` (0x01) can begin neither a response (`{`) nor a compact refusal (0x00).
"""

from __future__ import annotations

from typing import Final

from daemon.operations._base import Custodian

__all__ = ["SEALED_MARK", "is_sealed", "seal", "unseal"]

SEALED_MARK: Final = b"\x01"
#: NIP-44's plaintext cap: each chunk of the response is one payload.
_CHUNK: Final = 65_535


def is_sealed(stored: bytes) -> bool:
    return stored.startswith(SEALED_MARK)


async def seal(custody: Custodian, agent: str, response: bytes) -> bytes:
    """The stored form of `response`, sealed to the agent↔owner pair."""
    payloads = await custody.encrypt_to_owner(agent, _utf8_chunks(response))
    return SEALED_MARK + "\n".join(payloads).encode("ascii")


def _utf8_chunks(data: bytes) -> list[bytes]:
    """`data` (UTF-8) cut into pieces of at most 65,535 bytes, each whole UTF-8 text:
    NIP-44 plaintexts are text, and an owner's library (rust-nostr) refuses a cut
    character."""
    chunks, start = [], 0
    while start < len(data):
        end = min(start + _CHUNK, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # never inside a character
            end -= 1
        chunks.append(data[start:end])
        start = end
    return chunks


async def unseal(custody: Custodian, agent: str, stored: bytes) -> bytes | None:
    """The response bytes a sealed stored form stands for, or None when it does not open."""
    if not is_sealed(stored):
        raise ValueError("not a sealed verdict")
    try:
        payloads = stored[len(SEALED_MARK):].decode("ascii").split("\n")
    except UnicodeDecodeError:
        return None
    opened = await custody.decrypt_from_owner_pair(agent, payloads)
    if not opened or any(chunk is None for chunk in opened):
        return None
    return b"".join(chunk for chunk in opened if chunk is not None)
