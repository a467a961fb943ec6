"""Security review of the daemon's secret-adjacent code: sessions, cursors, the client's
credential, the pipeline's logs and replays, and the systemd unit's hardening claims.

Invariant under review: a credential, PIN, key or cursor MAC key never reaches a log, an
envelope, argv, an exception or a repr, and authority comes only from the credential that
was presented (I2), including on a replayed verdict (I3).

Tests marked xfail(strict=True) demonstrate a finding of the review; the rest pin down
properties that were checked and hold.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import logging
import pickle
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

import daemon.relay.cursor as cursor_module
import daemon.state.sessions as sessions_module
from buzz_broker_client._transport import Credential
from buzz_broker_client import AsyncBrokerClient
from daemon.relay.cursor import CursorCodec, CursorScope, InvalidCursor, Position
from daemon.log import format_record
from daemon.state.sessions import SessionStore
from tests.fixtures.broker import BrokerHarness, request_body
from tests.fixtures.token import REPO

UNIT = REPO / "systemd" / "buzz-broker.service"


# ---------------------------------------------------------------------------------------
# Finding 8 (medium): a replay is served before authorization, across credentials.
# ---------------------------------------------------------------------------------------

async def test_a_narrower_credential_cannot_replay_another_credentials_verdict(
    broker: BrokerHarness,
) -> None:
    mine, other = str(uuid.uuid4()), str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    wide = broker.credential(agent, [mine])
    narrow = broker.credential(agent, [other], actions=["channel.read"])
    body = request_body("message.post", {"channelId": mine, "content": "for wide only"},
                        request_id="shared-by-body")
    status, first = await broker.post(body, wide)
    assert status == 200 and first is not None and first["status"] == "succeeded"
    # Control: the narrow credential asking afresh is refused.
    fresh = await broker.call(narrow, "message.post", {"channelId": mine, "content": "x"})
    assert fresh["status"] == "failed" and fresh["error"]["code"] == "unauthorized"
    # The same bytes under the narrow credential must not be handed the wide verdict.
    status, replayed = await broker.post(body, narrow)
    assert status == 200 and replayed is not None
    assert replayed["status"] == "failed" and replayed["error"]["code"] == "unauthorized"


# ---------------------------------------------------------------------------------------
# Finding 9 (low): an unknown member's *name* is copied into the operator log.
# ---------------------------------------------------------------------------------------

async def test_a_secret_sent_as_a_member_name_is_not_logged(
    broker: BrokerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    channel = str(uuid.uuid4())
    agent = await broker.human_owned_agent()
    cred = broker.credential(agent, [channel])
    smuggled = "bzb_" + "S" * 43  # a bearer token's shape, used as a member name
    envelope = json.loads(request_body("channel.read", {"channelId": channel}))
    envelope["args"][smuggled] = 1
    status, answer = await broker.post(json.dumps(envelope).encode(), cred)
    assert status == 200 and answer is not None and answer["error"]["code"] == "invalid_request"
    assert smuggled not in json.dumps(answer)  # the envelope is clean
    lines = "\n".join(format_record(r) for r in caplog.records)
    assert "request.invalid" in lines  # control: the refusal was logged
    assert smuggled not in lines


# ---------------------------------------------------------------------------------------
# Sessions: only hashes stored, bounded parse before hashing, constant-time confirm
# ---------------------------------------------------------------------------------------

def test_the_store_holds_hashes_only_and_parses_before_hashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SessionStore.open(tmp_path)
    agent, channel = "a" * 64, str(uuid.uuid4())
    _, token = store.issue(agent=agent, channels=frozenset([channel]),
                           actions=frozenset(["channel.read"]), ttl_seconds=None, uid=None,
                           now=1000)
    assert re.fullmatch(r"bzb_[A-Za-z0-9_-]{43}", token)
    hashed: list[str] = []
    compared: list[tuple[bytes, bytes]] = []
    real_hash, real_compare = sessions_module._token_hash, hmac.compare_digest

    def counting_hash(token: str) -> bytes:
        hashed.append(token)
        return real_hash(token)

    monkeypatch.setattr(sessions_module, "_token_hash", counting_hash)

    class _Hmac:
        @staticmethod
        def compare_digest(a: bytes, b: bytes) -> bool:
            compared.append((a, b))
            return bool(real_compare(a, b))

    monkeypatch.setattr(sessions_module, "hmac", _Hmac)
    refused = [None, "", token, f"Bearer  {token}", f"Bearer {token} ", f"Bearer\t{token}",
               f"Basic {token}", f"Bearer {token[:-1]}", f"Bearer {token}x",
               f"Bearer {token[:-1]}=", f"Bearer {'x' * 10_000_000}", f"Bearer {token.upper()}"]
    for header in refused[:-1]:
        assert store.authenticate(header, None, 1001) is None
    assert hashed == []  # malformed input never reached the hash
    assert store.authenticate(refused[-1], None, 1001) is None  # well-formed, unknown
    assert store.authenticate(f"bEaReR {token}", None, 1001) is not None
    assert len(compared) == 1  # the match was confirmed with compare_digest
    store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("sessions.db"))
    assert token.encode() not in raw and token[4:].encode() not in raw
    assert hashlib.sha256(token.encode()).digest() in raw  # control


# ---------------------------------------------------------------------------------------
# Cursors: MAC before parse, bound to scope, opaque failures, redacted key
# ---------------------------------------------------------------------------------------

def _scope(channel: str = "c1", agent: str = "a" * 64) -> CursorScope:
    return CursorScope(agent=agent, channel_id=channel, mentions_only=False, root_event_id=None)


def test_cursor_mac_is_checked_before_any_field_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = CursorCodec.open(tmp_path)
    good = codec.encode(Position(created_at=5, event_id="e" * 64), _scope(), now=100)
    unpacked: list[bytes] = []
    real = cursor_module._LAYOUT

    class _Spy:
        size = real.size

        def unpack(self, body: bytes) -> Any:
            unpacked.append(body)
            return real.unpack(body)

    monkeypatch.setattr(cursor_module, "_LAYOUT", _Spy())
    mutated = {good[:i] + ("A" if good[i] != "A" else "B") + good[i + 1:] for i in range(len(good))}
    for cursor in (*mutated, good[:-1], good + "A", "", "!" * len(good)):
        with pytest.raises(InvalidCursor) as raised:
            codec.decode(cursor, _scope(), now=100)
        assert raised.value.args == ()
    for scope in (_scope("c2"), _scope(agent="b" * 64),
                  CursorScope(agent="a" * 64, channel_id="c1", mentions_only=True,
                              root_event_id=None)):
        with pytest.raises(InvalidCursor):
            codec.decode(good, scope, now=100)
    assert unpacked == []  # nothing unauthenticated was parsed
    assert codec.decode(good, _scope(), now=100) == Position(created_at=5, event_id="e" * 64)
    assert len(unpacked) == 1
    key = (tmp_path / "cursor-mac.key").read_bytes()
    assert key.hex() not in repr(codec) and repr(key) not in repr(codec)
    assert (tmp_path / "cursor-mac.key").stat().st_mode & 0o077 == 0


# ---------------------------------------------------------------------------------------
# The client's credential: never in a repr, a message or a pickle
# ---------------------------------------------------------------------------------------

def test_client_credential_never_shows(tmp_path: Path) -> None:
    token = "bzb_" + "Q" * 43
    cred = Credential(token)
    client = AsyncBrokerClient(str(tmp_path / "broker.sock"), token)
    shown = [repr(cred), str(cred), f"{cred}", f"{cred!r}", repr(client), str(client)]
    assert not any(token in s or token[4:] in s for s in shown)
    for action in (lambda: pickle.dumps(cred), lambda: copy.copy(cred), lambda: pickle.dumps(client)):
        with pytest.raises(Exception) as raised:
            action()
        assert token not in str(raised.value)
    for bad in ("bzb_ " + "Q" * 42, "bzb_\n" + "Q" * 42, token + "é", "x" * 100_000):
        with pytest.raises(ValueError) as refused:
            Credential(bad)
        assert bad.strip() not in str(refused.value) and "QQQQ" not in str(refused.value)
    assert cred.authorization() == b"Bearer " + token.encode()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_call_timed_out_by_its_caller_keeps_the_credential_out_of_traceback_locals(
    backend: str,
) -> None:
    # asyncio.wait_for / anyio.fail_after around a call to a host that never answers: the
    # TimeoutError's traceback runs through the transport's receive wait, and whatever
    # renders it with locals (traceback's capture_locals, pytest --showlocals, Sentry) must
    # not show the Authorization header, nor the request head that carried it.
    import asyncio
    import shutil
    import traceback

    import anyio

    from tests.client.scripted_host import ScriptedHost, socket_dir, stall

    token = "bzb_" + "S3cr3t" * 7 + "Q"
    directory = socket_dir()
    host = ScriptedHost(path=f"{directory}/broker.sock", script=[stall()])

    async def timed_call(client: AsyncBrokerClient) -> BaseException:
        # The traceback starts in this frame: only the client (redacted) is in its locals.
        call = client.message_post("5df7dfa8-e919-43df-8efd-f1dcb8af7071", "hi")
        try:
            if backend == "asyncio":
                await asyncio.wait_for(call, 0.5)
            else:
                with anyio.fail_after(0.5):
                    await call
        except TimeoutError as exc:
            return exc
        raise AssertionError("the call was not timed out")

    async def main() -> BaseException:
        async with anyio.create_task_group() as tg:
            await tg.start(host.serve)
            try:
                return await timed_call(AsyncBrokerClient(host.path, token))
            finally:
                tg.cancel_scope.cancel()

    try:
        exc = anyio.run(main, backend=backend)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert len(host.received) == 1  # the request left: the wait was for the answer
    rendered = "".join(traceback.TracebackException.from_exception(exc, capture_locals=True).format())
    assert "_exchange_on" in rendered  # the timeout landed in the receive wait
    assert token not in rendered and token[4:20] not in rendered and "Bearer" not in rendered


#: A token shaped like those the broker issues (`bzb_` and 43 base64url characters).
_TOKEN = "bzb_" + "Zq9" * 14 + "x"

#: Errors the client raises at construction or reading its credential -> (the credential
#: file's bytes, or None for no file; the environment; keyword arguments). In the file and
#: environment rows the agent's own frames never held the token; in the argument rows it
#: may not have either (`credential=path.read_text()` keeps no name for it).
_CONSTRUCTION_ERRORS: dict[str, tuple[bytes | None, dict[str, str], dict[str, str]]] = {
    "file-agent-pubkey-typo": (_TOKEN.encode() + b"\n", {}, {"agent_pubkey": "npub1notahexkey"}),
    "file-utf8-bom": (b"\xef\xbb\xbf" + _TOKEN.encode() + b"\n", {}, {}),
    "file-bearer-prefix": (b"Bearer " + _TOKEN.encode() + b"\n", {}, {}),
    "file-no-break-space-tail": (_TOKEN.encode() + "\u00a0".encode(), {}, {}),
    "file-too-large": (_TOKEN.encode() + b"\n" + b"#" * 5000, {}, {}),
    "environment-both-variables": (
        None, {"BUZZ_BROKER_CREDENTIAL": _TOKEN,
               "BUZZ_BROKER_CREDENTIAL_FILE": "/run/agent/credential"}, {}),
    "environment-bearer-prefix": (None, {"BUZZ_BROKER_CREDENTIAL": "Bearer " + _TOKEN}, {}),
    "environment-agent-pubkey-typo": (
        None, {"BUZZ_BROKER_CREDENTIAL": _TOKEN}, {"agent_pubkey": "npub1notahexkey"}),
    "argument-trailing-newline": (None, {}, {"credential": _TOKEN + "\n"}),
    "argument-and-file": (_TOKEN.encode(), {}, {"credential": _TOKEN}),
    "argument-agent-pubkey-typo": (None, {}, {"credential": _TOKEN,
                                              "agent_pubkey": "npub1notahexkey"}),
    "argument-remote-address": (None, {}, {"credential": _TOKEN,
                                           "address": "http://example.org:8080"}),
    # A token read in binary mode: a TypeError that says so, not a failed comparison.
    "argument-bytes": (None, {}, {"credential": _TOKEN.encode()}),
}


def _client_locals(exc: BaseException) -> list[str]:
    """Every local of every frame of the client package on `exc`'s traceback, and on those
    of its causes and contexts (suppressed or not), as a crash reporter renders them."""
    import traceback

    import buzz_broker_client

    package = Path(buzz_broker_client.__file__).parent
    shown: list[str] = []
    pending = [traceback.TracebackException.from_exception(exc, capture_locals=True)]
    "".join(pending[0].format())  # renders at all (a repr that raises would stop it)
    while pending:
        report = pending.pop()
        for frame in report.stack:
            if Path(frame.filename).is_relative_to(package):
                shown.extend(f"{frame.name}: {name} = {value}"
                             for name, value in (frame.locals or {}).items())
        pending.extend(chained for chained in (report.__cause__, report.__context__)
                       if chained is not None)
    return shown


@pytest.mark.parametrize("blocking", [False, True], ids=["async", "blocking"])
@pytest.mark.parametrize("case", sorted(_CONSTRUCTION_ERRORS))
def test_a_client_construction_error_keeps_the_credential_out_of_traceback_locals(
    case: str, blocking: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sentry, pytest --showlocals and traceback's capture_locals render every frame's
    # locals: no frame of the client's may hold the token, whatever it refuses.
    from buzz_broker_client import BrokerClient

    content, environment, arguments = _CONSTRUCTION_ERRORS[case]
    for name in ("BUZZ_BROKER_SOCKET", "BUZZ_BROKER_CREDENTIAL", "BUZZ_BROKER_CREDENTIAL_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    kwargs: dict[str, Any] = {"address": "/run/b.sock", **arguments}
    if content is not None:
        path = tmp_path / "credential"
        path.write_bytes(content)
        path.chmod(0o400)
        kwargs["credential_file"] = str(path)
    with pytest.raises((ValueError, TypeError)) as refused:  # NotConfigured: a ValueError
        (BrokerClient if blocking else AsyncBrokerClient)(**kwargs)
    assert type(refused.value) is not TypeError or str(refused.value) == "credential must be a str"
    shown = _client_locals(refused.value)
    assert any(line.startswith("__init__: self = ") for line in shown)  # the frames are there
    assert not [line for line in shown if _TOKEN[4:24] in line]


# ---------------------------------------------------------------------------------------
# Logs: a plain record with an exception keeps only the exception's type name
# ---------------------------------------------------------------------------------------

def test_exception_text_never_reaches_a_log_line() -> None:
    secret_text = "nsec1" + "x" * 58
    try:
        raise ValueError(f"carrying {secret_text}")
    except ValueError as exc:
        record = logging.getLogger("buzz_broker.custody").makeRecord(
            "buzz_broker.custody", logging.ERROR, __file__, 1, "failed", (),
            exc_info=(ValueError, exc, exc.__traceback__),
        )
    line = format_record(record)
    assert secret_text not in line and json.loads(line)["exception"] == "ValueError"


# ---------------------------------------------------------------------------------------
# The unit file: the hardening the secrets rely on
# ---------------------------------------------------------------------------------------

def _directives() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            name, value = line.split("=", 1)
            found.setdefault(name, []).append(value)
    return found


def test_unit_keeps_secrets_out_of_cores_argv_and_environment() -> None:
    d = _directives()
    assert d["LimitCORE"] == ["0"] and d["UMask"] == ["0077"]
    assert d["NoNewPrivileges"] == ["yes"] and d["ProtectProc"] == ["invisible"]
    assert d["CapabilityBoundingSet"] == [""] and d["MemoryDenyWriteExecute"] == ["yes"]
    assert d["LoadCredential"] == ["token-pin:/etc/buzz-broker/token-pin"]
    assert d["StateDirectoryMode"] == ["0700"]
    environment = " ".join(d.get("Environment", []))
    assert "PYTHONOPTIMIZE" not in environment  # see finding 1
    assert not re.search(r"PIN|CREDENTIAL|TOKEN=|SECRET", environment, re.IGNORECASE)
    assert all("pin" not in arg.lower() for arg in d["ExecStart"][0].split()[1:])
