"""The PKCS#11 token: module, login, the key-encryption key (KEK), AES-GCM seal and open.

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
- The KEK is AES-256, generated in the token: SENSITIVE, not EXTRACTABLE, PRIVATE, TOKEN,
  labelled, encrypt/decrypt only (no derive/wrap/unwrap, not modifiable). `check_kek`
  (table `KEK_REQUIRED`) refuses a key that is or ever was able to leave the token
  (EXTRACTABLE, not SENSITIVE, not ALWAYS_SENSITIVE, not NEVER_EXTRACTABLE) and one whose
  usage goes beyond encrypt/decrypt (DERIVE, WRAP, UNWRAP, MODIFIABLE), naming the
  attribute and why. WARNING: `KEK_TEMPLATE` must produce a key `KEK_REQUIRED` accepts.
- A PKCS#11 error while decrypting (SoftHSM reports a bad GCM tag or AAD as a generic
  GeneralError) is reported as `UnsealFailed` by the caller, `_sealed`.
- A handle the token no longer honours (`STALE_HANDLE_ERRORS`: the token was reset, its
  store reloaded, the device re-plugged) is not a fault of the sealed key: the token logs
  in again, finds the KEK by label, checks it, and retries the one operation once. The
  process's shared session is replaced once per failure generation, so several `Token`s
  sharing it do not each log in again.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pkcs11
from coincurve._libsecp256k1 import ffi
from pkcs11 import Attribute, KeyType, Mechanism, MechanismFlag, ObjectClass
from pkcs11.mechanisms import GCMParams

from custody._errors import CustodyError
from custody._secret import SECRET_SIZE, Secret, wipe_bytes
from custody._worker import require_lock

__all__ = ["TokenConfig", "Token", "KEK_BITS", "GCM_IV_BYTES", "STALE_HANDLE_ERRORS"]

T = TypeVar("T")

log = logging.getLogger("buzz_broker.custody")

#: AES-256 (design.md: one AES-256 KEK per token).
KEK_BITS = 256
#: NIST SP 800-38D's recommended 96-bit GCM IV, random per seal.
GCM_IV_BYTES = 12
GCM_TAG_BITS = 128
#: systemd LoadCredential= name the unit uses for the PIN.
CREDENTIAL_NAME = "token-pin"
#: Longest PIN file read. PKCS#11 PINs are short (SoftHSM allows 4-255 bytes); anything
#: longer is the wrong file, refused rather than read into memory.
MAX_PIN_FILE_BYTES = 1024

#: KEK attribute -> value it must have, and why a different value is refused.
KEK_REQUIRED: dict[Attribute, tuple[object, str]] = {
    Attribute.EXTRACTABLE: (False, "EXTRACTABLE is true: the key could leave the token"),
    Attribute.SENSITIVE: (True, "SENSITIVE is false: the key value can be read out"),
    Attribute.ALWAYS_SENSITIVE: (True, "ALWAYS_SENSITIVE is false: the key was once readable"),
    Attribute.NEVER_EXTRACTABLE: (True, "NEVER_EXTRACTABLE is false: the key was once extractable"),
    Attribute.PRIVATE: (True, "PRIVATE is false: the key is usable without login"),
    Attribute.TOKEN: (True, "TOKEN is false: the key is not stored in the token"),
    Attribute.VALUE_LEN: (KEK_BITS // 8, "it is not a 256-bit key"),
    # Usage: the KEK seals and opens agent keys with AES-GCM and nothing else. Each other
    # use is a way to get key material out, or to turn the KEK into something that can.
    Attribute.ENCRYPT: (True, "ENCRYPT is false: the key cannot seal agent keys"),
    Attribute.DECRYPT: (True, "DECRYPT is false: the key cannot open sealed agent keys"),
    Attribute.DERIVE: (False, "DERIVE is true: keys derived from it may be extractable"),
    Attribute.WRAP: (False, "WRAP is true: it could wrap other token keys out of the token"),
    Attribute.UNWRAP: (False, "UNWRAP is true: it could unwrap planted keys, or decrypt "
                       "sealed agent keys into token objects"),
    Attribute.MODIFIABLE: (False, "MODIFIABLE is true: its usage attributes could be changed "
                           "after this check"),
}

#: The template `init_kek` generates with (in addition to label, store and AES-256).
KEK_TEMPLATE: dict[Attribute, Any] = {
    Attribute.SENSITIVE: True,
    Attribute.EXTRACTABLE: False,
    Attribute.PRIVATE: True,
    Attribute.WRAP: False,
    Attribute.UNWRAP: False,
    Attribute.DERIVE: False,  # the PKCS#11 default, stated: KEK_REQUIRED refuses true
    Attribute.MODIFIABLE: False,
}


@dataclass(frozen=True, slots=True)
class TokenConfig:
    """Where the token is. Public: it names the PIN's file, never the PIN."""

    module: str
    token_label: str
    pin_file: str | None
    kek_label: str = "buzz-broker-kek"


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
    buf = bytearray(MAX_PIN_FILE_BYTES + 1)
    filled = 0
    while filled < len(buf):
        with memoryview(buf) as whole, whole[filled:] as chunk:
            got = os.readv(fd, [chunk])
        if got == 0:
            break
        filled += got
    if filled > MAX_PIN_FILE_BYTES:
        buf[:] = bytes(len(buf))
        raise CustodyError(f"{source} is longer than {MAX_PIN_FILE_BYTES} bytes: not a PIN")
    # Zero the unused tail before cutting it off (del keeps the bytes in this one object).
    buf[filled:] = bytes(len(buf) - filled)
    del buf[filled:]
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


