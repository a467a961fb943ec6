"""Which login failures custody tries again, table by table (custody/_token.py).

The SoftHSM race itself is shown by real processes on a real token
(tests/custody/test_concurrent_processes.py), but which of its answers turns up in a run
is chance: one fresh-clone CI run showed UserPinNotInitialized, the flags word read torn,
which was not retried. So each entry of LOGIN_RETRY_ERRORS is driven here through a
scripted module that fails a login with it, and a failure the table leaves out (a wrong
PIN, which a token may count) is shown tried exactly once.
"""

from __future__ import annotations

from typing import Any

import pkcs11
import pytest

from custody import CustodyError, TokenConfig
from custody import _token

pytestmark = pytest.mark.token_independent

#: The answers SoftHSM 2.6 has given in a process that read its token file torn, each seen
#: in a run of tests/custody/test_concurrent_processes.py (the last, UserPinNotInitialized,
#: in a fresh-clone CI run on 2026-12-02).
SEEN_TORN = (pkcs11.GeneralError, pkcs11.NoSuchToken, pkcs11.UserPinNotInitialized)


class _ScriptedModule:
    """A PKCS#11 module whose first `failures` logins raise `error`."""

    def __init__(self, error: type[Exception], failures: int) -> None:
        self.error, self.failures = error, failures
        self.initialized = True
        self.logins = self.restarts = 0

    def initialize(self) -> None:
        self.initialized = True
        self.restarts += 1

    def finalize(self) -> None:
        self.initialized = False

    def get_token(self, *, token_label: str) -> Any:
        return self

    def open(self, *, rw: bool, user_pin: str) -> str:
        self.logins += 1
        if self.logins <= self.failures:
            raise self.error()
        return "session"


def _config() -> TokenConfig:
    return TokenConfig(module="/scripted/module.so", token_label="scripted",
                       kek_label="buzz-kek", pin_file="/nonexistent")


@pytest.fixture(autouse=True)
def _no_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_token, "LOGIN_PAUSE_SECONDS", 0.0)  # the pauses double from zero


@pytest.mark.parametrize("error", _token.LOGIN_RETRY_ERRORS, ids=lambda e: e.__name__)
def test_each_retried_failure_is_tried_again_and_the_module_started_over(
        error: type[Exception], monkeypatch: pytest.MonkeyPatch) -> None:
    module = _ScriptedModule(error, failures=_token.LOGIN_ATTEMPTS - 1)
    monkeypatch.setattr(_token, "_load_lib", lambda _path: module)
    assert _token._login(_config(), bytearray(b"1234"), may_restart=True) == "session"
    assert module.logins == _token.LOGIN_ATTEMPTS
    assert module.restarts >= _token.LOGIN_ATTEMPTS - _token.LOGIN_RESTART_FROM


@pytest.mark.parametrize("error", _token.LOGIN_RETRY_ERRORS, ids=lambda e: e.__name__)
def test_a_failure_past_the_last_attempt_is_one_line(
        error: type[Exception], monkeypatch: pytest.MonkeyPatch) -> None:
    module = _ScriptedModule(error, failures=_token.LOGIN_ATTEMPTS)
    monkeypatch.setattr(_token, "_load_lib", lambda _path: module)
    with pytest.raises(CustodyError) as caught:
        _token._login(_config(), bytearray(b"1234"), may_restart=True)
    assert "\n" not in str(caught.value) and "1234" not in str(caught.value)
    assert module.logins == _token.LOGIN_ATTEMPTS


@pytest.mark.parametrize("error", [pkcs11.PinIncorrect, pkcs11.PinLocked])
def test_a_pin_refusal_is_tried_once(error: type[Exception],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    module = _ScriptedModule(error, failures=1)
    monkeypatch.setattr(_token, "_load_lib", lambda _path: module)
    with pytest.raises(CustodyError):
        _token._login(_config(), bytearray(b"1234"), may_restart=True)
    assert module.logins == 1


def test_every_torn_read_answer_seen_is_retried() -> None:
    assert set(SEEN_TORN) <= set(_token.LOGIN_RETRY_ERRORS)
