"""The audit log's body MAC: how a line names the request body without disclosing it.

Rules (docs/operations.md, "The body MAC"):
- An audit line's `bodyMac` is HMAC-SHA256 of the received body bytes under this host's
  audit MAC key, a host key in `<state_dir>/audit-mac.key` (daemon/hostkey.py: 32 random
  bytes, 0600, made once, refused when unusable). Same bytes, same MAC on one host, so a
  retry still shows as one and a request_id_conflict as another body.
- Why keyed: a body is mostly what its sender can rebuild byte for byte (the client's
  `freeze`), beside the requestId the line carries in clear. An unkeyed digest let
  whoever reads the audit log (its collectors and backups) confirm a guessed memory
  value and slug, or an observer payload, offline: a four-digit PIN in under a second.
  Without the key a MAC confirms nothing.
- The key is not the audit log's and must not travel with it: it lives beside
  `ledger.db`, whose digests are unkeyed sha256 (design.md fixes them for idempotency),
  in the 0700 state directory, never under `<state>/audit/`.
- Plain HMAC (RFC 2104), no domain prefix: the key MACs bodies and nothing else, and an
  auditor holding it checks a body with any HMAC tool.

Alternatives considered: keeping sha256 and dropping the requestId from the line (a line
is found by it, and it hides the body only when the agent chose it unguessable, which the
spec does not ask: any 1-128 printable bytes); a salted sha256 with the salt on the line
(a salt makes the dictionary per line, it does not stop one); a key held in the token
(every request would pay a token call, and the daemon's user can use the token anyway).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Final

from daemon.hostkey import HOST_KEY_BYTES, load_or_create

__all__ = ["KEY_FILE_NAME", "BodyMac"]

#: The audit MAC key's file name under the state directory.
KEY_FILE_NAME: Final = "audit-mac.key"


class BodyMac:
    """MACs request bodies for the audit log under the host key. Create with `BodyMac.open`."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != HOST_KEY_BYTES:
            raise ValueError(f"audit MAC key must be {HOST_KEY_BYTES} bytes")
        self._key = key

    def __repr__(self) -> str:
        return "BodyMac(key=<redacted>)"

    @classmethod
    def open(cls, state_dir: Path | str) -> BodyMac:
        """Load the key from `<state_dir>/audit-mac.key`, creating it on first use.

        Raises:
            HostKeyError: the file exists but has the wrong size, is not a regular file,
                or is readable by group/other; or the directory cannot be written.
        """
        return cls(load_or_create(state_dir, KEY_FILE_NAME, what="audit MAC key"))

    def of(self, body: bytes) -> str:
        """The body's MAC as 64 lowercase hex: what an audit line's `bodyMac` holds."""
        return hmac.new(self._key, body, hashlib.sha256).hexdigest()
