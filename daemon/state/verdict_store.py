"""How a verdict is kept in the ledger: a refusal as its code (and message), the rest verbatim.

Rules (issue 13, "disk bounded"):
- The ledger must keep, per (agent, requestId), the verdict it replays (spec I3), and a
  replay is byte-identical to the first answer. A `failed` verdict with no side effects
  is fully determined by its requestId (which every lookup carries), its code and its
  message, so it is stored as `STORED_MARK` + code + (`STORED_MARK` + message, only when
  it is not the contract's fixed message): ~15 bytes instead of ~200.
- `stored_form` keeps the compact form only when `expanded_form` gives back exactly the
  bytes answered; anything else (a success, an indeterminate verdict, any surprise) is
  stored verbatim. So compaction can cost bytes, never correctness.
- A stored form beginning with `STORED_MARK` (a NUL byte) cannot be a response: every
  response is a JSON object and begins with `{`.
"""

from __future__ import annotations

import json
from typing import Final

from buzzwire.contract import MESSAGES, ErrorCode, Status, Verdict, encode_response

__all__ = ["stored_form", "expanded_form", "verdict_of", "STORED_MARK"]

#: First byte of a compact refusal, and the separator before a non-default message.
STORED_MARK: Final = b"\x00"


def _compact(code: ErrorCode, message: str) -> bytes:
    text = str(code.value).encode("ascii")
    if message != MESSAGES[code]:
        text += STORED_MARK + message.encode("utf-8")
    return STORED_MARK + text


def stored_form(request_id: str, response: bytes, status: Status, code: ErrorCode | None
                ) -> bytes:
    """What the ledger stores for `response` (the encoded verdict for `request_id`)."""
    if status is not Status.FAILED or code is None:
        return response
    try:
        error = json.loads(response)["error"]
        candidate = _compact(code, str(error["message"]))
    except (ValueError, KeyError, TypeError):
        return response
    return candidate if expanded_form(request_id, candidate) == response else response


def expanded_form(request_id: str, stored: bytes) -> bytes:
    """The response bytes `stored` stands for (verbatim unless compact).

    Raises:
        ValueError: a compact form this version cannot read (an unknown code).
    """
    if not stored.startswith(STORED_MARK):
        return stored
    code_text, _mark, message = stored[1:].partition(STORED_MARK)
    code = ErrorCode(code_text.decode("ascii"))
    text = message.decode("utf-8") if _mark else None
    response: bytes = encode_response(request_id, Verdict.failed(code, text))
    return response


def verdict_of(stored: bytes) -> tuple[Status, ErrorCode | None]:
    """The status and code of a stored verdict, read from its bytes.

    Only the ledger's one-time migration calls this (a record written before status and
    code were columns); the pipeline gets both from the ledger's columns. A record that
    cannot be read counts as `failed` without a code: the bytes still replay verbatim,
    only the log line and the metric lose precision.
    """
    if stored.startswith(STORED_MARK):
        code_text = stored[1:].partition(STORED_MARK)[0].decode("ascii", "replace")
        return Status.FAILED, _code_or_none(code_text)
    try:
        obj = json.loads(stored)
        status = Status(obj["status"])
    except (ValueError, KeyError, TypeError):
        return Status.FAILED, None
    error = obj.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return status, _code_or_none(code) if isinstance(code, str) else None


def _code_or_none(text: str) -> ErrorCode | None:
    try:
        return ErrorCode(text)
    except ValueError:
        return None
