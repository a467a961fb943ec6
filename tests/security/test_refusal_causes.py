"""Why a credential was refused, for the operator only (issue 25 item 3).

Rules:
- The agent is told one fixed string whatever the cause (NIP-BA: nothing about
  authenticated state to an unauthenticated caller); the operator's `verdict` line names
  the cause and, when the token matched a credential, its id. The token never appears in
  any log line (scanned as tests/adversarial does, by every spelling).
- The cause comes from memory: a flood of unknown (or revoked) tokens runs no query on the
  credential database beyond the change counter every well-formed token reads (counted with
  sqlite's statement trace, not timed), and it is one log line, then a count.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from buzzwire.contract import MESSAGES, ErrorCode
from daemon.log import format_record
from daemon.state.sessions import TOKEN_PREFIX, AuthCause, Refused, SessionStore
from tests.adversarial._secrets import SecretScan, text_secret
from tests.fixtures.broker import ALL_ACTIONS, BrokerHarness, request_body

UNAUTHENTICATED = MESSAGES[ErrorCode.UNAUTHENTICATED]


def _unknown_token() -> str:
    # The shape of a real token (so it is looked up, not refused as malformed).
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def _issue(broker: BrokerHarness, *, ttl: int | None = None, issued_at: int | None = None,
           uid: int | None = None, agent: str | None = None) -> tuple[str, str]:
    store: SessionStore = broker._sessions
    return store.issue(agent=agent or "ab" * 32, channels=frozenset([str(uuid.uuid4())]),
                       actions=frozenset(ALL_ACTIONS), ttl_seconds=ttl, uid=uid,
                       now=int(time.time()) if issued_at is None else issued_at)


def _unauthenticated_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [dict(getattr(r, "buzz_fields", {})) for r in caplog.records
            if r.getMessage() == "verdict"
            and getattr(r, "buzz_fields", {}).get("code") == "unauthenticated"]


def _no_token_logged(caplog: pytest.LogCaptureFixture, *tokens: str) -> None:
    scan = SecretScan()
    for index, token in enumerate(tokens):
        scan.add(text_secret(f"token {index}", token, prefix=TOKEN_PREFIX))
    lines = "\n".join(format_record(r) for r in caplog.records)
    assert not scan.findings(lines, "the operator log")


async def _refused(broker: BrokerHarness, token: str) -> None:
    status, answer = await broker.post(
        request_body("storage.address", {"slug": "mem/x"}), token)
    assert status == 200 and answer is not None
    # One fixed answer for every cause: the agent learns nothing about which check failed.
    assert answer["error"] == {"code": "unauthenticated", "message": UNAUTHENTICATED}


async def _unknown(broker: BrokerHarness) -> tuple[str, str | None]:
    return _unknown_token(), None


async def _revoked(broker: BrokerHarness) -> tuple[str, str | None]:
    credential_id, token = _issue(broker)
    assert broker._sessions.revoke(credential_id)
    return token, credential_id


async def _expired(broker: BrokerHarness) -> tuple[str, str | None]:
    credential_id, token = _issue(broker, ttl=60, issued_at=int(time.time()) - 3600)
    return token, credential_id


async def _wrong_uid(broker: BrokerHarness) -> tuple[str, str | None]:
    credential_id, token = _issue(broker, uid=os.getuid() + 1)
    return token, credential_id


async def _agent_gone(broker: BrokerHarness) -> tuple[str, str | None]:
    agent = await broker.human_owned_agent()
    credential_id, token = _issue(broker, agent=agent)
    await broker.custody.destroy_agent(agent)  # its credential is still unrevoked
    return token, credential_id


#: cause -> how to make a token refused for it: (token, the credential id the line names)
CAUSES: dict[str, Callable[[BrokerHarness], Awaitable[tuple[str, str | None]]]] = {
    "unknown": _unknown, "revoked": _revoked, "expired": _expired, "wrong_uid": _wrong_uid,
    "agent_gone": _agent_gone,
}


@pytest.mark.parametrize("cause", list(CAUSES))
async def test_the_operator_log_names_the_cause(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture, cause: str
) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker")
    token, credential_id = await CAUSES[cause](broker)
    await _refused(broker, token)
    [line] = _unauthenticated_lines(caplog)
    assert (line["cause"], line.get("credential_id")) == (cause, credential_id)
    assert line["peer_uid"] == os.getuid()
    _no_token_logged(caplog, token)


def test_every_cause_from_the_store_alone(tmp_path: Any) -> None:
    # The causes no daemon test above reaches: no header, a malformed one, and over TCP a
    # credential bound to no uid (the listener's rule, [server] listen_tcp).
    store = SessionStore.open(tmp_path)
    try:
        now = int(time.time())
        credential_id, token = store.issue(agent="ab" * 32, channels=frozenset([str(uuid.uuid4())]),
                                           actions=frozenset(["channel.read"]), ttl_seconds=None,
                                           uid=None, now=now)
        header = f"Bearer {token}"
        assert store.check(None, 1, now) == Refused(cause=AuthCause.MISSING)
        assert store.check("Bearer nope", 1, now) == Refused(cause=AuthCause.MALFORMED)
        assert store.check(header, 1, now, uid_bound_only=True) == Refused(
            cause=AuthCause.NO_UID_OVER_TCP, credential_id=credential_id)
        assert store.check(header, 1, now).credential_id == credential_id  # type: ignore[union-attr]
        assert store.authenticate(header, 1, now, uid_bound_only=True) is None
    finally:
        store.close()


@contextmanager
def _queries(store: SessionStore) -> Iterator[list[str]]:
    """Every statement run on the credential database meanwhile (white box: its connection)."""
    seen: list[str] = []
    conn = store._conn
    conn.set_trace_callback(seen.append)
    try:
        yield seen
    finally:
        conn.set_trace_callback(None)


async def test_a_flood_of_unknown_tokens_is_counted_and_reads_nothing(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="buzz_broker")
    revoked_id, revoked = _issue(broker)
    assert broker._sessions.revoke(revoked_id)
    tokens = [_unknown_token() for _ in range(40)]
    recorder = broker.app._recorder  # white box: the count of every refusal
    before = recorder.unvouched.total
    with _queries(broker._sessions) as seen:
        for token in tokens:
            await _refused(broker, token)
        for _ in range(10):
            await _refused(broker, revoked)
    # No query per attempt: only the change counter every well-formed token reads.
    assert set(seen) <= {"PRAGMA data_version"}, set(seen)
    lines = _unauthenticated_lines(caplog)
    assert [line["cause"] for line in lines] == ["unknown", "revoked"]
    assert recorder.unvouched.total - before == 50
    _no_token_logged(caplog, revoked, *tokens)
