"""With the unsealed-key cache off (the default), nothing of an agent key stays in the
custodian's memory once its calls have returned: docs/custodian.md, "What stays in the
custodian's memory".

A freshly imported random key goes through every row that unseals it: `import` (the secret
text as the frame's raw tail), three `sign` requests (one a batch of two events),
`sign_auth` (NIP-42), `memory_address` (NIP-AE, which derives the conversation key),
`encrypt` and `decrypt` (NIP-44 to and from the owner). Three keys in turn, so the later
calls could reuse (or fail to reuse) the memory the earlier ones freed. Then the whole
readable memory of the custodian process is scanned (/proc/<pid>/mem,
tests/fixtures/memscan.py) for each key's
- 32 secret bytes and their 64 hex digits (the form the import sends);
- raw ECDH x-coordinate with the owner, the NIP-44 conversation key derived from it
  (HMAC-SHA256 under "nip44-v2") and the message keys of the payload it encrypted
  (ChaCha20 and HMAC keys: HKDF-expand under the payload's nonce), all computed here;
- keystream that opens its sealed blob: the blob's 32 ciphertext bytes XOR the key. Under
  encrypt-then-MAC the token hands exactly this to the custodian (AES-ECB of the counter
  blocks), and with the blob (on disk, and in the custodian's memory) it is the key.
For both seals. Before `_process.harden_process` set glibc's M_PERTURB this found the key
(AES-GCM) and the keystream (encrypt-then-MAC) in python-pkcs11's freed output buffers.

The control, showing the scan finds what is there: with the cache on, the custodian holds
each key, raw, by design, and the same scan finds exactly that: each key's 32 bytes once
(its cache slot), and nothing else.

Reading another process's memory needs root here: the custodian makes itself undumpable
(custody/_process.py), which closes /proc/<pid>/mem even to its parent of the same uid. The
custodian runs as a child under the test's own uid. Skipped, saying why, where the memory
cannot be read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import coincurve
import pytest
import trio
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from custody import CachePolicy, init_kek
from custody.custodian import messages
from custody.custodian.client import unb64
from tests.custody._sealing import SEAL_KINDS
from tests.custodian.test_refusals import ask, intent
from tests.fixtures.custodian import CustodianProcess, write_custodian_config
from tests.fixtures.memscan import memory_hits, readable_reason
from tests.fixtures.token import SoftHsmToken

#: Keys imported and used in turn before the scan.
KEYS = 3
#: The one size the cache holds; its slots outlive the test.
CACHE_ON = CachePolicy(16, 600.0)


@dataclass(frozen=True)
class Key:
    agent: str
    #: what the scan looks for, by name
    forms: dict[str, bytes]


def _random_secret() -> bytes:
    while True:  # 0 and values >= n are no keys (probability about 2^-128)
        raw = secrets.token_bytes(32)
        try:
            coincurve.PrivateKey(raw)
        except ValueError:
            continue
        return raw


def _sealed_ciphertext(state: Path, agent: str) -> bytes:
    """The 32 ciphertext bytes of the agent's format-2 blob (custody/_sealed.py)."""
    db = sqlite3.connect(f"file:{state / 'keystore.db'}?mode=ro", uri=True)
    try:
        blob = bytes(db.execute("SELECT sealed FROM keys WHERE pubkey = ?",
                                (agent,)).fetchone()[0])
    finally:
        db.close()
    assert blob[0] == 2, "a format-2 blob"
    start = 3 + blob[2] + 12  # version, seal kind, label length, label, nonce
    return blob[start:start + 32]


