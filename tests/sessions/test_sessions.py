"""Credentials: issue, authenticate (strictly), revoke, expiry, uid binding, and proof that
no token is stored or listed."""

from __future__ import annotations

import base64
import dataclasses
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import daemon.state.sessions as sessions_module
from daemon.state.sessions import (
    MAX_AUTHORIZATION_CHARS,
    TOKEN_PREFIX,
    Principal,
    SessionStore,
)

AGENT = "ab" * 32
OTHER_AGENT = "cd" * 32
CHANNEL = "123e4567-e89b-12d3-a456-426614174000"
NOW = 1_800_000_000


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SessionStore]:
    s = SessionStore.open(tmp_path)
    yield s
    s.close()


def issue(store: SessionStore, **overrides: object) -> tuple[str, str]:
    kwargs: dict[str, object] = dict(
        agent=AGENT,
        channels=frozenset({CHANNEL}),
        actions=frozenset({"message.post", "channel.read"}),
        ttl_seconds=3600,
        uid=None,
        now=NOW,
    )
    kwargs.update(overrides)
    return store.issue(**kwargs)  # type: ignore[arg-type]


def test_issue_then_authenticate(store: SessionStore) -> None:
    cid, token = issue(store)
    assert token.startswith(TOKEN_PREFIX)
    # At least 256 bits of randomness behind the prefix.
    body = token[len(TOKEN_PREFIX) :]
    assert len(base64.urlsafe_b64decode(body + "=")) * 8 >= 256
    principal = store.authenticate(f"Bearer {token}", None, NOW)
    assert principal is not None
    assert principal.credential_id == cid and principal.agent == AGENT
    assert principal.channels == frozenset({CHANNEL})
    assert principal.actions == frozenset({"message.post", "channel.read"})
    assert principal.expires_at == NOW + 3600 and principal.uid is None
    assert token not in repr(principal)


def test_tokens_are_unique(store: SessionStore) -> None:
    tokens = {issue(store)[1] for _ in range(20)}
    assert len(tokens) == 20


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_scheme_is_case_insensitive(store: SessionStore, scheme: str) -> None:
    _, token = issue(store)
    assert store.authenticate(f"{scheme} {token}", None, NOW) is not None


