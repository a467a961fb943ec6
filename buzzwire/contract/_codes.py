"""Error codes, statuses, the status/code pairing table and the one Remote error.

Rules:
- `ErrorCode` transcribes the code table of agent-broker.md §Results one to one; the
  `#:` comment on each member is the spec's meaning column.
- `PAIRING` is that table's two right-hand columns as a dict literal. Code that builds or
  reads an envelope looks a pairing up here; a missing pairing is a protocol fault when it
  arrives from outside and an `AssertionError` (our bug) when we try to build it.
- `MESSAGES` are the fixed agent-facing texts, one per code, except `invalid_request`,
  whose message says where and which rule (`ContractError.message`, from the one table
  `_rules.Rule`: the host's words and limits, a pointer that never spells a member name
  the client chose). Operator detail lives in `ContractError.detail` and never goes into
  an envelope.

WARNING: `ErrorCode`, `PAIRING` and `MESSAGES` must be edited together; a test checks that
each covers every code.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from ._rules import Rule, refusal_message

__all__ = ["ErrorCode", "Status", "PAIRING", "MESSAGES", "ContractError"]


class Status(enum.Enum):
    """The three verdicts of spec §Results; values are the wire strings."""

    #: the operation completed and the outcome describes what happened
    SUCCEEDED = "succeeded"
    #: no side effects took hold; the caller may treat the operation as never having happened
    FAILED = "failed"
    #: promises nothing; the caller must retry the identical bytes or reconcile by reading
    INDETERMINATE = "indeterminate"


class ErrorCode(enum.Enum):
    """The spec's error codes (§Results); values are the wire strings."""

    #: envelope or arguments failed validation
    INVALID_REQUEST = "invalid_request"
    #: protocolVersion not supported by this host
    UNSUPPORTED_PROTOCOL_VERSION = "unsupported_protocol_version"
    #: action name unknown to this host
    UNKNOWN_ACTION = "unknown_action"
    #: actionVersion not supported for this action
    UNSUPPORTED_ACTION_VERSION = "unsupported_action_version"
    #: host knows the action but does not offer it
    UNSUPPORTED = "unsupported"
    #: credential missing, malformed, or rejected
    UNAUTHENTICATED = "unauthenticated"
    #: authenticated, but not permitted this action
    UNAUTHORIZED = "unauthorized"
    #: requestId reused with different bytes
    REQUEST_ID_CONFLICT = "request_id_conflict"
    #: the action ran and reported a domain failure
    ACTION_FAILED = "action_failed"
    #: host cannot tell whether side effects occurred
    OUTCOME_UNKNOWN = "outcome_unknown"
    #: unexpected host fault
    INTERNAL = "internal"


_F = frozenset({Status.FAILED})
_I = frozenset({Status.INDETERMINATE})
_FI = frozenset({Status.FAILED, Status.INDETERMINATE})

# spec §Results, "The complete table": which statuses each code may travel with. Every code
# but two names a fate the host knows (failed only); outcome_unknown is the code for not
# knowing (indeterminate only); internal is legitimately either.
PAIRING: Mapping[ErrorCode, frozenset[Status]] = MappingProxyType(
    {
        ErrorCode.INVALID_REQUEST: _F,
        ErrorCode.UNSUPPORTED_PROTOCOL_VERSION: _F,
        ErrorCode.UNKNOWN_ACTION: _F,
        ErrorCode.UNSUPPORTED_ACTION_VERSION: _F,
        ErrorCode.UNSUPPORTED: _F,
        ErrorCode.UNAUTHENTICATED: _F,
        ErrorCode.UNAUTHORIZED: _F,
        ErrorCode.REQUEST_ID_CONFLICT: _F,
        ErrorCode.ACTION_FAILED: _F,
        ErrorCode.OUTCOME_UNKNOWN: _I,
        ErrorCode.INTERNAL: _FI,
    }
)

# Fixed agent-facing text per code (style §12): never built from exception text, never
# carrying a value the agent sent, so nothing secret can ride along.
MESSAGES: Mapping[ErrorCode, str] = MappingProxyType(
    {
        ErrorCode.INVALID_REQUEST: "the request envelope or its arguments failed validation",
        ErrorCode.UNSUPPORTED_PROTOCOL_VERSION: "this host supports protocolVersion 1 only",
        ErrorCode.UNKNOWN_ACTION: "the action is not one of the operations this protocol defines",
        ErrorCode.UNSUPPORTED_ACTION_VERSION: "this host supports actionVersion 1 only",
        ErrorCode.UNSUPPORTED: "this host does not offer this action",
        ErrorCode.UNAUTHENTICATED: "the credential is missing, malformed, or rejected",
        ErrorCode.UNAUTHORIZED: "this session is not permitted to perform this action",
        ErrorCode.REQUEST_ID_CONFLICT: "this requestId was already used with different bytes",
        ErrorCode.ACTION_FAILED: "the action ran and reported a failure",
        ErrorCode.OUTCOME_UNKNOWN: "the host cannot tell whether the action took effect; retry the same bytes",
        ErrorCode.INTERNAL: "the host hit an unexpected fault",
    }
)


class ContractError(Exception):
    """Remote error: bytes or values from outside broke the contract.

    Attributes:
        code: the wire code an envelope would carry.
        pointer: RFC 6901 JSON pointer of the first fault ("" = the whole document). It may
            spell a member name the sender chose: operator-side, and only through the
            log's own filter.
        detail: operator-only text. It never quotes a value the sender supplied, and it is
            never sent to an agent (use `message`).
        rule: the rule broken (`_rules.Rule`), for `invalid_request`; None for the other
            codes, whose message is fixed.
        reason: the rule's reason as the agent is told it (host words and limits only).
        shown: the pointer as an agent may see it (`_envelopes.shown_pointer`: a member
            name the sender chose is written by position), or None until the reader that
            holds the document has written it.
    """

    __slots__ = ("code", "pointer", "detail", "rule", "reason", "shown")

    def __init__(self, code: ErrorCode, pointer: str, detail: str, *, rule: Rule | None = None,
                 reason: str | None = None, shown: str | None = None) -> None:
        super().__init__(code, pointer, detail)
        self.code = code
        self.pointer = pointer
        self.detail = detail
        self.rule = rule
        self.reason = detail if reason is None else reason
        self.shown = shown

    def showing(self, shown: str) -> ContractError:
        """This error, its pointer shown to an agent as `shown`."""
        return ContractError(self.code, self.pointer, self.detail, rule=self.rule,
                             reason=self.reason, shown=shown)

    @property
    def message(self) -> str:
        """What an agent is told: the pointer (as shown) and the rule for invalid_request,
        the fixed text of the code otherwise. Never a value the sender supplied."""
        if self.rule is None or self.code is not ErrorCode.INVALID_REQUEST:
            return MESSAGES[self.code]
        # Not yet shown by a reader that holds the document, which alone can tell the
        # host's member names and indices from the sender's: every segment is hidden.
        shown = self.shown if self.shown is not None else "/".join(
            seg and "<member>" for seg in self.pointer.split("/"))
        return refusal_message(shown, self.reason)

    def __str__(self) -> str:
        return f"{self.code.value} at {self.pointer or '(document)'}: {self.detail}"

    def __repr__(self) -> str:
        return f"ContractError({self.code.value!r}, {self.pointer!r}, {self.detail!r})"
