"""The secret scan: every spelling of every secret a test made, and a search that names none.

Rules:
- A `Secret` holds its spellings as bytes and prints only its label: a failing scan says
  *which* secret leaked and *where*, never the value (the report would itself be a leak).
- Spellings: a secp256k1 secret key is looked for as lower and upper hex, as `nsec1` bech32
  (lower and upper), as its 32 raw bytes, and as the first half of each text form (a
  message that quotes 32 of 64 hex digits has leaked half a key). A text secret (a PIN, a
  bearer token) is looked for as its UTF-8 bytes, and a token also by its random body
  without the `bzb_` prefix. A raw key (the cursor MAC key) as raw bytes and hex.
- A place may be the designated holder of one secret (the PIN file holds the PIN, the
  `credential issue` stdout carries the token it issues): `findings(..., allowed=...)`
  skips exactly those labels there and nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nostr_sdk

__all__ = ["Secret", "SecretScan", "key_secret", "text_secret", "raw_secret", "files_under"]

#: Shorter needles than this would match by chance in binary files (a 32-char PIN is 190
#: bits; a half key is 128 bits).
MIN_NEEDLE_BYTES = 16


@dataclass(frozen=True)
class Secret:
    label: str
    forms: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.forms or any(len(f) < MIN_NEEDLE_BYTES for f in self.forms):
            raise ValueError(f"secret {self.label!r}: every spelling must be >= {MIN_NEEDLE_BYTES} bytes")

    def __repr__(self) -> str:
        return f"Secret({self.label!r}, {len(self.forms)} spellings)"

    __str__ = __repr__


def key_secret(label: str, secret_hex: str) -> Secret:
    """A 32-byte secp256k1 secret key, in every spelling a leak could take."""
    secret_hex = secret_hex.lower()
    raw = bytes.fromhex(secret_hex)
    if len(raw) != 32:
        raise ValueError("a key secret is 32 bytes")
    nsec = nostr_sdk.SecretKey.parse(secret_hex).to_bech32()
    texts = [secret_hex, secret_hex.upper(), nsec, nsec.upper()]
    halves = [secret_hex[:32], secret_hex[:32].upper(), secret_hex[32:], nsec[:36], nsec[36:]]
    return Secret(label, tuple(t.encode() for t in (*texts, *halves)) + (raw,))


def text_secret(label: str, text: str, *, prefix: str = "") -> Secret:
    """A PIN or a bearer token; with `prefix`, the part after it is looked for too."""
    forms = [text.encode("utf-8")]
    if prefix and text.startswith(prefix):
        forms.append(text[len(prefix):].encode("utf-8"))
    return Secret(label, tuple(forms))


def raw_secret(label: str, raw: bytes) -> Secret:
    """Random key bytes (the cursor MAC key): raw and as hex."""
    return Secret(label, (raw, raw.hex().encode(), raw.hex().upper().encode()))


class SecretScan:
    """The set of secrets one scenario (or the session) made, and the search for them."""

    def __init__(self) -> None:
        self._secrets: dict[str, Secret] = {}
        #: how many places and bytes were scanned (the docs report it)
        self.places = 0
        self.bytes_scanned = 0

    def add(self, secret: Secret) -> Secret:
        self._secrets[secret.label] = secret
        return secret

    @property
    def labels(self) -> list[str]:
        return sorted(self._secrets)

    def findings(self, blob: bytes | str, where: str, *, allowed: Iterable[str] = ()) -> list[str]:
        """One line per (secret, spelling) found in `blob`: labels and positions, no values."""
        data = blob.encode("utf-8", "surrogatepass") if isinstance(blob, str) else blob
        skip = set(allowed)
        self.places += 1
        self.bytes_scanned += len(data)
        found = []
        for secret in self._secrets.values():
            if secret.label in skip:
                continue
            for index, form in enumerate(secret.forms):
                if form in data:
                    found.append(f"{where}: {secret.label} (spelling #{index})")
        return found

    def contains(self, blob: bytes | str, label: str) -> bool:
        """Is this one secret in `blob`? (positive controls: the scan has teeth)."""
        data = blob.encode("utf-8", "surrogatepass") if isinstance(blob, str) else blob
        return any(form in data for form in self._secrets[label].forms)


def files_under(root: Path, *, skip: Iterable[Path] = ()) -> Iterator[tuple[Path, bytes]]:
    """Every regular file below `root` (sockets, FIFOs and `skip` left out), with its bytes."""
    skipped = {p.resolve() for p in skip}
    for directory, _dirs, names in os.walk(root):
        for name in names:
            path = Path(directory, name)
            if path.resolve() in skipped or not path.is_file() or path.is_symlink():
                continue
            try:
                yield path, path.read_bytes()
            except OSError:
                continue  # vanished between walk and read (a WAL checkpoint): nothing to scan
