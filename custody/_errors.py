"""The custody error family: what an operator (never an agent) is told.

Rules:
- Every message is one line that names the fault and is safe to log: it may carry public
  facts (a pubkey, a token label, a file path, an attribute name), never a secret key, a
  K_c, a PIN or plaintext of any kind.
- `UnsealFailed` is deliberately opaque: a wrong GCM tag, a wrong AAD (a blob swapped onto
  another agent), an unknown format version, a token error while decrypting and a
  re-derived pubkey that differs from the agent asked for all raise it with the same text,
  so nothing learns which check failed. The cause is logged by type name only.
- Misuse by our own code (a malformed pubkey argument, a bad slug, an `auth` tag the caller
  tried to inject) is a bug, not custody's fault: that raises ValueError/TypeError with
  detail, like the rest of the project's "Local" errors.
"""

from __future__ import annotations

__all__ = ["CustodyError", "UnsealFailed", "UnknownAgent"]


class CustodyError(Exception):
    """A custody fault: token, PIN, KEK, keystore or key material. One safe line."""


class UnsealFailed(CustodyError):
    """A sealed agent key did not open, or opened to a key that is not that agent's."""

    def __init__(self, agent: str) -> None:
        # The same text for every cause; see the module docstring.
        super().__init__(f"sealed key of agent {agent} failed to open")
        self.agent = agent


class UnknownAgent(CustodyError):
    """No live agent with this pubkey is held (never minted/imported, or destroyed)."""

    def __init__(self, agent: str) -> None:
        super().__init__(f"unknown agent {agent}")
        self.agent = agent
