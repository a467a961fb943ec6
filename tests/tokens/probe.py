"""What a PKCS#11 token really does, tried one operation at a time (not just listed).

Usage (a client of the token: inside `with-token KIND --`, or with the same variables set):
    python -m tests.tokens.probe
prints one JSON object: {"kind": ..., "offers": {"AES_GCM": bool, ...}, "listed": [...]}.

Why a subprocess: python-pkcs11 initialises a module once per process and a second login
in one process fails (field-lab.md), so the probe must not share a process with custody.

Each entry of `offers` is an operation that worked end to end, because a token may list a
mechanism and refuse it (p11-kit 0.24's client drops every AES mechanism with a parameter):
- GENERATE_KEY: C_GenerateKey of a sensitive, non-extractable AES-256 token key.
- AES_GCM: encrypt and decrypt 32 bytes with a host 96-bit IV and AAD, round trip.
- AES_ECB: encrypt two blocks and decrypt them back (the key never leaves the token, so
  a round trip is the check).
- SHA256_HMAC: sign and verify with a SHA256-HMAC (TPM) or generic-secret key.
- CREATE_AES_KEY: C_CreateObject of a session AES key of a known value that encrypts.
- MARKS_IMPORTED_KEYS: such a key, made sensitive and non-extractable, reads back
  ALWAYS_SENSITIVE and NEVER_EXTRACTABLE false: its value was known outside the token, and
  custody's KEK checks can only refuse an imported KEK on a token that says so.
Where the token cannot generate keys (TPM), the probe's keys come from `tpm2_ptool addkey`.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Callable
from typing import Any

import pkcs11
from pkcs11 import Attribute, KeyType, Mechanism, MechanismFlag, ObjectClass
from pkcs11.mechanisms import GCMParams

from tests.tokens.kinds import ENV_KIND, ENV_LABEL, ENV_MODULE, ENV_PIN_FILE, add_tpm_keys, read_pin

PROBE_LABEL = "buzz-probe"
_SENSITIVE = {Attribute.SENSITIVE: True, Attribute.EXTRACTABLE: False, Attribute.PRIVATE: True}


def _find(session: Any, label: str) -> Any:
    found = list(session.get_objects({Attribute.CLASS: ObjectClass.SECRET_KEY,
                                      Attribute.LABEL: label}))
    if not found:
        raise SystemExit(f"probe key {label!r} is not in the token")
    return found[0]


def _works(attempt: Callable[[], bool]) -> bool:
    try:
        return attempt()
    except pkcs11.PKCS11Error:
        return False


def probe() -> dict[str, Any]:
    kind = os.environ.get(ENV_KIND, "softhsm")
    lib = pkcs11.lib(os.environ[ENV_MODULE])
    token = lib.get_token(token_label=os.environ[ENV_LABEL])
    listed = sorted(m.name if isinstance(m, Mechanism) else str(m) for m in token.slot.get_mechanisms())
    aes_label, mac_label = PROBE_LABEL, f"{PROBE_LABEL}-mac"
    pin = read_pin(os.environ[ENV_PIN_FILE])
    with token.open(rw=True, user_pin=pin) as session:
        generated = _works(lambda: session.generate_key(
            KeyType.AES, 256, label=aes_label, store=True, template=_SENSITIVE,
            capabilities=MechanismFlag.ENCRYPT | MechanismFlag.DECRYPT) is not None)
        if generated:
            session.generate_key(KeyType.GENERIC_SECRET, 256, label=mac_label, store=True,
                                 template=_SENSITIVE,
                                 capabilities=MechanismFlag.SIGN | MechanismFlag.VERIFY)
    if not generated:
        add_tpm_keys(aes_label)  # the one way a TPM token makes keys
        lib.reinitialize()  # tpm2-pkcs11 reads its store at C_Initialize
        token = lib.get_token(token_label=os.environ[ENV_LABEL])
    with token.open(rw=True, user_pin=pin) as session:
        offers = {"GENERATE_KEY": generated} | _operations(session, aes_label, mac_label)
    return {"kind": kind, "offers": offers, "listed": listed}


def _operations(session: Any, aes_label: str, mac_label: str) -> dict[str, bool]:
    aes, mac = _find(session, aes_label), _find(session, mac_label)
    attributes = {name: bool(aes[getattr(Attribute, name)])
                  for name in ("SENSITIVE", "NEVER_EXTRACTABLE", "EXTRACTABLE")}
    if not attributes["SENSITIVE"] or not attributes["NEVER_EXTRACTABLE"] or attributes["EXTRACTABLE"]:
        raise SystemExit(f"probe key attributes are wrong: {attributes}")
    data = secrets.token_bytes(32)

    def gcm() -> bool:
        params = GCMParams(secrets.token_bytes(12), b"aad", 128)
        sealed = aes.encrypt(data, mechanism=Mechanism.AES_GCM, mechanism_param=params)
        return bool(aes.decrypt(sealed, mechanism=Mechanism.AES_GCM, mechanism_param=params) == data)

    def ecb() -> bool:
        out = aes.encrypt(data, mechanism=Mechanism.AES_ECB)
        return len(out) == 32 and out != data and aes.decrypt(out, mechanism=Mechanism.AES_ECB) == data

    def hmac() -> bool:
        tag = mac.sign(data, mechanism=Mechanism.SHA256_HMAC)
        return len(tag) == 32 and bool(mac.verify(data, tag, mechanism=Mechanism.SHA256_HMAC))

    def create() -> bool:
        known = session.create_object({
            Attribute.CLASS: ObjectClass.SECRET_KEY, Attribute.KEY_TYPE: KeyType.AES,
            Attribute.VALUE: bytes(32), Attribute.ENCRYPT: True, Attribute.TOKEN: False,
        })
        return len(known.encrypt(bytes(16), mechanism=Mechanism.AES_ECB)) == 16

    def marks_imported() -> bool:
        known = session.create_object({
            Attribute.CLASS: ObjectClass.SECRET_KEY, Attribute.KEY_TYPE: KeyType.AES,
            Attribute.VALUE: bytes(32), Attribute.ENCRYPT: True, Attribute.TOKEN: False,
            Attribute.SENSITIVE: True, Attribute.EXTRACTABLE: False,
        })
        return not known[Attribute.ALWAYS_SENSITIVE] and not known[Attribute.NEVER_EXTRACTABLE]

    return {"AES_GCM": _works(gcm), "AES_ECB": _works(ecb), "SHA256_HMAC": _works(hmac),
            "CREATE_AES_KEY": _works(create), "MARKS_IMPORTED_KEYS": _works(marks_imported)}


if __name__ == "__main__":
    print(json.dumps(probe(), sort_keys=True))
    sys.exit(0)
