"""Every wipe custody promises, at its call site, one test each (issue 22, defence 7).

Each test spies on the buffer a call site is meant to wipe: it keeps a reference to the
very object (a bytearray, an immutable bytes zeroed in place, a cffi buffer), lets the real
code run against the session's SoftHSM token, and then reads the object: all zeros, or
the wipe is missing. A positive control in each test shows the spied object did hold the
secret while it was in use, so a test cannot pass by watching the wrong buffer.

Sites: `seal()`'s plaintext copy; libsecp256k1's keypair and ECDH intermediates; the
AES-GCM plaintext the token returns; the encrypt-then-MAC keystream, sealing and opening;
the Secret `unseal()` filled before a defence refused it; a backup's plaintext (the
export's buffer and the bytes handed to age, the restore's decrypted bytes and the buffer
`BackupContents` holds); the PIN buffer read at login.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyrage
import pytest

import custody._backup as backup_module
import custody._secp256k1 as curve_module
import custody._sealed as sealed_module
import custody._token as token_module
from custody import Custody, export_backup, open_backup
from tests.custody._sealing import (
    SEAL_KINDS,
    blob_of,
    event,
    held_custody,
    put_blob,
    refused_by,
    seal_as,
    secret_of,
)
from tests.custody._secrets import PUB_2, SECRET_1, SECRET_2
from tests.fixtures.token import SoftHsmToken


def _zero(data: bytes | bytearray) -> bool:
    return len(data) > 0 and not any(data)


@pytest.mark.parametrize("kind", SEAL_KINDS)
async def test_seal_wipes_its_plaintext_copy(
    softhsm_token: SoftHsmToken, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[bytearray, bytes]] = []
    real = sealed_module._SEALERS[kind]

    def spy(token: Any, kek: str, nonce: bytes, plaintext: bytearray, aad: bytes) -> bytes:
        seen.append((plaintext, bytes(plaintext)))
        return real(token, kek, nonce, plaintext, aad)

    monkeypatch.setitem(sealed_module._SEALERS, kind, spy)
    async with held_custody(softhsm_token, kind, tmp_path / "state", f"wipe-seal-{kind}"):
        pass  # importing A and B sealed each once
    assert [during for _, during in seen] == [bytes.fromhex(SECRET_1), bytes.fromhex(SECRET_2)]
    assert all(_zero(plaintext) for plaintext, _ in seen)


#: The cffi allocations in custody/_secp256k1 that hold the secret or a secret product.
_SECRET_BEARING = {"secp256k1_keypair *", "secp256k1_pubkey *", "unsigned char[33]"}


class _FfiSpy:
    """custody._secp256k1's `ffi`, keeping every secret-bearing buffer it allocates."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.made: list[Any] = []

    def new(self, ctype: str, *args: Any) -> Any:
        cdata = self._real.new(ctype, *args)
        if ctype in _SECRET_BEARING:
            self.made.append(cdata)
        return cdata

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.token_independent
@pytest.mark.parametrize("call", ["xonly_pubkey", "schnorr_sign", "ecdh_x"])
def test_libsecp256k1_intermediates_are_zeroed(call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_ffi = curve_module.ffi
    spy = _FfiSpy(real_ffi)
    monkeypatch.setattr(curve_module, "ffi", spy)
    with secret_of(SECRET_1) as secret:
        if call == "xonly_pubkey":
            curve_module.xonly_pubkey(secret)
        elif call == "schnorr_sign":
            curve_module.schnorr_sign(secret, bytes(32), bytes(32))
        else:
            with curve_module.ecdh_x(secret, bytes.fromhex(PUB_2)):
                pass
    assert spy.made, "the spy saw no intermediate"
    # Positive control: the same allocation, not zeroed, holds the secret (a keypair's
    # first 32 bytes are the secret key, big-endian).
    probe = real_ffi.new("secp256k1_keypair *")
    with secret_of(SECRET_1) as secret:
        assert curve_module.lib.secp256k1_keypair_create(curve_module._CTX, probe, secret.cdata)
    assert bytes(real_ffi.buffer(probe))[:32] == bytes.fromhex(SECRET_1)
    real_ffi.memmove(probe, bytes(real_ffi.sizeof("secp256k1_keypair")),
                     real_ffi.sizeof("secp256k1_keypair"))
    assert all(_zero(bytes(real_ffi.buffer(cdata))) for cdata in spy.made)


@pytest.mark.token_offers("AES_GCM")
async def test_the_gcm_plaintext_is_wiped_after_each_unseal(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    returned: list[tuple[bytes, bytes]] = []
    real = token_module.Token.gcm_decrypt

    def spy(self: Any, *args: Any) -> bytes:
        plaintext: bytes = real(self, *args)
        returned.append((plaintext, bytes(bytearray(plaintext))))
        return plaintext

    monkeypatch.setattr(token_module.Token, "gcm_decrypt", spy)
    async with held_custody(softhsm_token, "gcm", tmp_path / "state", "wipe-gcm") as held:
        await held.custody.sign_event(held.a[1], event(held.a[1]))
    assert [during for _, during in returned] == [bytes.fromhex(SECRET_1)]
    assert all(_zero(plaintext) for plaintext, _ in returned)


async def test_the_etm_keystream_is_wiped_after_each_seal_and_each_unseal(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keystream XOR the blob's ciphertext is the key: as secret as the plaintext.
    returned: list[tuple[bytes, bytes]] = []
    real = token_module.Token.keystream

    def spy(self: Any, *args: Any) -> bytes:
        stream: bytes = real(self, *args)
        returned.append((stream, bytes(bytearray(stream))))
        return stream

    monkeypatch.setattr(token_module.Token, "keystream", spy)
    async with held_custody(softhsm_token, "etm", tmp_path / "state", "wipe-keystream") as held:
        await held.custody.sign_event(held.a[1], event(held.a[1]))  # A sealed, B sealed, A opened
        blob = blob_of(held.state, held.a[1])
    # Positive control: A's seal and A's unseal asked for the same keystream (one nonce),
    # and it turns A's ciphertext into A's key.
    assert len(returned) == 3 and returned[0][1] == returned[2][1]
    ciphertext = blob[-64:-32]
    assert bytes(c ^ k for c, k in zip(ciphertext, returned[2][1])) == bytes.fromhex(SECRET_1)
    assert all(_zero(stream) for stream, _ in returned)


@pytest.mark.parametrize("kind", SEAL_KINDS)
async def test_a_key_opened_then_refused_is_wiped(
    softhsm_token: SoftHsmToken, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A's key sealed with B's AAD, on B's record, gets past the format, KEK and
    authentication defences and opens; the pubkey defence refuses it. The Secret it was
    opened into held A's key, and is zero once refused."""
    checked: list[tuple[Any, bytes]] = []
    real = sealed_module.xonly_pubkey

    def spy(secret: Any) -> bytes:
        checked.append((secret, bytes(secret.cdata)))
        return real(secret)

    async with held_custody(softhsm_token, kind, tmp_path / "state",
                            f"wipe-refused-{kind}") as held:
        b = held.b[1]
        put_blob(held.state, b, await seal_as(held, held.a[0], b))
        monkeypatch.setattr(sealed_module, "xonly_pubkey", spy)
        assert await refused_by(held, b, caplog) == "pubkey"
    assert [during for _, during in checked] == [bytes.fromhex(SECRET_1)]
    assert all(_zero(bytes(secret.cdata)) for secret, _ in checked)


async def test_a_backups_plaintext_is_wiped_on_export_and_on_open(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    buffers: list[bytearray] = []
    handed: list[tuple[bytes, bool]] = []
    decrypted: list[tuple[bytes, bool]] = []
    real_write, real_encrypt, real_decrypt = (backup_module._write_hex, pyrage.encrypt,
                                              pyrage.decrypt)

    def write_spy(out: bytearray, at: int, secret: Any) -> None:
        buffers.append(out)
        real_write(out, at, secret)

    def encrypt_spy(plaintext: bytes, recipients: Any) -> bytes:
        handed.append((plaintext, SECRET_1.encode() in plaintext))
        return real_encrypt(plaintext, recipients)

    def decrypt_spy(ciphertext: bytes, identities: Any) -> bytes:
        plaintext: bytes = real_decrypt(ciphertext, identities)
        decrypted.append((plaintext, SECRET_1.encode() in plaintext))
        return plaintext

    monkeypatch.setattr(backup_module, "_write_hex", write_spy)
    monkeypatch.setattr(backup_module.pyrage, "encrypt", encrypt_spy)
    monkeypatch.setattr(backup_module.pyrage, "decrypt", decrypt_spy)
    identity = pyrage.x25519.Identity.generate()
    async with held_custody(softhsm_token, "etm", tmp_path / "state", "wipe-backup") as held:
        exported = await export_backup(held.custody, [str(identity.to_public())])
    contents = open_backup(exported.ciphertext, bytearray(str(identity).encode()))
    with contents:
        held_buffer = contents._plaintext
        assert SECRET_1.encode() in held_buffer  # positive control: the secrets are there
    # Export: the one buffer, and the bytes pyrage took, both held the secret; both zero.
    assert len({id(b) for b in buffers}) == 1 and [h for _, h in handed] == [True]
    assert _zero(buffers[0]) and _zero(handed[0][0])
    # Open: pyrage's decrypted bytes and the buffer the contents held, both zero.
    assert [d for _, d in decrypted] == [True]
    assert _zero(decrypted[0][0]) and _zero(held_buffer)


async def test_the_pin_buffer_is_zeroed_after_login(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pin = Path(softhsm_token.pin_file).read_bytes().strip()
    read: list[tuple[bytearray, bytes]] = []
    real = token_module._read_pin

    def spy(config: Any) -> bytearray:
        buffer = real(config)
        read.append((buffer, bytes(buffer)))
        return buffer

    monkeypatch.setattr(token_module, "_read_pin", spy)
    async with held_custody(softhsm_token, "etm", tmp_path / "state", "wipe-pin"):
        pass
    opened = await Custody.open(softhsm_token.config(kek_label="wipe-pin"), tmp_path / "state")
    await opened.aclose()
    assert read and all(during == pin for _, during in read)
    assert all(_zero(buffer) for buffer, _ in read)