def _find_token(lib: Any, config: TokenConfig) -> Any:
    try:
        return lib.get_token(token_label=config.token_label)
    except pkcs11.NoSuchToken:
        raise CustodyError(
            f"no token labelled {config.token_label!r} in PKCS#11 module {config.module}"
        ) from None
    except pkcs11.MultipleTokensReturned:
        raise CustodyError(
            f"more than one token labelled {config.token_label!r} in {config.module}"
        ) from None


def _login(token: Any, config: TokenConfig, pin: bytearray) -> Any:
    try:
        # python-pkcs11 takes the PIN as str: the one unavoidable immutable copy of it.
        return token.open(rw=True, user_pin=pin.decode("utf-8"))
    except UnicodeDecodeError:
        raise CustodyError("the token PIN is not UTF-8 text") from None
    except pkcs11.PinIncorrect:
        raise CustodyError(f"token {config.token_label!r}: login failed, wrong PIN") from None
    except pkcs11.PinLocked:
        raise CustodyError(f"token {config.token_label!r}: the user PIN is locked") from None
    except pkcs11.PKCS11Error as exc:
        raise CustodyError(
            f"token {config.token_label!r}: login failed ({type(exc).__name__})"
        ) from None


def _acquire_session(config: TokenConfig) -> tuple[tuple[str, str], _SharedSession]:
    require_lock()
    lib = _load_lib(config.module)
    key = (os.path.realpath(config.module), config.token_label)
    pin = _read_pin(config)
    try:
        pin_mac = hmac.digest(_PROCESS.pin_mac_key, pin, hashlib.sha256)
        shared = _PROCESS.sessions.get(key)
        if shared is None:
            token = _find_token(lib, config)
            shared = _SharedSession(session=_login(token, config, pin), pin_mac=pin_mac)
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


def _find_token_afresh(config: TokenConfig) -> Any:
    """The token, after every handle in the process went stale.

    The module's view of its slots may have gone stale with the handles (SoftHSM, after its
    token store vanished and came back, answers GeneralError until it is initialised
    again), so on failure the module is started over: with every handle stale already,
    that loses nothing.
    """
    lib = _load_lib(config.module)
    try:
        return _find_token(lib, config)
    except pkcs11.PKCS11Error:
        pass
    try:
        if lib.initialized:
            lib.finalize()
    except pkcs11.PKCS11Error:
        pass  # finalising a module that already lost its state: nothing to keep
    try:
        lib.initialize()
        return _find_token(lib, config)
    except pkcs11.PKCS11Error as exc:
        raise CustodyError(
            f"token {config.token_label!r} is not available ({type(exc).__name__})"
        ) from None


