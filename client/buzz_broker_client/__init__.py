"""buzz_broker_client: the agent side of the broker protocol, on asyncio, trio or threads.

A keyless Buzz agent holds a public key and a bearer credential and asks the broker to act
for it (agent-broker.md and NIP-BA, linked from README.md; docs/protocol.md for any language, docs/agents.md for this
package). Install it with its one sibling, `pip install ./buzzwire ./client`: it needs anyio,
h11 and `buzzwire` (the wire contract and public Nostr checks, its own distribution, which
brings coincurve). It imports nothing from the broker daemon or its key custody.

Modules, one job each:
  client      AsyncBrokerClient: freeze once, retry identical bytes, judge (I4, I5)
  _blocking   BrokerClient: the same methods for threads, on a private loop thread
  _transport  one HTTP/1.1 POST over a Unix socket or loopback TCP (anyio + h11)
  _bounds     what one answer may cost: bytes and JSON values per action
  _env        address and credential from arguments or BUZZ_BROKER_* variables
  _errors     the setup errors (nothing happened; the message says what to fix)

WARNING: `__all__` is the package's surface; docs/agents.md documents it, and
docs/api/buzz_broker_client.md is generated from it (scripts/client_reference.py).
"""

from buzzwire.contract import ContractError, ErrorCode

from ._blocking import BrokerClient
from ._env import DEFAULT_SOCKET
from ._errors import (
    CREDENTIAL_ENV, CREDENTIAL_FILE_ENV, SOCKET_ENV, BrokerUnreachable, CredentialRefused,
    ListenerRefused, NothingListening, NotConfigured, SetupError, SocketMissing,
    SocketPermissionDenied,
)
from .client import (
    Answer, AsyncBrokerClient, EventVerification, Failed, FateUnknown, Indeterminate, NoAnswer,
    NoAnswerReason, ReadAll, ReadEnd, Result, RetryPolicy, Succeeded, Unsupported, judge,
)

__all__ = [
    # clients
    "AsyncBrokerClient", "BrokerClient", "RetryPolicy", "EventVerification",
    # answers
    "Answer", "Result", "Succeeded", "Failed", "Unsupported", "FateUnknown", "Indeterminate",
    "NoAnswer", "NoAnswerReason", "ReadAll", "ReadEnd", "judge",
    # errors
    "ContractError", "ErrorCode", "SetupError", "NotConfigured", "BrokerUnreachable",
    "SocketMissing", "NothingListening", "SocketPermissionDenied", "CredentialRefused",
    "ListenerRefused",
    # environment
    "SOCKET_ENV", "CREDENTIAL_ENV", "CREDENTIAL_FILE_ENV", "DEFAULT_SOCKET",
]
