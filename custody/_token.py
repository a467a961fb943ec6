"""The PKCS#11 token: module, login, the key-encryption keys (KEKs) and the mechanisms
the seals are built from (AES-GCM; AES-ECB and HMAC-SHA256). The seals themselves, and the
blob format, are `_sealed`'s.

Rules:
- Every function here that calls PKCS#11 runs in the token worker (`_worker`), and says so
  by calling `require_lock()` first.
- The module is loaded once per path per process (`_PROCESS.libs`): python-pkcs11 calls
  C_Initialize per `pkcs11.lib` object, and `reinitialize()` would invalidate every handle.
- Login is per process and closing a logged-in session logs every session out
  (design.md), so one logged-in session per (module, token label) is shared by every
  `Token` in the process and closed when the last one closes. A second opener must present
  the same PIN: it is compared as an HMAC under a per-process random key, so neither the
  PIN nor a plain hash of it stays in memory.
- The token is found by label (SoftHSM slot ids are random).
- The PIN comes from `pin_file`, else `$CREDENTIALS_DIRECTORY/token-pin` (systemd
  credentials); never argv or the environment. It is opened without following a symlink
  and checked on the open descriptor: a regular file, no group/other bits, owned by this
  process's effective uid or root (see `_read_pin`).

The seal, chosen by what the token offers (`choose_seal`, never a silent downgrade):
- `TokenConfig.seal` is "auto" (default), "gcm" or "etm". "auto" takes AES-GCM where the
  token lists `CKM_AES_GCM` (SoftHSM), else encrypt-then-MAC, which needs only
  `CKM_AES_ECB` and `CKM_SHA256_HMAC` (every token tried: TPM 2.0, opencryptoki, p11-kit).
  A forced seal the token lacks is refused with the mechanisms it needs.
- Key labels. A KEK named L is the AES-256 key labelled L; for encrypt-then-MAC it is a
  pair: L (AES-256) and `L-mac` (`mac_label`: HMAC, a generic-secret or SHA256-HMAC key
  of 256 bits). Blobs name L; the pair is found by label.
- Every KEK half is checked on first use against a table: `KEK_REQUIRED` (+
  `GCM_REQUIRED` for GCM) for the AES key, `MAC_REQUIRED` for the HMAC key. Refused: a key
  that is or ever was able to leave the token (EXTRACTABLE, not SENSITIVE, not
  ALWAYS_SENSITIVE, not NEVER_EXTRACTABLE), usable without login, and one whose usage
  goes beyond what the seal needs (DERIVE, WRAP, UNWRAP, MODIFIABLE; an HMAC key that can
  ENCRYPT/DECRYPT), naming the attribute and why. WARNING: `_kekinit`'s templates
  (`keys init`, rotation: making and destroying KEKs, which the custodian never loads)
  must produce keys the tables accept.
- A PKCS#11 error while opening a blob (SoftHSM reports a bad GCM tag or AAD as a generic
  GeneralError) is reported as `UnsealFailed` by the caller, `_sealed`.
- A handle the token no longer honours (`STALE_HANDLE_ERRORS`: the token was reset, its
  store reloaded, the device re-plugged) is not a fault of the sealed key: the token logs
  in again, finds the active KEK by label, checks it, and retries the one operation once.
  The process's shared session is replaced once per failure generation, so several
  `Token`s sharing it do not each log in again.
- Other processes log in to the same token at the same time (the daemon, a CLI command,
  a backup). SoftHSM 2.6 then sometimes fails a login or a token lookup with
  GeneralError, or lists no such token (`LOGIN_RETRY_ERRORS` says why): a login is tried
  again a bounded number of times, starting the module over first where nothing else in
  the process uses it. Only logins are retried; an operation on a sealed key never is
  (a refusal there stays a refusal, `_sealed`).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import itertools
import logging
import os
import random
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pkcs11
from pkcs11 import Attribute, KeyType, Mechanism, ObjectClass
from pkcs11.mechanisms import GCMParams

from custody._errors import CustodyError
from custody._records import MAX_KEK_LABEL, kek_label_ok
from custody._secret import read_limited
from custody._worker import require_lock

__all__ = [
    "GCM_IV_BYTES",
    "KEK_BITS",
    "MAX_KEK_LABEL",
    "KekRefused",
    "SEAL_CHOICES",
    "STALE_HANDLE_ERRORS",
    "Token",
    "TokenConfig",
    "choose_seal",
    "kek_label_ok",
    "mac_label",
    "require_kek_label",
]

T = TypeVar("T")

log = logging.getLogger("buzz_broker.custody")

#: AES-256 (design.md: one AES-256 KEK per token).
KEK_BITS = 256
#: NIST SP 800-38D's recommended 96-bit GCM IV, random per seal.
GCM_IV_BYTES = 12
GCM_TAG_BITS = 128
#: python-pkcs11's output buffer for a decrypt or a keystream, freed unzeroed: above glibc's
#: per-thread cache (1032 bytes), so `_process`'s M_PERTURB overwrites it as it is freed.
OUTPUT_BUFFER_BYTES = 8192
#: systemd LoadCredential= name the unit uses for the PIN.
CREDENTIAL_NAME = "token-pin"
#: Longest PIN file read. PKCS#11 PINs are short (SoftHSM allows 4-255 bytes); anything
#: longer is the wrong file, refused rather than read into memory.
MAX_PIN_FILE_BYTES = 1024

#: AES key attribute -> value it must have, and why a different value is refused.
KEK_REQUIRED: dict[Attribute, tuple[object, str]] = {
    Attribute.EXTRACTABLE: (False, "EXTRACTABLE is true: the key could leave the token"),
    Attribute.SENSITIVE: (True, "SENSITIVE is false: the key value can be read out"),
    Attribute.ALWAYS_SENSITIVE: (True, "ALWAYS_SENSITIVE is false: the key was once readable"),
    Attribute.NEVER_EXTRACTABLE: (True, "NEVER_EXTRACTABLE is false: the key was once extractable"),
    Attribute.PRIVATE: (True, "PRIVATE is false: the key is usable without login"),
    Attribute.TOKEN: (True, "TOKEN is false: the key is not stored in the token"),
    Attribute.VALUE_LEN: (KEK_BITS // 8, "it is not a 256-bit key"),
    # Usage: the KEK seals and opens agent keys and nothing else. Each other use is a way
    # to get key material out, or to turn the KEK into something that can.
    Attribute.ENCRYPT: (True, "ENCRYPT is false: the key cannot seal agent keys"),
    Attribute.DERIVE: (False, "DERIVE is true: keys derived from it may be extractable"),
    Attribute.WRAP: (False, "WRAP is true: it could wrap other token keys out of the token"),
    Attribute.UNWRAP: (False, "UNWRAP is true: it could unwrap planted keys, or decrypt "
                       "sealed agent keys into token objects"),
    Attribute.MODIFIABLE: (False, "MODIFIABLE is true: its usage attributes could be changed "
                           "after this check"),
}
#: Only AES-GCM decrypts with the KEK; encrypt-then-MAC opens with an encrypted keystream.
GCM_REQUIRED: dict[Attribute, tuple[object, str]] = {
    Attribute.DECRYPT: (True, "DECRYPT is false: the key cannot open sealed agent keys"),
}
MAC_KEY_BITS = 256
#: The HMAC half of an encrypt-then-MAC KEK.
MAC_REQUIRED: dict[Attribute, tuple[object, str]] = {
    Attribute.EXTRACTABLE: KEK_REQUIRED[Attribute.EXTRACTABLE],
    Attribute.SENSITIVE: KEK_REQUIRED[Attribute.SENSITIVE],
    Attribute.ALWAYS_SENSITIVE: KEK_REQUIRED[Attribute.ALWAYS_SENSITIVE],
    Attribute.NEVER_EXTRACTABLE: KEK_REQUIRED[Attribute.NEVER_EXTRACTABLE],
    Attribute.PRIVATE: KEK_REQUIRED[Attribute.PRIVATE],
    Attribute.TOKEN: KEK_REQUIRED[Attribute.TOKEN],
    # HMAC-SHA256's strength is its key's; an operator-made short key was accepted, and
    # only a token that refuses short HMAC keys at the first seal (SoftHSM) failed closed.
    Attribute.VALUE_LEN: (MAC_KEY_BITS // 8, "VALUE_LEN is not 32 bytes: not a 256-bit key"),
    Attribute.SIGN: (True, "SIGN is false: the key cannot compute the seal's HMAC"),
    Attribute.ENCRYPT: (False, "ENCRYPT is true: an HMAC key must not also encrypt"),
    Attribute.DECRYPT: (False, "DECRYPT is true: an HMAC key must not also decrypt"),
    Attribute.DERIVE: KEK_REQUIRED[Attribute.DERIVE],
    Attribute.WRAP: KEK_REQUIRED[Attribute.WRAP],
    Attribute.UNWRAP: KEK_REQUIRED[Attribute.UNWRAP],
    Attribute.MODIFIABLE: KEK_REQUIRED[Attribute.MODIFIABLE],
}
#: Key types an HMAC-SHA256 key has: SoftHSM and opencryptoki use generic secrets,
#: tpm2-pkcs11 its own CKK_SHA256_HMAC.
MAC_KEY_TYPES = (KeyType.GENERIC_SECRET, KeyType.SHA256_HMAC)
AES_KEY_TYPES = (KeyType.AES,)
MAC_LABEL_SUFFIX = "-mac"

#: Seal kind -> the mechanisms it needs in the token.
SEAL_MECHANISMS: dict[str, tuple[Mechanism, ...]] = {
    "gcm": (Mechanism.AES_GCM,),
    "etm": (Mechanism.AES_ECB, Mechanism.SHA256_HMAC),
}
SEAL_DESCRIPTIONS: dict[str, str] = {
    "gcm": "AES-256-GCM, host IV",
    "etm": "encrypt-then-MAC: AES-256-ECB keystream (CTR) + HMAC-SHA256",
}
#: What "auto" takes, first offered first.
SEAL_PREFERENCE = ("gcm", "etm")
SEAL_CHOICES = ("auto", *SEAL_PREFERENCE)

@dataclass(frozen=True, slots=True)
class TokenConfig:
    """Where the token is, and which seal new blobs get. Public: it names the PIN's file,
    never the PIN.

    `kek_label` is the first KEK's label; after `keys rotate` the keystore names the active
    one. `seal` is "auto", "gcm" or "etm" (module docstring).
    """

    module: str
    token_label: str
    pin_file: str | None
    kek_label: str = "buzz-broker-kek"
    seal: str = "auto"

    def __post_init__(self) -> None:  # said where it is written, not at the token's open
        if self.seal not in SEAL_CHOICES:
            raise ValueError(f"seal must be one of {', '.join(SEAL_CHOICES)}, not {self.seal!r}")


class KekRefused(CustodyError):
    """The KEK a blob names is not in the token, or fails its checks (one safe line)."""


#: Errors that mean "this session or object handle is gone", not "this blob is bad".
STALE_HANDLE_ERRORS: tuple[type[Exception], ...] = (
    pkcs11.ObjectHandleInvalid,
    pkcs11.KeyHandleInvalid,
    pkcs11.SessionHandleInvalid,
    pkcs11.SessionClosed,
    pkcs11.UserNotLoggedIn,
    pkcs11.DeviceRemoved,
    pkcs11.TokenNotPresent,
)


# repr=False on the PIN verifier and its key: together they let whoever reads a repr (a
# log line, a debugger, a traceback with locals) test PIN guesses offline. The session is
# hidden too: it is a logged-in handle, and nothing in its repr helps an operator.
@dataclass
class _SharedSession:
    #: None after a failed reconnect: the next operation logs in before it runs.
    session: Any = field(repr=False)
    pin_mac: bytes = field(repr=False)
    users: int = 0
    #: Bumped each time the session is replaced after its handles went stale.
    generation: int = 0


@dataclass
class _ProcessState:
    libs: dict[str, Any] = field(default_factory=dict)
    sessions: dict[tuple[str, str], _SharedSession] = field(default_factory=dict)
    pin_mac_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)


_PROCESS = _ProcessState()


def _read_pin(config: TokenConfig) -> bytearray:
    """The PIN, read into a bytearray the caller zeroes (never a `bytes` or `str` copy here).

    The file is opened once, O_NOFOLLOW (a symlink is refused: the checks below must be
    about the file that is read, and a link could be re-pointed after them), O_NONBLOCK (a
    FIFO put in its place cannot hang the token worker) and O_CLOEXEC; the checks are made
    on the open descriptor with fstat and the bytes read from that descriptor, so nothing
    can swap the file between check and read. The rules:
    - a regular file;
    - no group or other permission bits (chmod 600 or 400);
    - owned by this process's effective uid or by root. Another user who owns the file can
      read or rewrite the PIN whatever its mode says; root can do that to any file anyway,
      so a root-owned file adds no one (a process with CAP_DAC_READ_SEARCH may read it).
    systemd's LoadCredential= file passes: on its ramfs credentials directory systemd
    chowns the file to the service user, mode 0400. Where it grants access with a POSIX ACL
    instead (a tmpfs fallback), the ACL mask shows as group bits and the file is refused
    as readable by group: a known limit (reading the ACL itself is not done here).
    """
    if config.pin_file is not None:
        path = Path(config.pin_file)
        source = f"PIN file {path}"
    else:
        credentials = os.environ.get("CREDENTIALS_DIRECTORY")
        if not credentials:
            raise CustodyError(
                "no token PIN: set pkcs11.pin_file, or pass the systemd credential "
                f"'{CREDENTIAL_NAME}' (LoadCredential=)"
            )
        path = Path(credentials) / CREDENTIAL_NAME
        source = f"systemd credential {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CustodyError(
                f"{source} is a symbolic link; point the configuration at the file itself"
            ) from None
        raise CustodyError(f"cannot read {source}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CustodyError(f"{source} is not a regular file")
        if st.st_mode & 0o077:
            raise CustodyError(
                f"{source} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                "chmod 600 it"
            )
        if st.st_uid not in (os.geteuid(), 0):
            raise CustodyError(
                f"{source} is owned by uid {st.st_uid}, not by this process's user "
                f"(uid {os.geteuid()}) or root; chown it"
            )
        pin = _read_fd(fd, source)
    except OSError as exc:
        raise CustodyError(f"cannot read {source}: {exc.strerror}") from None
    finally:
        os.close(fd)
    while pin and pin[-1] in (0x0A, 0x0D):
        pin.pop()
    if not pin:
        raise CustodyError(f"{source} is empty")
    return pin


def _read_fd(fd: int, source: str) -> bytearray:
    """At most MAX_PIN_FILE_BYTES from `fd`, read straight into one bytearray."""
    buf = read_limited(fd, MAX_PIN_FILE_BYTES)
    if buf is None:
        raise CustodyError(f"{source} is longer than {MAX_PIN_FILE_BYTES} bytes: not a PIN")
    return buf


def _load_lib(module: str) -> Any:
    key = os.path.realpath(module)
    lib = _PROCESS.libs.get(key)
    if lib is None:
        if not os.path.isfile(key):
            raise CustodyError(f"PKCS#11 module {module} does not exist")
        try:
            lib = pkcs11.lib(key)
        except pkcs11.PKCS11Error as exc:
            raise CustodyError(f"cannot load PKCS#11 module {module}: {exc}") from None
        _PROCESS.libs[key] = lib
    return lib


#: What a login retries (`_login`): SoftHSM 2.6's answers in a process that read its token
#: file while another process was rewriting it. Every C_Login rewrites that file (the
#: PIN-retry flags), and SoftHSM releases the file's lock before the rewrite reaches the
#: disk; a reader then sees it empty or cut short and answers GeneralError
#: (C_GetTokenInfo, C_Login), or, if it was C_Initialize that read it, lists no such
#: token, or a token whose user PIN is not initialized (the flags word read torn: seen
#: once in a fresh-clone CI run, one process of three failing every one of its 60 opens
#: with it, its view of the token stuck until the module starts over). The failed read
#: can also mark the token invalid in that process for good (only C_Finalize clears it),
#: so plain retries are not always enough. Shown by
#: tests/custody/test_concurrent_processes.py. A token whose user PIN truly is not set
#: is reported after the last attempt, about 0.6 s later. Never retried: a wrong or
#: locked PIN (a token may count failed logins), or two tokens under one label.
LOGIN_RETRY_ERRORS: tuple[type[Exception], ...] = (
    pkcs11.GeneralError, pkcs11.NoSuchToken, pkcs11.UserPinNotInitialized,
    *STALE_HANDLE_ERRORS,
)
#: Attempts at a login. The race lasts microseconds, but processes that queue behind one
#: login's file lock all wake into it, so under heavy login traffic a few attempts in a row
#: can fail. The pauses between attempts are random (processes that collided once do not
#: collide again in step), doubling from LOGIN_PAUSE_SECONDS up to LOGIN_PAUSE_CAP_SECONDS:
#: at most about 0.6 s in all before the last attempt's error is reported.
LOGIN_ATTEMPTS = 12
LOGIN_PAUSE_SECONDS = 0.002
LOGIN_PAUSE_CAP_SECONDS = 0.1
#: From this attempt on the module is started over first (where allowed): a plain retry
#: clears a torn read, but not a token SoftHSM has marked invalid for the process; and a
#: fresh C_Initialize reads the whole store, so it is the slower cure, not the first one.
LOGIN_RESTART_FROM = 3


def _login_fault(exc: Exception, config: TokenConfig) -> CustodyError:
    """The one line the operator reads for a login that failed with `exc`."""
    label = config.token_label
    if isinstance(exc, pkcs11.NoSuchToken):
        return CustodyError(f"no token labelled {label!r} in PKCS#11 module {config.module}")
    if isinstance(exc, pkcs11.MultipleTokensReturned):
        return CustodyError(f"more than one token labelled {label!r} in {config.module}")
    if isinstance(exc, pkcs11.PinIncorrect):
        return CustodyError(f"token {label!r}: login failed, wrong PIN")
    if isinstance(exc, pkcs11.PinLocked):
        return CustodyError(f"token {label!r}: the user PIN is locked")
    if isinstance(exc, LOGIN_RETRY_ERRORS):  # still failing after the last attempt
        return CustodyError(f"token {label!r} is not available ({type(exc).__name__})")
    return CustodyError(f"token {label!r}: login failed ({type(exc).__name__})")


def _restart_module(lib: Any) -> None:
    """C_Finalize and C_Initialize `lib`: every handle the process holds in it dies."""
    try:
        if lib.initialized:
            lib.finalize()
    except pkcs11.PKCS11Error:
        pass  # finalising a module that already lost its state: nothing to keep
    try:
        lib.initialize()
    except pkcs11.PKCS11Error:
        pass  # the next attempt initializes again, and says what is wrong


def _login(config: TokenConfig, pin: bytearray, *, may_restart: bool) -> Any:
    """Find the token by label and open a logged-in read-write session on it.

    A failure in LOGIN_RETRY_ERRORS is tried again, up to LOGIN_ATTEMPTS times; from
    attempt LOGIN_RESTART_FROM on, the module is started over first if `may_restart` (the
    caller holds no handle in it that must survive). Other failures are reported at once.

    Raises:
        CustodyError: no such token, two under one label, a wrong, locked or non-UTF-8 PIN,
            or a token still failing after the last attempt (named by its error).
    """
    lib = _load_lib(config.module)
    try:
        # python-pkcs11 takes the PIN as str: the one unavoidable immutable copy of it.
        text = pin.decode("utf-8")
    except UnicodeDecodeError:
        raise CustodyError("the token PIN is not UTF-8 text") from None
    pause = LOGIN_PAUSE_SECONDS
    for attempt in range(1, LOGIN_ATTEMPTS + 1):
        try:
            if not lib.initialized:  # a restart whose C_Initialize failed (the store was away)
                lib.initialize()
            return lib.get_token(token_label=config.token_label).open(rw=True, user_pin=text)
        except LOGIN_RETRY_ERRORS as exc:
            if attempt == LOGIN_ATTEMPTS:
                raise _login_fault(exc, config) from None
            log.info("token %r: login attempt %d failed (%s); trying again",
                     config.token_label, attempt, type(exc).__name__)
        except pkcs11.PKCS11Error as exc:
            raise _login_fault(exc, config) from None
        time.sleep(random.uniform(pause / 2, pause))
        pause = min(2 * pause, LOGIN_PAUSE_CAP_SECONDS)
        if may_restart and attempt + 1 >= LOGIN_RESTART_FROM:
            _restart_module(lib)
    raise AssertionError("unreachable")


def _acquire_session(config: TokenConfig) -> tuple[tuple[str, str], _SharedSession]:
    require_lock()
    _load_lib(config.module)  # a missing module is said before the PIN is read
    key = (os.path.realpath(config.module), config.token_label)
    pin = _read_pin(config)
    try:
        pin_mac = hmac.digest(_PROCESS.pin_mac_key, pin, hashlib.sha256)
        shared = _PROCESS.sessions.get(key)
        if shared is None:
            # The module may start over only while no other token's session lives in it.
            alone = all(module != key[0] for module, _ in _PROCESS.sessions)
            shared = _SharedSession(session=_login(config, pin, may_restart=alone),
                                    pin_mac=pin_mac)
            _PROCESS.sessions[key] = shared
        elif not hmac.compare_digest(shared.pin_mac, pin_mac):
            raise CustodyError(f"token {config.token_label!r}: login failed, wrong PIN")
    finally:
        pin[:] = bytes(len(pin))
    shared.users += 1
    return key, shared


def _release_session(key: tuple[str, str]) -> None:
    require_lock()
    shared = _PROCESS.sessions[key]
    shared.users -= 1
    if shared.users == 0:
        del _PROCESS.sessions[key]
        if shared.session is None:
            return  # lost with the token; nothing is logged in
        try:
            shared.session.close()  # logs out: only now that no Token uses it
        except pkcs11.PKCS11Error as exc:
            log.warning("closing the token session failed (%s)", type(exc).__name__)


def _find_key(session: Any, token_label: str, label: str,
              key_types: tuple[Any, ...]) -> Any | None:
    """The one secret key labelled `label` of one of `key_types`, None if there is none.

    Typed, always: an encrypt-then-MAC KEK `K`'s HMAC half is `K-mac`, and an AES KEK may
    be labelled `K-mac` too (rotating to that label): an untyped lookup found the new
    KEK's AES key as the old one's HMAC half, and destroying the old KEK destroyed it.

    Not `session.get_key`: it raises MultipleObjectsReturned from inside an object search it
    leaves open, and the search (C_FindObjectsFinal, and the session's operation lock) is
    then finished by the garbage collector on whatever thread drops it, outside the token
    lock. Here at most two objects are taken and each search generator is closed in
    `finally`, on this thread, holding the lock.
    """
    found: list[Any] = []
    for key_type in key_types:
        search = session.get_objects({Attribute.CLASS: ObjectClass.SECRET_KEY,
                                      Attribute.LABEL: label, Attribute.KEY_TYPE: key_type})
        try:
            found.extend(itertools.islice(search, 2))
        finally:
            search.close()  # GeneratorExit inside the search: C_FindObjectsFinal runs now
    if len(found) > 1:
        raise CustodyError(f"token {token_label!r} has more than one key labelled {label!r}")
    return found[0] if found else None


def _check_key(key: Any, what: str, label: str,
               required: dict[Attribute, tuple[object, str]]) -> None:
    for attribute, (wanted, fault) in required.items():
        try:
            value = key[attribute]
        except pkcs11.PKCS11Error:
            value = None
        if value != wanted:
            raise CustodyError(f"refusing {what} {label!r}: {fault}")


def require_kek_label(label: str) -> None:
    """Refuse a label no blob could name (CustodyError)."""
    if not kek_label_ok(label):
        raise CustodyError(f"KEK label {label!r} must be 1-{MAX_KEK_LABEL} printable ASCII "
                           "characters: every sealed key names it")


def mac_label(kek_label: str) -> str:
    """The HMAC key's label for the encrypt-then-MAC KEK pair named `kek_label`."""
    return kek_label + MAC_LABEL_SUFFIX


def _offered_seals(session: Any) -> frozenset[str]:
    """Seal kinds whose mechanisms the token lists (SEAL_MECHANISMS)."""
    try:
        mechanisms = set(session.token.slot.get_mechanisms())
    except pkcs11.PKCS11Error:
        mechanisms = set()
    return frozenset(kind for kind, needed in SEAL_MECHANISMS.items()
                     if all(m in mechanisms for m in needed))


def choose_seal(wanted: str, offered: frozenset[str], token_label: str) -> str:
    """The seal new blobs get: `wanted` ("auto", "gcm" or "etm") against what the token offers.

    "auto" takes AES-GCM only where the token lists it, else encrypt-then-MAC. A seal the
    operator forced and the token lacks is refused, never replaced by another.
    """
    if wanted not in SEAL_CHOICES:
        raise CustodyError(f"unknown seal {wanted!r}; use one of {', '.join(SEAL_CHOICES)}")
    if wanted == "auto":
        for kind in SEAL_PREFERENCE:
            if kind in offered:
                return kind
        raise CustodyError(
            f"token {token_label!r} offers neither AES-GCM nor AES-ECB with SHA256-HMAC; "
            "it cannot seal agent keys"
        )
    if wanted not in offered:
        raise CustodyError(
            f"token {token_label!r} does not offer the mechanisms of seal {wanted!r} "
            f"({SEAL_DESCRIPTIONS[wanted]})"
        )
    return wanted


@dataclass
class _Kek:
    """One KEK's object handles: the AES key, and (encrypt-then-MAC) its HMAC partner."""

    aes: Any = field(repr=False)
    mac: Any = field(repr=False, default=None)


def _load_kek(session: Any, config: TokenConfig, label: str, seal: str) -> _Kek | None:
    """The KEK pair `label` as `seal` needs it, checked; None if its AES key is absent.

    Raises:
        CustodyError: a key that fails its attribute checks, a twin under one label, or an
            encrypt-then-MAC KEK without its HMAC key.
    """
    aes = _find_key(session, config.token_label, label, AES_KEY_TYPES)
    if aes is None:
        return None
    _check_key(aes, "KEK", label, KEK_REQUIRED)
    if seal == "gcm":
        _check_key(aes, "KEK", label, GCM_REQUIRED)
        return _Kek(aes)
    mac = _find_key(session, config.token_label, mac_label(label), MAC_KEY_TYPES)
    if mac is None:
        raise CustodyError(
            f"token {config.token_label!r} has the AES key {label!r} but not its HMAC key "
            f"{mac_label(label)!r}; run `buzz-broker keys init`"
        )
    _check_key(mac, "KEK HMAC key", mac_label(label), MAC_REQUIRED)
    return _Kek(aes, mac)


def _use_handles(kek: _Kek) -> None:
    """One attribute read through each KEK handle (`Token.check`): the call is the check;
    the value was checked when the handle was found, and MODIFIABLE false keeps it so."""
    for half in (kek.aes, kek.mac):
        if half is not None:
            half[Attribute.SENSITIVE]


class Token:
    """An open token: the seal mechanisms of its KEKs, by label.

    `active` is the KEK new blobs are sealed under and `seal` the seal kind they get;
    blobs name their own KEK, so others in the same token are found (and checked) on use.
    Create with `Token.open` inside the token worker; call every method there too.
    """

    __slots__ = ("_config", "_key", "_keks", "_closed", "_generation", "active", "seal")

    def __init__(self, config: TokenConfig, key: tuple[str, str], active: str, seal: str,
                 kek: _Kek, generation: int = 0) -> None:
        self._config = config
        self._key = key
        self._keks: dict[tuple[str, str], _Kek] = {(active, seal): kek}
        self._closed = False
        self._generation = generation
        self.active = active
        self.seal = seal

    @property
    def legacy_kek(self) -> str:
        """The KEK a format-1 blob (no KEK name in it) was sealed under: the configured one."""
        return self._config.kek_label

    @classmethod
    def open(cls, config: TokenConfig, kek_label: str | None = None) -> Token:
        """Log in (or join the process's session), choose the seal, find and check the KEK.

        `kek_label` names the active KEK when it is not the configured one (after a
        rotation, the keystore records it).

        Raises:
            CustodyError: missing module or token, PIN problems, no KEK (run `keys init`),
                a KEK that could leave the token, or a seal the token does not offer.
        """
        label = kek_label or config.kek_label
        require_kek_label(label)
        key, shared = _acquire_session(config)
        try:
            seal = choose_seal(config.seal, _offered_seals(shared.session), config.token_label)
            kek = _load_kek(shared.session, config, label, seal)
            if kek is None:
                raise CustodyError(
                    f"token {config.token_label!r} has no key-encryption key labelled "
                    f"{label!r}; run `buzz-broker keys init`"
                )
        except BaseException:
            _release_session(key)
            raise
        return cls(config, key, label, seal, kek, shared.generation)

    # --- the mechanisms `_sealed` builds its seals from ---------------------------------

    def gcm_encrypt(self, label: str, iv: bytes, plaintext: bytearray, aad: bytes) -> bytes:
        """AES-256-GCM under KEK `label`: ciphertext || 128-bit tag."""
        require_lock()
        # `_encrypt` (not `encrypt`): the public method only accepts `bytes` for one-shot
        # data, which would make an immutable copy of the secret; the Cython method takes
        # any buffer and passes its pointer to C_Encrypt.
        sealed: bytes = self._retrying_once(label, "gcm", lambda kek: kek.aes._encrypt(
            plaintext, mechanism=Mechanism.AES_GCM,
            mechanism_param=GCMParams(iv, aad, GCM_TAG_BITS),
        ))
        return sealed

    def gcm_decrypt(self, label: str, iv: bytes, sealed: bytes, aad: bytes) -> bytes:
        """Authenticate and decrypt in the token; the caller wipes the plaintext."""
        require_lock()
        plaintext: bytes = self._retrying_once(label, "gcm", lambda kek: kek.aes.decrypt(
            sealed, mechanism=Mechanism.AES_GCM,
            mechanism_param=GCMParams(iv, aad, GCM_TAG_BITS), buffer_size=OUTPUT_BUFFER_BYTES,
        ))
        return plaintext

    def keystream(self, label: str, counter_blocks: bytes) -> bytes:
        """AES-256-ECB of `counter_blocks` under KEK `label`; the caller wipes the result."""
        require_lock()
        stream: bytes = self._retrying_once(label, "etm", lambda kek: kek.aes.encrypt(
            counter_blocks, mechanism=Mechanism.AES_ECB, buffer_size=OUTPUT_BUFFER_BYTES))
        return stream

    def mac(self, label: str, data: bytes) -> bytes:
        """HMAC-SHA256 of `data` under KEK `label`'s HMAC key."""
        require_lock()
        tag: bytes = self._retrying_once(label, "etm", lambda kek: kek.mac.sign(
            data, mechanism=Mechanism.SHA256_HMAC))
        return tag

    # --- handles -------------------------------------------------------------------------

    def _session(self) -> _SharedSession:
        shared = _PROCESS.sessions[self._key]
        if shared.session is None or shared.generation != self._generation:
            self._reconnect()
        return shared

    def _kek(self, label: str, seal: str) -> _Kek:
        """KEK `label` for `seal`, found and checked on first use.

        Raises:
            KekRefused: absent, or fails its checks. `_sealed` reports that as the
                "kek" defence.
        """
        kek = self._keks.get((label, seal))
        if kek is None:
            session = self._session().session
            try:
                found = _load_kek(session, self._config, label, seal)
            except CustodyError as exc:
                raise KekRefused(str(exc)) from None
            if found is None:
                raise KekRefused(
                    f"token {self._config.token_label!r} has no key labelled {label!r}"
                )
            self._keks[(label, seal)] = kek = found
        return kek

    def _retrying_once(self, label: str, seal: str, operation: Callable[[_Kek], T]) -> T:
        """Run `operation(kek)`; after a stale handle, log in again and run it once more.

        A session already known to be dead (an earlier reconnect failed, or another
        `Token` replaced it) is reconnected before the operation instead of after.
        """
        self._check_open()
        shared = _PROCESS.sessions[self._key]
        if shared.session is None or shared.generation != self._generation:
            self._reconnect()
        kek = self._kek(label, seal)
        try:
            return operation(kek)
        except STALE_HANDLE_ERRORS as exc:
            log.warning("token %r: %s; logging in again", self._config.token_label,
                        type(exc).__name__)
            self._reconnect()
        return operation(self._kek(label, seal))

    def _reconnect(self) -> None:
        """Replace the process's session (once per generation) and find the active KEK again.

        Other KEKs are found again on their next use.

        Raises:
            CustodyError: the token is still not there, the PIN no longer works, or the
                KEK is gone or no longer safe. The message names which; the next call
                tries again.
        """
        shared = _PROCESS.sessions[self._key]
        # Another `Token` of the process may have logged in again for this generation:
        # then only the KEK is found again here, and the journal says one login.
        logs_in = shared.session is None or shared.generation == self._generation
        if logs_in:
            # The old session's handle is dead: closing it would only raise. Log in anew.
            shared.session = None
            pin = _read_pin(self._config)
            try:
                # Every handle is stale already: starting the module over loses nothing,
                # and SoftHSM, after its token store vanished and came back, answers
                # GeneralError until it is.
                shared.session = _login(self._config, pin, may_restart=True)
                # The PIN read now is the session's (the file may hold a changed one): the
                # next `Token.open` in the process is held to it, not to the one it replaced.
                shared.pin_mac = hmac.digest(_PROCESS.pin_mac_key, pin, hashlib.sha256)
            finally:
                pin[:] = bytes(len(pin))
            shared.generation += 1
        kek = _load_kek(shared.session, self._config, self.active, self.seal)
        if kek is None:
            raise CustodyError(
                f"token {self._config.token_label!r} no longer has the key-encryption key "
                f"{self.active!r}"
            )
        self._keks = {(self.active, self.seal): kek}
        self._generation = shared.generation
        if logs_in:
            log.warning("token %r: logged in again; KEK found and checked",
                        self._config.token_label)

    def check(self) -> str:
        """Does the token work now? The active KEK's handles are used as a seal uses them
        (`_retrying_once`: stale handles log in again first), by an attribute read: the
        cheapest call needing the login and the handle, which SoftHSM answers
        ObjectHandleInvalid once its files are gone or unreadable (a search by label
        answers "none"). No key material, nothing written. Returns the KEK's label.

        Raises:
            CustodyError: what the next seal would meet (no token, the PIN refused, the
                KEK gone), or the token's error's name.
        """
        require_lock()
        try:
            self._retrying_once(self.active, self.seal, _use_handles)
        except pkcs11.PKCS11Error as exc:
            raise CustodyError(f"token {self._config.token_label!r} refused a call on KEK "
                               f"{self.active!r} ({type(exc).__name__})") from None
        return self.active

    def close(self) -> None:
        require_lock()
        if not self._closed:
            self._closed = True
            self._keks.clear()
            _release_session(self._key)

    def _check_open(self) -> None:
        if self._closed:
            raise CustodyError("the token has been closed")

    def __repr__(self) -> str:
        return (f"Token(label={self._config.token_label!r}, kek={self.active!r}, "
                f"seal={self.seal!r})")