def _find_kek(session: Any, config: TokenConfig) -> Any | None:
    """The one AES secret key labelled `kek_label`, None if there is none.

    Not `session.get_key`: it raises MultipleObjectsReturned from inside an object search it
    leaves open, and the search (C_FindObjectsFinal, and the session's operation lock) is
    then finished by the garbage collector on whatever thread drops it, outside the token
    lock. Here at most two objects are taken and the search generator is closed in
    `finally`, on this thread, holding the lock.
    """
    search = session.get_objects({
        Attribute.CLASS: ObjectClass.SECRET_KEY,
        Attribute.KEY_TYPE: KeyType.AES,
        Attribute.LABEL: config.kek_label,
    })
    try:
        found = list(itertools.islice(search, 2))
    finally:
        search.close()  # GeneratorExit inside the search: C_FindObjectsFinal runs now
    if len(found) > 1:
        raise CustodyError(
            f"token {config.token_label!r} has more than one key labelled {config.kek_label!r}"
        )
    return found[0] if found else None


def _check_kek(kek: Any, config: TokenConfig) -> None:
    for attribute, (required, fault) in KEK_REQUIRED.items():
        try:
            value = kek[attribute]
        except pkcs11.PKCS11Error:
            value = None
        if value != required:
            raise CustodyError(f"refusing KEK {config.kek_label!r}: {fault}")


