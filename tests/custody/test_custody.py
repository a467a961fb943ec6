"""The facade on a real SoftHSM2 token: signing, owner tags, NIP-AE, lifecycle, and bad input."""

from __future__ import annotations

import json
import logging
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import nostr_sdk
import pytest
import trio

from custody import (
    Custody,
    CustodyError,
    SignedEvent,
    TokenConfig,
    UnknownAgent,
    UnsealFailed,
    UnsignedEvent,
    init_kek,
    verify_event,
    verify_owner_tag,
)
from tests.custody._secrets import PUB_1, PUB_2, SECRET_1, SECRET_2, SECRET_X, assert_no_secrets
from tests.fixtures.token import SoftHsmToken

HUMAN = "a" * 64  # an owner whose key this host does not hold
TRICKY_CONTENT = [
    "plain",
    "emoji 🐝🧠 and ZWJ 👩‍💻",
    "CJK 中文字符 日本語 한국어",
    'quotes " and \' and `',
    "backslashes \\ \\\\ \\n (literal)",
    "controls \x00\x01\x07\x08\t\n\r\x0b\x0c\x1b\x7f",
    "mixed \u2028\u2029 line separators and \ud7ff \ue000 \U0001f600",
    "",
]


def nostr_sdk_verifies(event: SignedEvent) -> bool:
    obj = event.to_json_obj()
    parsed = nostr_sdk.Event.from_json(json.dumps(obj, ensure_ascii=False))
    return bool(parsed.verify()) and parsed.id().to_hex() == event.id


async def import_hex(custody: Custody, secret_hex: str, owner: str, name: str = "a") -> str:
    record = await custody.import_agent(bytearray(secret_hex.encode()), owner=owner)
    return record.pubkey


async def test_import_prints_the_known_pubkey_and_signs_verifiable_events(custody: Custody) -> None:
    agent = await import_hex(custody, SECRET_1, PUB_2)
    assert agent == PUB_1
    events = await custody.sign_events(
        [(agent, UnsignedEvent(agent, 1_700_000_000 + i, 9, (("h", "c"),), text))
         for i, text in enumerate(TRICKY_CONTENT)]
    )
    for event, text in zip(events, TRICKY_CONTENT):
        assert event.content == text
        assert verify_event(event.to_json_obj())
        assert nostr_sdk_verifies(event)


async def test_owned_agent_carries_its_owner_tag_exactly_once(custody: Custody) -> None:
    owner = await import_hex(custody, SECRET_X, HUMAN)
    minted = await custody.mint_agent(owner=owner, mint_ref=None)
    assert minted.auth_tag is not None and verify_owner_tag(minted.auth_tag, minted.pubkey)
    tag = minted.auth_tag
    plain = await custody.sign_event(minted.pubkey, UnsignedEvent(minted.pubkey, 1, 1, (("t", "x"),), "hi"))
    again = await custody.sign_event(minted.pubkey, UnsignedEvent(minted.pubkey, 1, 1, (tag, ("t", "x")), "hi"))
    auth = await custody.sign_auth(minted.pubkey, "wss://relay.example/", "ch4ll", 5)
    for event in (plain, again, auth):
        assert [t for t in event.tags if t[0] == "auth"] == [tag]
        assert nostr_sdk_verifies(event)
    assert auth.kind == 22242 and auth.tags[:2] == (("relay", "wss://relay.example/"), ("challenge", "ch4ll"))
    forged = ("auth", HUMAN, "", "0" * 128)
    with pytest.raises(ValueError):
        await custody.sign_event(minted.pubkey, UnsignedEvent(minted.pubkey, 1, 1, (forged,), ""))
    # An agent without a tag may not be given one by a caller either.
    with pytest.raises(ValueError):
        await custody.sign_event(owner, UnsignedEvent(owner, 1, 1, (tag,), ""))


