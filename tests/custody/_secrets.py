"""The test secrets, every spelling of them, and the scan that proves none leaked."""

from __future__ import annotations

import nostr_sdk

SECRET_1 = "0" * 63 + "1"
SECRET_2 = "0" * 63 + "2"
SECRET_3 = "0" * 63 + "3"
PUB_1 = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"
PUB_2 = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
PUB_3 = "f9308a019258c31049344f85f89d5229b531c845836f99b08601f113bce036f9"
#: An arbitrary secret that is not a tiny number, so its raw bytes are distinctive in a scan.
SECRET_X = "7f3a9c2e5b1d4f6a8c0e2b4d6f8a1c3e5b7d9f1a3c5e7b9d1f3a5c7e9b1d3f5a"
USED = (SECRET_1, SECRET_2, SECRET_3, SECRET_X)


def spellings(secret_hex: str) -> list[bytes]:
    """Every form a leaked secret could take in captured text or a file."""
    raw = bytes.fromhex(secret_hex)
    nsec = nostr_sdk.SecretKey.parse(secret_hex).to_bech32()
    forms = [secret_hex.encode(), secret_hex.upper().encode(), nsec.encode(), nsec.upper().encode()]
    # Raw bytes of tiny secrets (31 zero bytes and a 1) are too common to mean anything;
    # the distinctive secret is scanned raw as well.
    if raw.count(0) < 16:
        forms.append(raw)
    return forms


def assert_no_secrets(blob: bytes, secrets_hex: tuple[str, ...] = USED) -> None:
    for secret_hex in secrets_hex:
        for form in spellings(secret_hex):
            assert form not in blob, f"a test secret leaked ({len(form)}-byte form)"
