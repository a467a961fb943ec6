"""A token that stops honouring the process's session (reset, its store reloaded, the
device re-plugged) costs one login, not a fault: custody/_token.py says "the token logs in
again, finds the active KEK by label, checks it, and retries the one operation once", and
"the process's shared session is replaced once per failure generation". No test drove that
path until a review of custody's token code read it; here the real token's session is
closed under custody (C_CloseSession, as a token reset does to every handle), and the
next operations sign, after one login for every `Token` sharing the session (the journal
said "logged in again" once per `Token`, though only the first logged in).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from buzzwire.nostr import UnsignedEvent, verify_event
from custody import Custody, CustodyError, TokenConfig
from custody import _token
from custody._token import _PROCESS
from custody._worker import in_token_worker
from tests.custody._sealing import HUMAN
from tests.fixtures.token import SoftHsmToken


async def _close_the_session_under(custody: Custody) -> None:
    """The token forgets the process's session: every handle custody holds goes stale."""
    def close() -> None:
        _PROCESS.sessions[custody._token._key].session.close()

    await in_token_worker(close)


async def _signs(custody: Custody, agent: str) -> bool:
    event = await custody.sign_event(agent, UnsignedEvent(
        pubkey=agent, created_at=1_700_000_000, kind=1, tags=(), content="after the reset"))
    return verify_event(event.to_json_obj())


async def test_a_session_the_token_dropped_is_logged_in_again_once_and_the_call_signs(
        custody: Custody, custody_state: tuple[TokenConfig, Path],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = (await custody.mint_agent(owner=HUMAN)).pubkey
    other = (await custody.mint_agent(owner=HUMAN)).pubkey
    assert await _signs(custody, agent)
    # A second opening in the process (a command beside its own daemon's custody, in a
    # test): it shares the session, so the one login serves both.
    logins: list[None] = []
    login = _token._login

    def counted(*args: Any, **kwargs: Any) -> Any:
        logins.append(None)
        return login(*args, **kwargs)

    async with await Custody.open(*custody_state) as beside:
        monkeypatch.setattr(_token, "_login", counted)
        await _close_the_session_under(custody)
        with caplog.at_level(logging.WARNING, logger="buzz_broker.custody"):
            assert await _signs(custody, agent)  # the stale handle, one login, the retry
            assert await _signs(custody, other)  # the new session: no second login
            assert await _signs(beside, other)  # nor for the other opening
    said = [r.getMessage() for r in caplog.records]
    assert len(logins) == 1, said
    assert [m for m in said if "logged in again" in m] == [
        f"token {custody._token._config.token_label!r}: logged in again; KEK found and checked"
    ], said


async def test_after_a_login_again_with_a_changed_pin_the_process_holds_openings_to_it(
        softhsm_token: SoftHsmToken, custody_state: tuple[TokenConfig, Path],
        tmp_path: Path) -> None:
    """The operator changes the token's PIN and its file; the token drops the session;
    custody logs in again with the PIN it reads now. A later opening in the process is
    held to that PIN, the one the token has: before, the session kept the replaced PIN's
    MAC, so an opening with the new PIN was refused as wrong and one with the old PIN,
    which the token no longer takes, joined the session."""
    if softhsm_token.kind != "softhsm":
        pytest.skip("the PIN is changed (C_SetPIN) on the SoftHSM token only")
    token, state = custody_state
    old = Path(token.pin_file).read_bytes()
    new = b"changed-" + old.strip() + b"\n"

    def pin_file(name: str, content: bytes) -> TokenConfig:
        path = tmp_path / name
        path.write_bytes(content)
        path.chmod(0o600)
        return dataclasses.replace(token, pin_file=str(path))

    config = pin_file("pin", old)
    async with await Custody.open(config, state) as custody:
        agent = (await custody.mint_agent(owner=HUMAN)).pubkey

        async def set_pin(before: bytes, after: bytes) -> None:
            def change() -> None:
                _PROCESS.sessions[custody._token._key].session.set_pin(
                    before.strip().decode(), after.strip().decode())

            await in_token_worker(change)

        await set_pin(old, new)
        try:
            config = pin_file("pin", new)
            await _close_the_session_under(custody)
            assert await _signs(custody, agent)  # logged in again, with the new PIN
            async with await Custody.open(config, state) as beside:
                assert await _signs(beside, agent)
            with pytest.raises(CustodyError, match="wrong PIN"):
                await Custody.open(pin_file("old-pin", old), state)
        finally:
            await set_pin(new, old)