async def test_mint_is_idempotent_on_mint_ref(custody: Custody) -> None:
    first = await custody.mint_agent(owner=HUMAN, mint_ref="req-1")
    second = await custody.mint_agent(owner=HUMAN, mint_ref="req-1")
    other = await custody.mint_agent(owner=HUMAN, mint_ref="req-2")
    assert first == second and other.pubkey != first.pubkey
    assert first.auth_tag is None  # owner not held (a human): nobody here signs its tag
    with pytest.raises(CustodyError, match="another owner"):
        await custody.mint_agent(owner=PUB_2, mint_ref="req-1")
    assert {r.pubkey for r in custody.agents()} == {first.pubkey, other.pubkey}


async def test_memory_address_matches_nip_ae_vector(custody: Custody) -> None:
    agent = await import_hex(custody, SECRET_1, PUB_2)
    address = await custody.memory_address(agent, "mem/example")
    assert (address.author_pubkey, address.kind, address.d_tag) == (
        PUB_1, 30174, "72d4f9629106451505d7d341ea85bb3ebad4f654fcfd2aad100d5a35f8a85cba"
    )
    with pytest.raises(ValueError):
        await custody.memory_address(agent, "../etc")


async def test_destroy_keeps_a_tombstone_and_stops_signing(custody: Custody) -> None:
    agent = await import_hex(custody, SECRET_2, HUMAN)
    gone = await custody.destroy_agent(agent)
    assert gone.deleted_at is not None and custody.agent(agent) is None
    assert custody.agent(agent, include_deleted=True) == gone
    assert await custody.destroy_agent(agent) == gone  # idempotent
    with pytest.raises(UnknownAgent):
        await custody.sign_event(agent, UnsignedEvent(agent, 1, 1, (), ""))
    with pytest.raises(UnknownAgent):
        await custody.destroy_agent(HUMAN)
    with pytest.raises(CustodyError, match="tombstone"):
        await import_hex(custody, SECRET_2, HUMAN)


async def test_unknown_agent_and_caller_bugs(custody: Custody) -> None:
    with pytest.raises(UnknownAgent):
        await custody.sign_event(HUMAN, UnsignedEvent(HUMAN, 1, 1, (), ""))
    with pytest.raises(UnknownAgent):
        await custody.memory_address(HUMAN, "core")
    agent = await import_hex(custody, SECRET_1, PUB_2)
    with pytest.raises(ValueError):  # event pubkey is not the signer
        await custody.sign_event(agent, UnsignedEvent(HUMAN, 1, 1, (), ""))
    with pytest.raises(ValueError):
        await custody.sign_event("NOT-HEX", UnsignedEvent(agent, 1, 1, (), ""))


async def test_owner_equal_to_agent_is_refused_and_nothing_written(custody: Custody) -> None:
    with pytest.raises(CustodyError, match="cannot own itself"):
        await import_hex(custody, SECRET_1, PUB_1)
    with pytest.raises(CustodyError, match="malformed secret"):
        await import_hex(custody, "not a key", PUB_2)
    with pytest.raises(CustodyError, match="does not verify"):
        await custody.import_agent(
            bytearray(SECRET_1.encode()), owner=PUB_2, auth_tag=["auth", PUB_2, "", "0" * 128]
        )
    assert custody.agents(include_deleted=True) == []


async def test_swapped_or_tampered_blob_fails_to_open(custody_state: tuple[TokenConfig, Path]) -> None:
    config, state_dir = custody_state
    async with await Custody.open(config, state_dir) as custody:
        a = await import_hex(custody, SECRET_1, HUMAN)
        b = await import_hex(custody, SECRET_2, HUMAN)
    db = sqlite3.connect(state_dir / "keystore.db")
    blob_a = db.execute("SELECT sealed FROM keys WHERE pubkey=?", (a,)).fetchone()[0]
    with db:
        db.execute("UPDATE keys SET sealed=? WHERE pubkey=?", (blob_a, b))  # a's key onto b
    async with await Custody.open(config, state_dir) as custody:
        with pytest.raises(UnsealFailed):
            await custody.sign_event(b, UnsignedEvent(b, 1, 1, (), ""))
        for position in (0, 5, 20, len(blob_a) - 1):  # version, IV, ciphertext, tag
            tampered = bytearray(blob_a)
            tampered[position] ^= 0x01
            with db:
                db.execute("UPDATE keys SET sealed=? WHERE pubkey=?", (bytes(tampered), a))
            with pytest.raises(UnsealFailed):
                await custody.memory_address(a, "core")
    db.close()


