"""The custodian's own configuration: one TOML file, read by the custodian's uid only.

Why its own file: the pipeline must not learn where the PIN is, nor choose the relay AUTH
is signed for or the uid the socket answers. The daemon's config keeps one key about it,
``[custody] custodian_socket``.

Keys (a key or table not listed is an error naming it):
- ``[custodian]`` ``socket`` (path), ``pipeline_uid`` (int, 0 to `MAX_UID`, default: the
  custodian's own uid: then nothing is separated, as under ``make run``), ``state_dir`` (the keystore's),
  ``relay_url`` (AUTH is signed for this URL only), ``signatures_per_minute`` (per agent,
  default 6000, 1 to 1,000,000), ``log_dir`` (default ``<state_dir>/custodian``),
  ``log_max_bytes`` (default 64 MiB, 4 KiB to 1 TiB), ``destroy_grace_seconds`` (default
  7 days, 0 to 366 days: custody/custodian/grace.py), ``max_records`` (default 5,000, 1
  to `messages.MAX_RECORDS`, 7,161: the keystore's records, live and destroyed, past which
  `mint` and `import` are refused; it bounds the keystore and the grace copies, and at
  its most the `agents` answer of the largest records still fits one frame),
  ``max_inflight_bytes`` (default 32 MiB, `messages.MAX_FRAME` to 1 TiB: bytes of frames
  held at once, each from its header until its answer is sent; docs/custodian.md).
- ``[pkcs11]`` as the daemon's: ``module``, ``token_label``, ``pin_file``, ``kek_label``
  (1 to 255 printable ASCII, the label a blob can name: custody/_records.py `kek_label_ok`),
  ``seal``, ``unsealed_cache_entries``, ``unsealed_cache_seconds`` (above 0, at most an
  hour: no NaN, no infinity). The PIN file is ``$CREDENTIALS_DIRECTORY/token-pin`` when that
  exists (the unit's credential).
- Every relative path (``socket``, ``state_dir``, ``log_dir``, ``pin_file``, a ``module``
  holding a slash, ``[backup] dir``) is resolved against FILE's directory, never the
  working directory.
- ``[backup]`` (optional; without it the `backup` row is refused): ``recipients`` (a list
  of age X25519 recipients, ``age1…``: the only ones a backup is ever encrypted to) and
  ``dir`` (where the custodian writes each backup, a new file named by itself), required;
  ``max_files`` (default 100, 1 to 10,000: past that many ``agents-*.age`` in ``dir`` the
  row is refused) and ``min_interval_seconds`` (default 300, 0 to a week). The pipeline
  can ask for a backup; it chooses none of these (custody/custodian/backup.py).
"""

from __future__ import annotations

import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from custody import CachePolicy, CustodyError, TokenConfig
from custody._backup import check_recipients
from custody._records import MAX_CACHE_SECONDS, MAX_UID
from custody._token import MAX_KEK_LABEL, kek_label_ok
from custody.custodian.backup import Bounds
from custody.custodian.messages import MAX_FRAME, MAX_RECORDS
from custody.custodian.server import Settings

__all__ = ["CustodianConfig", "ConfigError", "load"]

_KEYS: dict[str, dict[str, type]] = {
    "custodian": {"socket": str, "pipeline_uid": int, "state_dir": str, "relay_url": str,
                  "signatures_per_minute": int, "log_dir": str, "log_max_bytes": int,
                  "destroy_grace_seconds": int, "max_records": int, "max_inflight_bytes": int},
    "pkcs11": {"module": str, "token_label": str, "pin_file": str, "kek_label": str,
               "seal": str, "unsealed_cache_entries": int, "unsealed_cache_seconds": float},
    "backup": {"recipients": list, "dir": str, "max_files": int, "min_interval_seconds": int},
}
#: Most recipients one backup names (the key-event log's bound, daemon/state/audit.py).
MAX_RECIPIENTS = 64
_REQUIRED = {"custodian": ("socket", "state_dir", "relay_url"), "pkcs11": ("module", "token_label")}
#: [custodian] integers outside these are refused: a uid as the daemon's; 0 signatures a minute would refuse
#: every one; a negative grace is none (0 says so plainly), and past a year destroyed keys'
#: sealed copies are kept beyond any use; a log under 4 KiB holds a handful of lines; an
#: in-flight budget under one frame would never read the largest.
_RANGES = {"signatures_per_minute": (1, 1_000_000), "destroy_grace_seconds": (0, 366 * 86400),
           "log_max_bytes": (4096, 1 << 40), "max_records": (1, MAX_RECORDS),
           "max_inflight_bytes": (MAX_FRAME, 1 << 40), "pipeline_uid": (0, MAX_UID)}


class ConfigError(Exception):
    """One line naming the file and the key."""


@dataclass(frozen=True, slots=True)
class CustodianConfig:
    settings: Settings
    token: TokenConfig
    cache: CachePolicy
    state_dir: Path


def _read(path: str) -> bytes:
    # O_NONBLOCK and a regular file only: opening a FIFO otherwise waits for a writer for
    # ever (the daemon's loader does the same, daemon/config.py).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"{path}: not a regular file (a directory, FIFO, socket or "
                                  "device); name the configuration file itself")
            with open(fd, "rb", closefd=False) as handle:
                return handle.read()
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None