class Token:
    """An open token with its KEK: seal and open 32-byte secrets with AES-256-GCM.

    Create with `Token.open` inside the token worker; call every method there too.
    """

    __slots__ = ("_config", "_key", "_kek", "_closed", "_generation")

    def __init__(self, config: TokenConfig, key: tuple[str, str], kek: Any,
                 generation: int = 0) -> None:
        self._config = config
        self._key = key
        self._kek = kek
        self._closed = False
        self._generation = generation

    @classmethod
    def open(cls, config: TokenConfig) -> Token:
        """Log in (or join the process's session) and find and check the KEK.

        Raises:
            CustodyError: missing module or token, PIN problems, no KEK (run `keys init`),
                or a KEK that could leave the token.
        """
        key, shared = _acquire_session(config)
        try:
            kek = _find_kek(shared.session, config)
            if kek is None:
                raise CustodyError(
                    f"token {config.token_label!r} has no key-encryption key labelled "
                    f"{config.kek_label!r}; run `buzz-broker keys init`"
                )
            _check_kek(kek, config)
        except BaseException:
            _release_session(key)
            raise
        return cls(config, key, kek, shared.generation)

    @staticmethod
    def init_kek(config: TokenConfig) -> bool:
        """Create the KEK if absent, else check it. Returns True if it was created.

        Raises:
            CustodyError: as `open`, or the token refused to generate the key.
        """
        key, shared = _acquire_session(config)
        try:
            kek = _find_kek(shared.session, config)
            if kek is not None:
                _check_kek(kek, config)
                return False
            try:
                kek = shared.session.generate_key(
                    KeyType.AES,
                    KEK_BITS,
                    label=config.kek_label,
                    store=True,
                    capabilities=MechanismFlag.ENCRYPT | MechanismFlag.DECRYPT,
                    template=KEK_TEMPLATE,
                )
            except pkcs11.PKCS11Error as exc:
                raise CustodyError(
                    f"token {config.token_label!r} refused to generate the KEK "
                    f"({type(exc).__name__})"
                ) from None
            _check_kek(kek, config)
            log.info("created KEK %r in token %r", config.kek_label, config.token_label)
            return True
        finally:
            _release_session(key)

    def seal(self, secret: Secret, aad: bytes) -> tuple[bytes, bytes]:
        """AES-256-GCM under the KEK with a fresh random IV. Returns (iv, ciphertext||tag)."""
        require_lock()
        self._check_open()
        iv = secrets.token_bytes(GCM_IV_BYTES)
        # A bytearray we zero afterwards: python-pkcs11 needs bytes/bytearray, not a C buffer.
        plaintext = bytearray(SECRET_SIZE)
        try:
            ffi.memmove(plaintext, secret.cdata, SECRET_SIZE)
            # `_encrypt` (not `encrypt`): the public method only accepts `bytes` for
            # one-shot data, which would make an immutable copy of the secret; the Cython
            # method takes any buffer and passes its pointer to C_Encrypt.
            sealed: bytes = self._retrying_once(lambda kek: kek._encrypt(
                plaintext,
                mechanism=Mechanism.AES_GCM,
                mechanism_param=GCMParams(iv, aad, GCM_TAG_BITS),
            ))
        except pkcs11.PKCS11Error as exc:
            raise CustodyError(f"token refused to seal ({type(exc).__name__})") from None
        finally:
            ffi.memmove(plaintext, bytes(SECRET_SIZE), SECRET_SIZE)
        return iv, sealed

    def open_sealed(self, iv: bytes, sealed: bytes, aad: bytes) -> Secret:
        """Decrypt and authenticate. Raises pkcs11.PKCS11Error on any failure (the caller
        maps every one to UnsealFailed)."""
        require_lock()
        self._check_open()
        plaintext: bytes = self._retrying_once(lambda kek: kek.decrypt(
            sealed, mechanism=Mechanism.AES_GCM, mechanism_param=GCMParams(iv, aad, GCM_TAG_BITS)
        ))
        secret = Secret()
        try:
            if len(plaintext) != SECRET_SIZE:
                raise pkcs11.GeneralError("sealed payload has the wrong length")
            ffi.memmove(secret.cdata, plaintext, SECRET_SIZE)
            return secret
        except BaseException:
            secret.wipe()
            raise
        finally:
            wipe_bytes(plaintext)

    def _retrying_once(self, operation: Callable[[Any], T]) -> T:
        """Run `operation(kek)`; after a stale handle, log in again and run it once more.

        A session already known to be dead (an earlier reconnect failed, or another
        `Token` replaced it) is reconnected before the operation instead of after.
        """
        shared = _PROCESS.sessions[self._key]
        if shared.session is None or shared.generation != self._generation:
            self._reconnect()
        try:
            return operation(self._kek)
        except STALE_HANDLE_ERRORS as exc:
            log.warning("token %r: %s; logging in again", self._config.token_label,
                        type(exc).__name__)
            self._reconnect()
        return operation(self._kek)

    def _reconnect(self) -> None:
        """Replace the process's session (once per generation) and find the KEK again.

        Raises:
            CustodyError: the token is still not there, the PIN no longer works, or the
                KEK is gone or no longer safe. The message names which; the next call
                tries again.
        """
        shared = _PROCESS.sessions[self._key]
        if shared.session is None or shared.generation == self._generation:
            # The old session's handle is dead: closing it would only raise. Log in anew.
            shared.session = None
            token = _find_token_afresh(self._config)
            pin = _read_pin(self._config)
            try:
                shared.session = _login(token, self._config, pin)
            finally:
                pin[:] = bytes(len(pin))
            shared.generation += 1
        kek = _find_kek(shared.session, self._config)
        if kek is None:
            raise CustodyError(
                f"token {self._config.token_label!r} no longer has the key-encryption key "
                f"{self._config.kek_label!r}"
            )
        _check_kek(kek, self._config)
        self._kek = kek
        self._generation = shared.generation
        log.warning("token %r: logged in again; KEK found and checked",
                    self._config.token_label)

    def close(self) -> None:
        require_lock()
        if not self._closed:
            self._closed = True
            _release_session(self._key)

    def _check_open(self) -> None:
        if self._closed:
            raise CustodyError("the token has been closed")

    def __repr__(self) -> str:
        return f"Token(label={self._config.token_label!r}, kek={self._config.kek_label!r})"