@pytest.mark.token_unseals(4000)
async def test_eight_tasks_times_500_signatures_all_verify(custody: Custody) -> None:
    agents = [await import_hex(custody, SECRET_1, PUB_2), await import_hex(custody, SECRET_X, HUMAN)]
    results: list[SignedEvent] = []

    async def worker(n: int) -> None:
        for i in range(500):
            agent = agents[(n + i) % 2]
            results.append(await custody.sign_event(agent, UnsignedEvent(agent, i, 1, (("n", str(n)),), f"{n}/{i}")))

    async with trio.open_nursery() as nursery:
        for n in range(8):
            nursery.start_soon(worker, n)
    assert len(results) == 4000
    assert all(verify_event(e.to_json_obj()) for e in results)
    assert all(nostr_sdk_verifies(e) for e in results[::97])


async def test_open_is_fast_with_ten_thousand_agents(custody_state: tuple[TokenConfig, Path]) -> None:
    config, state_dir = custody_state
    async with await Custody.open(config, state_dir) as custody:
        await import_hex(custody, SECRET_1, PUB_2)
    db = sqlite3.connect(state_dir / "keystore.db")
    blob = db.execute("SELECT sealed FROM keys").fetchone()[0]
    with db:
        db.executemany(
            "INSERT INTO keys (pubkey, owner, created_at, updated_at, sealed)"
            " VALUES (?, ?, 0, 0, ?)",
            ((f"{i:064x}", HUMAN, blob) for i in range(1, 10_001)),
        )
    db.close()
    started = time.perf_counter()
    async with await Custody.open(config, state_dir) as custody:
        opened = time.perf_counter() - started
        assert len(custody.agents()) == 10_001
    # Nothing is unsealed at open; a loose bound that still catches per-agent work (10k unseals ~ 0.3 s+).
    assert opened < 0.25


@pytest.mark.token_offers("GENERATE_KEY")
def test_extractable_kek_is_refused(softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    # A separate process makes the bad key, so this process's shared session is untouched.
    script = (
        "import pkcs11, sys\n"
        "from pkcs11 import Attribute as A, KeyType\n"
        "tok = pkcs11.lib(sys.argv[1]).get_token(token_label=sys.argv[2])\n"
        "pin = open(sys.argv[3]).read().strip()\n"
        "with tok.open(rw=True, user_pin=pin) as s:\n"
        "    try:\n"
        "        s.get_key(label='leaky-kek')\n"
        "    except pkcs11.NoSuchKey:\n"
        "        s.generate_key(KeyType.AES, 256, label='leaky-kek', store=True,\n"
        "                       template={A.EXTRACTABLE: True, A.SENSITIVE: False, A.PRIVATE: True})\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, softhsm_token.module, softhsm_token.label, softhsm_token.pin_file],
        check=True, timeout=60,
    )
    config = softhsm_token.config(kek_label="leaky-kek")
    with pytest.raises(CustodyError, match="refusing KEK 'leaky-kek': EXTRACTABLE"):
        trio.run(Custody.open, config, tmp_path)
    with pytest.raises(CustodyError, match="EXTRACTABLE"):
        trio.run(init_kek, config)


def test_wrong_pin_fails_cleanly(softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-pin"
    wrong.write_text("not-the-pin\n")
    wrong.chmod(0o600)
    with pytest.raises(CustodyError, match="wrong PIN") as caught:
        trio.run(Custody.open, softhsm_token.config(pin_file=str(wrong)), tmp_path / "state")
    assert "not-the-pin" not in str(caught.value)
    assert not (tmp_path / "state").exists()  # nothing written before login succeeded


def test_pin_file_readable_by_others_is_refused(softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    loose = tmp_path / "pin"
    loose.write_text(Path(softhsm_token.pin_file).read_text())
    loose.chmod(0o644)
    with pytest.raises(CustodyError, match="chmod 600"):
        trio.run(Custody.open, softhsm_token.config(pin_file=str(loose)), tmp_path)


def test_pin_from_systemd_credentials(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = tmp_path / "creds"
    credentials.mkdir()
    (credentials / "token-pin").write_text(Path(softhsm_token.pin_file).read_text())
    (credentials / "token-pin").chmod(0o400)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    config = TokenConfig(softhsm_token.module, softhsm_token.label, None, softhsm_token.config().kek_label)
    trio.run(init_kek, config)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(CustodyError, match="no token PIN"):
        trio.run(init_kek, config)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"module": "/nonexistent/libpkcs11.so"}, "does not exist"),
        ({"token_label": "no-such-token"}, "no token labelled 'no-such-token'"),
        ({"kek_label": "never-made"}, "run `buzz-broker keys init`"),
    ],
)
def test_missing_module_token_or_kek(
    softhsm_token: SoftHsmToken, tmp_path: Path, change: dict[str, str], message: str
) -> None:
    base = softhsm_token.config()
    config = TokenConfig(**{**{f: getattr(base, f) for f in ("module", "token_label", "pin_file", "kek_label")}, **change})
    with pytest.raises(CustodyError, match=message.replace("(", r"\(").replace("`", "`")):
        trio.run(Custody.open, config, tmp_path)


