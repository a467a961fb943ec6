"""A loopback TCP listener's 403 naming the rule a request broke (daemon/loopback_tcp.py
`Refusal`) is the same for the same request: the client raises it at once with that line
(`ListenerRefused`), never retries it as a lost answer that would spend the retry budget
and hide the cause. Other answers without an envelope (a 503 at a connection cap, a
proxy's 403 page) say nothing of the request's fate and are retried as before
(docs/protocol.md §1, "Answers without an envelope")."""

from __future__ import annotations

import logging

import pytest

from buzz_broker_client import ListenerRefused, _errors
from buzz_broker_client.client import NoAnswer, NoAnswerReason
from daemon.loopback_tcp import Refusal
from tests.client.scripted_host import ScriptedHost, drop, raw
from tests.client.test_client import CHANNEL, FAST, assert_identical_retries, client

pytestmark = pytest.mark.any_loop


@pytest.mark.parametrize("refusal", list(Refusal), ids=lambda r: r.name)
async def test_a_listeners_refusal_is_raised_at_once_with_its_line(
        host: ScriptedHost, refusal: Refusal, caplog: pytest.LogCaptureFixture) -> None:
    host.default = raw(403, refusal.value)
    with pytest.raises(ListenerRefused) as raised:
        await client(host).message_post(CHANNEL, "hi")
    assert raised.value.line == refusal.value.decode().rstrip("\n")
    assert raised.value.line in str(raised.value) and host.path in str(raised.value)
    assert "\n" not in str(raised.value)
    assert len(host.received) == 1 and "retrying" not in caplog.text


async def test_a_refusal_after_a_lost_attempt_keeps_its_fate_unknown(
        host: ScriptedHost, caplog: pytest.LogCaptureFixture) -> None:
    """The first attempt may have reached the host: the refusal says nothing of it, so the
    call answers that fate-unknown, and stops (the same bytes get the same 403)."""
    caplog.set_level(logging.INFO)
    host.script = [drop(), raw(403, Refusal.UID.value)]
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.TRANSPORT
    assert answer.attempts == 2 and FAST.max_attempts > 2
    assert_identical_retries(host, 2)


@pytest.mark.parametrize(("status", "body"), [
    (503, b""),                                        # a connection cap: retried after a backoff
    (403, b"<html>403 Forbidden</html>"),              # a proxy's page, not the listener's line
    (403, Refusal.HOST.value + b"x"),                  # nor a line of it with more
])
async def test_other_answers_without_an_envelope_are_still_retried(
        host: ScriptedHost, status: int, body: bytes) -> None:
    host.default = raw(status, body)
    answer = await client(host).message_post(CHANNEL, "hi")
    assert isinstance(answer, NoAnswer) and answer.reason is NoAnswerReason.NO_ENVELOPE
    assert str(status) in answer.detail
    assert_identical_retries(host, FAST.max_attempts)


def test_the_client_knows_exactly_the_listeners_lines() -> None:
    """The client stands alone (it imports nothing of the daemon): its copy of the lines
    is held equal to the listener's here."""
    assert _errors.LISTENER_REFUSALS == {r.value for r in Refusal}
