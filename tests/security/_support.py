"""Helpers for the security review tests: independent Nostr/NIP checks with coincurve, and
raw access to the keystore file (what an attacker with the disk would see)."""

from __future__ import annotations

import hashlib
import hmac
import json
import sqlite3
from pathlib import Path

import coincurve

KEYSTORE = "keystore.db"


def pubkey_of(secret: bytes) -> str:
    return coincurve.PrivateKey(secret).public_key_xonly.format().hex()


def event_id(obj: dict[str, object]) -> str:
    serial = [0, obj["pubkey"], obj["created_at"], obj["kind"], obj["tags"], obj["content"]]
    return hashlib.sha256(
        json.dumps(serial, separators=(",", ":"), ensure_ascii=False).encode()
    ).hexdigest()


def schnorr_ok(pubkey_hex: str, sig_hex: str, msg32: bytes) -> bool:
    return bool(coincurve.PublicKeyXOnly(bytes.fromhex(pubkey_hex)).verify(bytes.fromhex(sig_hex), msg32))


def event_ok(obj: dict[str, object]) -> bool:
    """NIP-01 id and BIP-340 signature, checked without custody's code."""
    return event_id(obj) == obj["id"] and schnorr_ok(
        str(obj["pubkey"]), str(obj["sig"]), bytes.fromhex(str(obj["id"]))
    )


def nip_oa_digest(agent: str, conditions: str) -> bytes:
    """NIP-OA preimage, written out independently: "nostr:agent-auth:" + agent + ":" + conditions."""
    return hashlib.sha256(("nostr:agent-auth:" + agent + ":" + conditions).encode("utf-8")).digest()


def nip_ae_d_tag(agent_secret: bytes, owner_pubkey: str, slug: str) -> str:
    """K_c = HMAC-SHA256("nip44-v2", raw x of ECDH) -- NOT sha256(x) -- then the d-tag HMAC."""
    point = coincurve.PublicKey(b"\x02" + bytes.fromhex(owner_pubkey)).multiply(agent_secret)
    raw_x = point.format(compressed=True)[1:]
    k_c = hmac.digest(b"nip44-v2", raw_x, hashlib.sha256)
    return hmac.digest(k_c, b"agent-memory/v1/d-tag\x00" + slug.encode(), hashlib.sha256).hex()


def sealed_blob(state_dir: Path, pubkey: str) -> bytes | None:
    db = sqlite3.connect(f"file:{state_dir / KEYSTORE}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT sealed FROM keys WHERE pubkey = ?", (pubkey,)).fetchone()
    finally:
        db.close()
    return None if row is None or row[0] is None else bytes(row[0])


def raw_files(state_dir: Path, stem: str = KEYSTORE) -> bytes:
    """Every byte of the database file and its WAL/SHM side files, concatenated."""
    out = b""
    for suffix in ("", "-wal", "-shm", "-journal"):
        path = state_dir / (stem + suffix)
        if path.exists():
            out += path.read_bytes()
    return out