async def test_no_secret_in_logs_output_or_keystore(
    custody_state: tuple[TokenConfig, Path], caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    config, state_dir = custody_state
    async with await Custody.open(config, state_dir) as custody:
        owner = await import_hex(custody, SECRET_X, HUMAN)
        sub = await custody.mint_agent(owner=owner, mint_ref="r")
        await custody.sign_event(sub.pubkey, UnsignedEvent(sub.pubkey, 1, 1, (), "x"))
        await custody.memory_address(owner, "core")
        for bad in (SECRET_1 + "0", SECRET_X[:-1]):
            with pytest.raises(CustodyError) as caught:
                await import_hex(custody, bad, HUMAN)
            assert_no_secrets(str(caught.value).encode())
        print(repr(custody), custody.agents())
    out, err = capfd.readouterr()
    files = b"".join(p.read_bytes() for p in state_dir.iterdir() if p.is_file())
    assert_no_secrets(out.encode() + err.encode() + caplog.text.encode() + files)
    assert (state_dir.stat().st_mode & 0o777) == 0o700
    assert ((state_dir / "keystore.db").stat().st_mode & 0o777) == 0o600


async def test_a_keystore_left_readable_to_a_group_is_tightened_at_open(
    custody_state: tuple[TokenConfig, Path]
) -> None:
    """The keystore is its holder's alone: a directory or file an operator left open to a
    group (as an earlier two-uid layout did for the pipeline) is made 0700 / 0600 again."""
    config, state_dir = custody_state
    async with await Custody.open(config, state_dir):
        pass
    state_dir.chmod(0o2750)
    (state_dir / "keystore.db").chmod(0o640)
    async with await Custody.open(config, state_dir):
        pass
    assert (state_dir.stat().st_mode & 0o7777) == 0o700
    assert ((state_dir / "keystore.db").stat().st_mode & 0o7777) == 0o600


#: An early refusal of import_agent -> the arguments that provoke it.
_IMPORT_REFUSALS: dict[str, dict[str, object]] = {
    "bad owner": {"owner": "XYZ"},
    "short auth tag": {"auth_tag": ["auth", PUB_2]},
    "closed": {},  # custody closed before the call
    "bad secret": {},  # the text is not a key (refused inside the worker)
}


@pytest.mark.parametrize("refusal", list(_IMPORT_REFUSALS))
async def test_import_zeroes_the_secret_text_on_every_refusal(
    custody_state: tuple[TokenConfig, Path], refusal: str
) -> None:
    """Security review: early refusals returned with the secret still in the caller's buffer."""
    config, state_dir = custody_state
    opened = await Custody.open(config, state_dir)
    text = bytearray((SECRET_2 if refusal != "bad secret" else "zz" * 32).encode("ascii"))
    kwargs: dict[str, object] = {"owner": PUB_2, **_IMPORT_REFUSALS[refusal]}
    if refusal == "closed":
        await opened.aclose()
    try:
        with pytest.raises((CustodyError, ValueError)):
            await opened.import_agent(text, **kwargs)  # type: ignore[arg-type]
    finally:
        await opened.aclose()
    assert text == bytearray(len(text))


#: 64 hex digits that are no curve point's x (x^3 + 7 is not a square mod p).
NOT_A_POINT = "b" * 64


async def test_owners_that_are_no_curve_point_are_refused_with_a_custody_error(
    custody: Custody,
) -> None:
    """Security review: such an owner was stored, and memory_address later raised a bare
    ValueError (HTTP 500 in the daemon)."""
    with pytest.raises(CustodyError, match="not a secp256k1"):
        await custody.mint_agent(owner=NOT_A_POINT,
                                 mint_ref=None)
    text = bytearray(SECRET_2.encode("ascii"))
    with pytest.raises(CustodyError, match="not a secp256k1"):
        await custody.import_agent(text, owner=NOT_A_POINT)
    assert text == bytearray(len(text))
    assert custody.agents(include_deleted=True) == []


async def test_an_agent_stored_with_an_off_curve_owner_gets_a_custody_error_for_memory(
    custody: Custody, custody_state: tuple[TokenConfig, Path]
) -> None:
    """A keystore written before the check: memory_address answers CustodyError, and the
    agent still signs (its key is fine; only NIP-AE needs the owner as a point)."""
    _, state_dir = custody_state
    agent = await import_hex(custody, SECRET_1, PUB_2)
    db = sqlite3.connect(state_dir / "keystore.db", isolation_level=None)
    try:
        db.execute("UPDATE keys SET owner = ? WHERE pubkey = ?", (NOT_A_POINT, agent))
    finally:
        db.close()
    with pytest.raises(CustodyError) as raised:
        await custody.memory_address(agent, "core")
    assert type(raised.value) is CustodyError and NOT_A_POINT in str(raised.value)
    signed = await custody.sign_event(agent, UnsignedEvent(agent, 1, 1, (), "x"))
    assert verify_event(signed.to_json_obj())


@pytest.mark.token_independent
@pytest.mark.parametrize(
    ("candidate", "point"),
    [
        (bytes.fromhex(PUB_1), True),
        (bytes.fromhex(PUB_2), True),
        (bytes.fromhex("a" * 64), True),
        (bytes.fromhex(NOT_A_POINT), False),
        (bytes(32), False),  # x = 0: 7 is not a square mod p
        (b"\xff" * 32, False),  # >= p: not a field element
        (bytes.fromhex(PUB_1)[:31], False),
        (b"\x02" + bytes.fromhex(PUB_1), False),  # compressed, not x-only
    ],
)
def test_is_xonly_pubkey(candidate: bytes, point: bool) -> None:
    from custody._secp256k1 import is_xonly_pubkey

    assert is_xonly_pubkey(candidate) is point


async def test_public_reads_never_wait_for_the_token_workers_connection(custody: Custody) -> None:
    """The liveness check runs on the event loop: it must not queue behind the worker's
    keystore lock (held through a mint's fsync, or a destroy's checkpoint of up to 500 ms).
    The lock is held here for the whole check: a read that needed it could never finish."""
    agent = await import_hex(custody, SECRET_1, PUB_2)
    before = custody.records_version()
    answers: list[object] = []

    def read() -> None:
        answers.extend([custody.agent(agent), custody.agents(), custody.records_version()])

    with custody._keystore._lock:
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=30)  # a deadlock, not a slow day, is what would exceed this
        assert not reader.is_alive()
    record, listed, version = answers
    assert record is not None and listed == [record] and version == before
    # A commit through the worker's connection moves the version the reads see.
    await custody.mint_agent(owner=PUB_2)
    assert custody.records_version() != before and len(custody.agents()) == 2