def load(path: str) -> CustodianConfig:
    text = _read(path)
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except ValueError:  # tomllib's int(): a literal past Python's 4,300-digit limit
        raise ConfigError(f"{path}: an integer too long to read") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"{path}: arrays or tables nested too deeply") from None
    for table, members in data.items():
        if table not in _KEYS or not isinstance(members, dict):
            raise ConfigError(f"{path}: unknown table [{table}]")
        for key, value in members.items():
            kind = _KEYS[table].get(key)
            if kind is None:
                raise ConfigError(f"{path}: unknown key [{table}] {key}")
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float \
                else (isinstance(value, kind) and not isinstance(value, bool))
            if not ok:
                raise ConfigError(f"{path}: [{table}] {key} must be a {kind.__name__}")
            if isinstance(value, str) and "\0" in value:  # no path can hold one
                raise ConfigError(f"{path}: [{table}] {key} holds a NUL character")
    for table, keys in _REQUIRED.items():
        for key in keys:
            if key not in data.get(table, {}):
                raise ConfigError(f"{path}: [{table}] {key} is required")
    for key, (low, high) in _RANGES.items():
        value = data["custodian"].get(key, low)
        if not low <= value <= high:
            raise ConfigError(f"{path}: [custodian] {key} must be {low} to {high}, not {value}")
    base = Path(path).resolve().parent
    c, p, b = data["custodian"], data["pkcs11"], data.get("backup", {})
    # The `relay` row answers it to the pipeline, which says it where a daemon refuses to
    # start against another: never a password (not said here either).
    try:
        relay = urlsplit(c["relay_url"])
        fits = relay.scheme in ("ws", "wss") and bool(relay.hostname) and "@" not in \
            relay.netloc and c["relay_url"] == c["relay_url"].strip()
    except ValueError:  # urlsplit's: brackets that hold no IPv6 address
        fits = False
    if not fits:
        raise ConfigError(f"{path}: [custodian] relay_url must be a ws:// or wss:// URL with "
                          "a host and no user information: the daemon's [relay] url, exactly")
    recipients = tuple(b.get("recipients", ()))
    if b and not (b.keys() >= {"recipients", "dir"} and 0 < len(recipients) <= MAX_RECIPIENTS
                  and all(isinstance(r, str) for r in recipients)):
        raise ConfigError(f"{path}: [backup] needs dir and 1 to {MAX_RECIPIENTS} recipients")
    try:
        if recipients:
            check_recipients(recipients)
        bounds = Bounds(**{k: b[k] for k in ("max_files", "min_interval_seconds") if k in b})
    except CustodyError as exc:
        raise ConfigError(f"{path}: [backup] recipients: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: [backup] {exc}") from None
    kek_label = p.get("kek_label", "buzz-broker-kek")
    if not kek_label_ok(kek_label):
        raise ConfigError(f"{path}: [pkcs11] kek_label must be 1 to {MAX_KEK_LABEL} printable "
                          f"ASCII characters, not {kek_label[:64]!r}")
    seconds = p.get("unsealed_cache_seconds", 30)
    # Compared before float(): an integer past a float's range would raise OverflowError
    # there. NaN fails the comparison, infinity the bound (the daemon's `_Duration`).
    if not 0 < seconds <= MAX_CACHE_SECONDS:
        raise ConfigError(f"{path}: [pkcs11] unsealed_cache_seconds must be above 0 and at "
                          f"most {MAX_CACHE_SECONDS:g}")
    state_dir = base / c["state_dir"]
    credential = Path(os.environ.get("CREDENTIALS_DIRECTORY", "/nonexistent"), "token-pin")
    pin_file = str(credential) if credential.is_file() else (
        str(base / p["pin_file"]) if p.get("pin_file") else p.get("pin_file"))
    module = p["module"] if "/" not in p["module"] else str(base / p["module"])
    socket = base / c["socket"]  # bind() takes 107 bytes and a NUL (sockaddr_un's sun_path)
    if len(os.fsencode(socket)) > 107:
        raise ConfigError(f"{path}: [custodian] socket: {socket}: longer than 107 bytes")
    settings = Settings(
        socket=socket, relay_url=c["relay_url"],
        log_path=base / c.get("log_dir", str(state_dir / "custodian")) / "signed.jsonl",
        # The ranged integers' defaults are Settings' own (one place says them), but the
        # uid's: the custodian's own.
        **{"pipeline_uid": os.getuid(), **{key: c[key] for key in _RANGES if key in c}},
        backup_recipients=tuple(r.strip() for r in recipients),
        backup_dir=base / b["dir"] if b else None, backup_bounds=bounds)
    try:
        token = TokenConfig(module=module, token_label=p["token_label"], pin_file=pin_file,
                            kek_label=kek_label,
                            seal=p.get("seal", "auto"))
        cache = CachePolicy(p.get("unsealed_cache_entries", 0),
                            float(seconds))
    except ValueError as exc:
        raise ConfigError(f"{path}: [pkcs11] {exc}") from None
    return CustodianConfig(settings=settings, token=token, cache=cache, state_dir=state_dir)