def _use_one_key(socket: Path, relay_url: str, state: Path) -> Key:
    """Import a fresh random key and go through every row that unseals it."""
    raw = _random_secret()
    owner = coincurve.PrivateKey().public_key_xonly.format().hex()
    ok, record = ask(socket, "import", tail=raw.hex().encode(), secret_bytes=64, owner=owner,
                     auth_tag=None)
    assert ok, record
    agent = record["pubkey"]  # type: ignore[index]
    assert agent == coincurve.PrivateKey(raw).public_key_xonly.format().hex()
    for events in ([intent(agent, 9, [["h", "c"]], "one")],
                   [intent(agent, 9, [["h", "c"]], "two")],
                   [intent(agent, 9, [["h", "c"]], "three"),
                    intent(agent, 9, [["h", "c"]], "four")]):
        ok, signed = ask(socket, "sign", events=events)
        assert ok and len(signed) == len(events), signed  # type: ignore[arg-type]
    ok, auth = ask(socket, "sign_auth", agent=agent, relay_url=relay_url, challenge="c",
                   created_at=1_700_000_000)
    assert ok, auth
    ok, address = ask(socket, "memory_address", agent=agent, slug="core")
    assert ok, address
    ok, payloads = ask(socket, "encrypt", agent=agent, peer=owner,
                       plaintexts=[messages.b64(b"a note for the owner")])
    assert ok, payloads
    ok, opened = ask(socket, "decrypt", agent=agent, peer=owner, payloads=payloads)
    assert ok and opened == [messages.b64(b"a note for the owner")], opened
    shared_x = coincurve.PublicKey(b"\x02" + bytes.fromhex(owner)).multiply(raw).format()[1:]
    conversation_key = hmac.digest(b"nip44-v2", shared_x, hashlib.sha256)
    nonce = unb64(payloads[0])[1:33]  # type: ignore[index]
    message_keys = HKDFExpand(SHA256(), 76, nonce).derive(conversation_key)
    keystream = bytes(c ^ k for c, k in zip(_sealed_ciphertext(state, agent), raw, strict=True))
    return Key(agent, {
        "secret": raw,
        "secret hex": raw.hex().encode(),
        "ECDH x": shared_x,
        "conversation key": conversation_key,
        "NIP-44 ChaCha20 key": message_keys[0:32],
        "NIP-44 HMAC key": message_keys[44:76],
        "keystream": keystream,
    })


@contextmanager
def _custodian(token: SoftHsmToken, seal: str, cache: CachePolicy, tmp_path: Path,
               relay_url: str) -> Iterator[CustodianProcess]:
    config = dataclasses.replace(token.config(kek_label=f"memscan-{seal}"), seal=seal)
    trio.run(init_kek, config)
    socket = tmp_path / "custodian.sock"
    process = CustodianProcess(write_custodian_config(
        tmp_path / "custodian.toml", token=config, state_dir=tmp_path / "state", socket=socket,
        relay_url=relay_url, cache=cache), socket)
    process.start()
    try:
        assert process.proc is not None
        reason = readable_reason(process.proc.pid)
        if reason is not None:
            pytest.skip(reason)
        yield process
    finally:
        process.stop()


def _found(pid: int, keys: list[Key]) -> list[str]:
    """Every occurrence of every form of every key: "key <i> <form> in <mapping>"."""
    labels = [(i, name) for i, key in enumerate(keys) for name in key.forms]
    needles = tuple(form for key in keys for form in key.forms.values())
    return [f"key {labels[hit.needle][0]} {labels[hit.needle][1]} in {hit.mapping}"
            for hit in memory_hits(pid, needles)]


@pytest.mark.parametrize("seal", SEAL_KINDS)
def test_with_the_cache_off_nothing_of_the_key_stays_in_the_custodians_memory(
        softhsm_token: SoftHsmToken, tmp_path: Path, local_relay: str, seal: str) -> None:
    with _custodian(softhsm_token, seal, CachePolicy(), tmp_path, local_relay) as custodian:
        keys = [_use_one_key(custodian.socket, local_relay, tmp_path / "state")
                for _ in range(KEYS)]
        assert custodian.proc is not None
        found = _found(custodian.proc.pid, keys)
    assert found == [], found


def test_the_control_with_the_cache_on_the_scan_finds_each_key_once(
        softhsm_token: SoftHsmToken, tmp_path: Path, local_relay: str) -> None:
    with _custodian(softhsm_token, "etm", CACHE_ON, tmp_path, local_relay) as custodian:
        keys = [_use_one_key(custodian.socket, local_relay, tmp_path / "state")
                for _ in range(KEYS)]
        assert custodian.proc is not None
        found = _found(custodian.proc.pid, keys)
    # Each key's cache slot, raw; no hex, no NIP-44 keys, no keystream, no second copy.
    assert sorted(entry.split(" in ")[0] for entry in found) == [
        f"key {i} secret" for i in range(KEYS)], found
