"""Backups of every live agent to offline age recipients: the format, and writing one.
HAZARDOUS.

The one deliberate, bounded exception to "a secret never leaves custody" (design.md): the
secrets are unsealed here, inside one token-worker hop, written into one buffer, encrypted
in memory to the operator's age X25519 recipients (pyrage), and wiped; only ciphertext
leaves this module. Opening and restoring one is custody/_restore.py (the mirror: decrypt
in memory, check everything, seal each secret under this host's KEK, wipe); the custodian
loads only this half.

Plaintext format (only ever inside the age file; never on disk in clear):
    b"buzz-broker-backup/v2 " canonical-JSON header b"\\n"   header: {"agents": N, "createdAt": T}
    per agent:  64 lowercase hex (the secret key) b" " canonical-JSON record b"\\n"
    record v2: {"authTag", "createdAt", "mintRef", "owner", "pubkey", "public"}
`public` is the JSON object the caller handed in for that agent (the daemon's directory
entry: its name and creator), bounded by MAX_PUBLIC_BYTES and otherwise opaque: custody
holds no names, so it carries them for the caller and gives them back on restore.
Version 1 (written before custody held only keys) is still read (custody/_restore.py).

The secret sits at a fixed offset of its line, so a reader copies it from the decrypted
buffer into a bytearray without a `str` of it ever existing; only the public record goes
through `json`.

Rules:
- Errors are `CustodyError` with one line that never quotes a secret.
- Every buffer that holds secrets is allocated at its final size and filled in place (a
  bytearray that grows leaves what it held in the buffer it outgrew, freed unzeroed).
  What is best effort (as in `_secret`): pyrage takes and returns immutable `bytes`, so
  the whole plaintext exists once as a `bytes` object; it is zeroed in place by
  `wipe_bytes` (CPython) right after use. The Rust side's own buffers are out of our reach.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyrage

from custody._errors import CustodyError
from custody._keystore import KeyRecord
from custody._secret import SECRET_SIZE, Secret, wipe_bytes

if TYPE_CHECKING:
    from custody._facade import Custody

__all__ = ["ExportedBackup", "export_backup", "check_recipients", "MAX_PUBLIC_BYTES",
           "PREFIX", "FORMAT"]

#: The format line's prefix; the version follows it.
PREFIX = b"buzz-broker-backup/v"
#: The version `export_backup` writes.
FORMAT = 2
#: The caller's public object for one agent, canonical JSON.
MAX_PUBLIC_BYTES = 4096
_HEX_DIGITS = b"0123456789abcdef"
_SECRET_HEX = 2 * SECRET_SIZE

def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _record_json(record: KeyRecord, public: Mapping[str, object]) -> bytes:
    if len(_canonical(dict(public))) > MAX_PUBLIC_BYTES:
        raise CustodyError(f"agent {record.pubkey}: its public entry is larger than "
                           f"{MAX_PUBLIC_BYTES} bytes")
    return _canonical({
        "authTag": list(record.auth_tag) if record.auth_tag is not None else None,
        "createdAt": record.created_at,
        "mintRef": record.mint_ref,
        "owner": record.owner,
        "pubkey": record.pubkey,
        "public": dict(public),
    })


def _zero(buf: bytearray) -> None:
    buf[:] = bytes(len(buf))


def _write_hex(out: bytearray, at: int, secret: Secret) -> None:
    """Write the secret as 64 lowercase hex digits at `out[at:]`, byte by byte (no copy)."""
    data = secret.cdata
    for i in range(SECRET_SIZE):
        value = data[i]
        out[at + 2 * i] = _HEX_DIGITS[value >> 4]
        out[at + 2 * i + 1] = _HEX_DIGITS[value & 15]


def check_recipients(texts: Sequence[str]) -> None:
    """CustodyError unless every text is an age X25519 recipient (at least one)."""
    _recipients(texts)


def _recipients(texts: Sequence[str]) -> list[pyrage.x25519.Recipient]:
    if not texts:
        raise CustodyError("a backup needs at least one age recipient (age1…)")
    recipients = []
    for number, text in enumerate(texts, 1):
        try:
            recipients.append(pyrage.x25519.Recipient.from_str(text.strip()))
        except (pyrage.RecipientError, ValueError, TypeError):
            # Never quoted: an age identity given by mistake opens every backup.
            raise CustodyError(f"recipient {number} is not an age X25519 recipient (age1…); "
                               "not shown, as it may be an identity (a secret)") from None
    return recipients


@dataclass(frozen=True, slots=True)
class ExportedBackup:
    """What a backup wrote: ciphertext only, and the public keys of the agents inside."""

    ciphertext: bytes
    agents: tuple[str, ...]


async def export_backup(custody: Custody, recipients: Sequence[str],
                        public: Mapping[str, Mapping[str, object]] | None = None
                        ) -> ExportedBackup:
    """Encrypt every live agent (secret key, key record, and `public[pubkey]`: the caller's
    public entry, `{}` if absent) to `recipients`, in memory.

    Each secret is unsealed (authenticated, re-derived and compared, like any use) and hex
    encoded into one buffer inside a single token-worker hop; the buffer is encrypted with
    age and zeroed before the hop ends. Agents are in the order they were made.

    Raises:
        CustodyError: a recipient that is not `age1…`, a public entry over MAX_PUBLIC_BYTES,
            an agent whose key does not open (UnsealFailed), token or keystore faults. No
            partial backup is returned.
    """
    parsed = _recipients(recipients)
    entries = public or {}
    listed: list[KeyRecord] = []

    def work() -> bytes:
        # Listed inside the hop: no agent minted or destroyed meanwhile is half in it.
        records = custody._keystore.all()
        listed.extend(records)
        header = (PREFIX + str(FORMAT).encode() + b" "
                  + _canonical({"agents": len(records), "createdAt": int(time.time())}))
        lines = [b" " + _record_json(record, entries.get(record.pubkey, {})) + b"\n"
                 for record in records]
        # Sized once and filled in place: a bytearray that grew would leave the secrets it
        # held so far in the freed, unzeroed buffer it outgrew.
        plaintext = bytearray(len(header) + 1 + sum(_SECRET_HEX + len(line) for line in lines))
        plaintext[: len(header) + 1] = header + b"\n"
        at = len(header) + 1
        copy = b""
        try:
            for record, line in zip(records, lines):
                with custody._unseal(record.pubkey) as secret:
                    _write_hex(plaintext, at, secret)
                plaintext[at + _SECRET_HEX : at + _SECRET_HEX + len(line)] = line
                at += _SECRET_HEX + len(line)
            copy = bytes(plaintext)  # pyrage takes bytes only: one immutable copy, wiped below
            ciphertext: bytes = pyrage.encrypt(copy, parsed)
            return ciphertext
        except pyrage.EncryptError:
            raise CustodyError("age encryption of the backup failed") from None
        finally:
            wipe_bytes(copy)
            _zero(plaintext)

    custody._check_open()
    ciphertext = await custody._hop("backup", work)
    return ExportedBackup(ciphertext=ciphertext, agents=tuple(r.pubkey for r in listed))