#: Every malformed spelling of a valid token's header; each must fail.
MALFORMED: dict[str, Callable[[str], str | None]] = {
    "missing": lambda t: None,
    "empty": lambda t: "",
    "scheme only": lambda t: "Bearer",
    "token without scheme": lambda t: t,
    "truncated": lambda t: f"Bearer {t[:-1]}",
    "one char too many": lambda t: f"Bearer {t}A",
    "trailing space": lambda t: f"Bearer {t} ",
    "leading space": lambda t: f" Bearer {t}",
    "two spaces": lambda t: f"Bearer  {t}",
    "tab": lambda t: f"Bearer\t{t}",
    "other scheme": lambda t: f"Basic {t}",
    "bad charset": lambda t: f"Bearer {t[:-1]}=",
    "wrong prefix": lambda t: f"Bearer xzb_{t[4:]}",
    "newline": lambda t: f"Bearer {t[:-1]}\n",
    "10 MB": lambda t: f"Bearer {t}" + "A" * 10_000_000,
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_headers_fail(store: SessionStore, name: str) -> None:
    _, token = issue(store)
    assert store.authenticate(MALFORMED[name](token), None, NOW) is None


def test_malformed_headers_are_never_hashed(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, token = issue(store)
    calls: list[int] = []
    real = sessions_module._token_hash

    def counting(t: str) -> bytes:
        calls.append(len(t))
        return real(t)

    monkeypatch.setattr(sessions_module, "_token_hash", counting)
    for make in MALFORMED.values():
        assert store.authenticate(make(token), None, NOW) is None
    # The 10 MB header, and every other malformed one, stopped before hashing.
    assert calls == []
    # The counter works: a well-formed unknown token is hashed once and still fails.
    unknown = TOKEN_PREFIX + "A" * (len(token) - len(TOKEN_PREFIX))
    assert store.authenticate(f"Bearer {unknown}", None, NOW) is None
    assert calls == [len(unknown)]
    assert MAX_AUTHORIZATION_CHARS == len("Bearer ") + len(token)


def test_revoked_fails_at_once(store: SessionStore) -> None:
    cid, token = issue(store)
    assert store.revoke(cid) is True
    assert store.authenticate(f"Bearer {token}", None, NOW) is None
    assert store.revoke(cid) is False  # already revoked
    assert store.revoke("cred_0000000000000000") is False
    assert store.revoke("not an id") is False


def test_another_process_issue_and_revoke_are_seen_without_reload(tmp_path: Path) -> None:
    daemon_store = SessionStore.open(tmp_path)
    cli_store = SessionStore.open(tmp_path)  # a separate connection, as the CLI has
    try:
        cid, token = issue(cli_store)
        assert daemon_store.authenticate(f"Bearer {token}", None, NOW) is not None
        assert cli_store.revoke(cid)
        assert daemon_store.authenticate(f"Bearer {token}", None, NOW) is None
    finally:
        daemon_store.close()
        cli_store.close()


def test_expired_fails(store: SessionStore) -> None:
    _, token = issue(store, ttl_seconds=60)
    assert store.authenticate(f"Bearer {token}", None, NOW + 59) is not None
    assert store.authenticate(f"Bearer {token}", None, NOW + 60) is None
    _, forever = issue(store, ttl_seconds=None)
    assert store.authenticate(f"Bearer {forever}", None, NOW + 10**9) is not None


def test_uid_binding(store: SessionStore) -> None:
    _, bound = issue(store, uid=1000)
    assert store.authenticate(f"Bearer {bound}", 1000, NOW) is not None
    assert store.authenticate(f"Bearer {bound}", 1001, NOW) is None
    assert store.authenticate(f"Bearer {bound}", None, NOW) is None  # peer uid unknown
    _, unbound = issue(store, uid=None)
    assert store.authenticate(f"Bearer {unbound}", 4242, NOW) is not None
    assert store.authenticate(f"Bearer {unbound}", None, NOW) is not None


def test_revoke_agent(store: SessionStore) -> None:
    _, t1 = issue(store)
    _, t2 = issue(store)
    _, other = issue(store, agent=OTHER_AGENT)
    assert store.revoke_agent(AGENT) == 2
    assert store.authenticate(f"Bearer {t1}", None, NOW) is None
    assert store.authenticate(f"Bearer {t2}", None, NOW) is None
    assert store.authenticate(f"Bearer {other}", None, NOW) is not None
    assert store.revoke_agent(AGENT) == 0


def test_list_shows_scope_never_tokens(store: SessionStore, tmp_path: Path) -> None:
    cid, token = issue(store, uid=7)
    issue(store, agent=OTHER_AGENT, ttl_seconds=None)
    store.revoke(cid)
    listing = store.list()
    assert [i.credential_id for i in listing][0] == cid
    first = listing[0]
    assert first.agent == AGENT and first.channels == (CHANNEL,) and first.uid == 7
    assert first.actions == ("channel.read", "message.post")
    assert first.revoked_at is not None and not first.active(NOW)
    assert listing[1].active(NOW) and listing[1].expires_at is None
    text = repr(listing)
    assert token not in text and token[len(TOKEN_PREFIX) :] not in text
    assert not any("sha256" in f.name for f in dataclasses.fields(first))


def test_database_never_holds_the_token(store: SessionStore, tmp_path: Path) -> None:
    tokens = [issue(store)[1] for _ in range(5)]
    blob = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert blob  # the database exists and has content
    for token in tokens:
        assert token.encode() not in blob
        assert token[len(TOKEN_PREFIX) :].encode() not in blob
    for p in tmp_path.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name


def test_principal_cannot_be_forged(store: SessionStore) -> None:
    with pytest.raises(TypeError):
        Principal(  # type: ignore[call-arg]
            credential_id="cred_x",
            agent=AGENT,
            channels=frozenset(),
            actions=frozenset(),
            expires_at=None,
            uid=None,
        )
    with pytest.raises(TypeError):
        Principal(
            credential_id="cred_x",
            agent=AGENT,
            channels=frozenset(),
            actions=frozenset(),
            expires_at=None,
            uid=None,
            _key=object(),
        )
    _, token = issue(store)
    principal = store.authenticate(f"Bearer {token}", None, NOW)
    assert principal is not None
    with pytest.raises(ValueError):
        dataclasses.replace(principal, agent=OTHER_AGENT)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "overrides",
    [
        {"agent": "AB" * 32},
        {"agent": "ab" * 31},
        {"channels": frozenset()},
        {"channels": frozenset({CHANNEL.upper()})},
        {"channels": frozenset({CHANNEL.replace("-", "")})},
        {"actions": frozenset()},
        {"actions": frozenset({"sign"})},
        {"ttl_seconds": 0},
        {"ttl_seconds": True},
        {"uid": -1},
    ],
    ids=repr,
)
def test_issue_refuses_bad_scope(store: SessionStore, overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        issue(store, **overrides)
    assert store.list() == []


def _last_used(store: SessionStore, cid: str) -> int | None:
    return next(c.last_used_at for c in store.list() if c.credential_id == cid)


def test_a_late_last_use_write_never_moves_last_use_back(store: SessionStore) -> None:
    """Two writers (the daemon's flush thread, a retried flush, the CLI) may write out of
    order: the later second stays."""
    cid, _token = issue(store)
    store.write_last_use({cid: NOW + 200})
    store.write_last_use({cid: NOW + 100})  # an older flush, retried late
    assert _last_used(store, cid) == NOW + 200


def test_a_failed_flush_put_back_loses_no_later_use(store: SessionStore) -> None:
    """keep_last_use after a failed write: a use noted meanwhile is later and wins."""
    cid, token = issue(store)
    assert store.authenticate(f"Bearer {token}", None, NOW + 1) is not None
    noted = store.take_last_use()
    assert noted == {cid: NOW + 1}
    assert store.authenticate(f"Bearer {token}", None, NOW + 5) is not None  # meanwhile
    store.keep_last_use(noted)  # the write of `noted` failed
    assert store.take_last_use() == {cid: NOW + 5}


def test_grant_refuses_an_expired_credential(store: SessionStore) -> None:
    """grant adds actions only to an active credential: an expired one is "no such
    credential" (None), and nothing is written."""
    cid, _token = issue(store, ttl_seconds=10)
    assert store.grant(cid, frozenset({"reaction.add"}), now=NOW + 10) is None
    assert next(c.actions for c in store.list() if c.credential_id == cid) == (
        "channel.read", "message.post")
    assert store.grant(cid, frozenset({"reaction.add"}), now=NOW + 9) == ("reaction.add",)
