"""Credentials: a bearer token in, a `Principal` (or nothing) out.

Rules (spec I2 "Authority comes from the session"; issue 4):
- A token is `bzb_` followed by 43 base64url characters: 256 bits from `secrets`, with a
  prefix that secret scanners and humans recognise. It exists only in the return value of
  `issue()`; the store keeps its sha256 and the scope (agent, channels, actions, expiry,
  optional Unix uid). sha256 without a salt is enough because the input is 256 random
  bits: there is nothing to guess or precompute.
- `authenticate` has one failure answer, `None`, for every cause (missing, malformed,
  unknown, revoked, expired, wrong uid), like an opaque InvalidToken: the pipeline turns
  it into `failed` + `unauthenticated` and the caller learns nothing about which check
  failed. `check` is the same judgement with the cause kept for the operator's log
  (`Refused`: an `AuthCause` and, when the token matched one, the credential's id; issue
  25). The cause comes from memory only: revoked credentials are kept in memory too (their
  token hash and id, `_revoked`), so telling unknown from revoked costs no query, and the
  memory is bounded by the credentials the operator issued, never by what clients send.
  This module does not log tokens.
- Parsing is strict and bounded BEFORE any work: the header must be exactly
  `Bearer <token>` (scheme case-insensitive, RFC 7235 §2.1; exactly one space; no
  trailing whitespace), and since a token has one fixed length, a header of any other
  length is refused by comparing two integers. A 10 MB header costs a `len()`.
- The credential is found by its hash in a dict (the hash of attacker input is not
  attacker-steerable, so the lookup leaks nothing useful) and then confirmed with
  `hmac.compare_digest` (style.md #14).
- `Principal` can only be made here: its constructor demands a module-private key, and
  `dataclasses.replace` cannot copy it (it is an InitVar), so no other code can mint
  authority.

Theory of operation — how the daemon sees credentials the CLI issued or revoked:
the daemon keeps every unrevoked credential in memory, keyed by token hash. Before each
lookup of a well-formed token it asks SQLite for `PRAGMA data_version`, which changes
whenever another connection (the `credential` CLI) has committed to the database; a
commit that changed a credential reloads the table (below). So a newly issued credential
works on its first request and a revocation takes effect on the very next request,
without SIGHUP. The check reads SQLite's WAL index in shared memory (no disk read, no
fsync). `reload()` (SIGHUP) forces the same reload; issue/revoke in this process reload
too, because a connection's own commits do not move its data_version.

A moved data_version reloads only when a credential changed: the `generation` row,
which triggers in the database itself count up on every insert and delete of a
credential and every update of any of its columns but `last_used_at`
(`GENERATION_COLUMNS`), whoever writes it and whatever its version. So a write of last
use alone, on another connection, costs the daemon one read of that row, not a reload of
the table (20 ms per thousand credentials on the event loop, measured). This process's
own writes leave its generation behind, which costs at most one reload later, never a
missed change.

Last use (issue 13, `credential list`): `authenticate` notes the second a credential was
last used in a dict (no I/O per request). The daemon takes the noted seconds every
`LAST_USE_FLUSH_SECONDS` (`take_last_use`) and writes them in one transaction on a
connection of its own, in a worker thread (`write_last_use`): that commit's fsync, and a
wait of up to the busy timeout behind another writer, never hold the event loop. A
failed write puts them back for the next flush (`keep_last_use`). `close()` writes the
rest at shutdown. A crash loses at most a minute of last-use history, never a credential
or a revocation. The alternative, a durable write per request, would put an fsync on
every request's path for a number only an operator reads.

Labels: an optional operator note (`--label`), printable, at most `MAX_LABEL_CHARS`; it
is shown by `credential list` and is never a secret.

Schema upgrades: `label` and `last_used_at` were added after the first release; `open`
adds them to an older database (ALTER TABLE ADD COLUMN, which rewrites nothing).

WARNING: `TOKEN_PREFIX`, `_TOKEN_BODY_CHARS` and `MAX_AUTHORIZATION_CHARS` must agree;
the schema below is read by `_load`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import sqlite3
import enum
import time
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Final

from daemon.state._sqlite import open_private_db, transaction

__all__ = [
    "AuthCause",
    "CREDENTIAL_ID_RE",
    "Refused",
    "LAST_USE_FLUSH_SECONDS",
    "GENERATION_COLUMNS",
    "MAX_LABEL_CHARS",
    "check_label",
    "Principal",
    "CredentialInfo",
    "SessionStore",
    "SESSIONS_FILENAME",
    "TOKEN_PREFIX",
    "MAX_AUTHORIZATION_CHARS",
]

#: The file under the state directory.
SESSIONS_FILENAME: Final = "sessions.db"

#: Recognisable at a glance and by secret scanners ("buzz broker").
TOKEN_PREFIX: Final = "bzb_"

#: Bytes of randomness in a token: 256 bits (issue 4: "≥ 256 bits").
_TOKEN_BYTES: Final = 32

#: base64url without padding of 32 bytes is 43 characters.
_TOKEN_BODY_CHARS: Final = 43

_TOKEN_CHARS: Final = len(TOKEN_PREFIX) + _TOKEN_BODY_CHARS

_SCHEME: Final = "bearer"

#: A well-formed header is exactly `Bearer` + one space + a token, so its length is fixed.
#: Anything else is refused before it is scanned, hashed or looked up.
MAX_AUTHORIZATION_CHARS: Final = len(_SCHEME) + 1 + _TOKEN_CHARS

_TOKEN_RE: Final = re.compile(
    re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_-]{" + str(_TOKEN_BODY_CHARS) + r"}"
)
_AGENT_RE: Final = re.compile(r"[0-9a-f]{64}")
#: Canonical channel ids only (spec: lowercase, hyphenated). Callers normalize first.
_CHANNEL_RE: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: Action names are the spec's wire names (`channel.read`, ...); the store checks shape,
#: the CLI checks membership in the nine.
_ACTION_RE: Final = re.compile(r"[a-z]+\.[a-z]+")
#: A credential id as `issue` makes it (`cred_` + `token_hex(8)`): the one shape, which the
#: commands that take an id and the audit log's lines are checked against.
CREDENTIAL_ID_RE: Final = re.compile(r"cred_[0-9a-f]{16}")

#: How often the daemon writes the last-use seconds it noted (see the module docstring):
#: `credential list` may lag by this much.
LAST_USE_FLUSH_SECONDS: Final = 60.0

#: Longest `--label`: a note for a terminal line, not a document.
MAX_LABEL_CHARS: Final = 80

#: Only this module holds it: the one key that lets a Principal be constructed.
_ISSUER: Final = object()


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """Who is acting, and within what scope. Made only by `SessionStore.authenticate`."""

    credential_id: str
    #: the agent's public key, 64 lowercase hex
    agent: str
    #: canonical lowercase channel UUIDs this credential is bound to
    channels: frozenset[str]
    #: wire action names this credential may ask for
    actions: frozenset[str]
    #: seconds since the epoch, or None for a credential that does not expire
    expires_at: int | None
    #: the Unix uid the peer must have (SO_PEERCRED), or None
    uid: int | None
    _key: InitVar[object]

    def __post_init__(self, _key: object) -> None:
        if _key is not _ISSUER:
            raise TypeError("Principal is created only by SessionStore.authenticate")


class AuthCause(enum.Enum):
    """Why a request was not authenticated: for the operator's log, never the agent's."""

    #: no Authorization header
    MISSING = "missing"
    #: not `Bearer <token>` of a token's one shape
    MALFORMED = "malformed"
    #: well-formed, but no credential of this host has that token
    UNKNOWN = "unknown"
    #: the credential was revoked (`credential revoke`, `agent remove`, agents.delete)
    REVOKED = "revoked"
    #: the credential's lifetime ended
    EXPIRED = "expired"
    #: the credential is bound to a uid, and the peer is another (or unknown) uid
    WRONG_UID = "wrong_uid"
    #: over a loopback TCP listener, a credential bound to no uid ([server]
    #: tcp_allow_credentials_without_uid is off: any local user could have sent it)
    NO_UID_OVER_TCP = "no_uid_over_tcp"
    #: a valid credential whose agent is gone (the pipeline's check, daemon/pipeline/broker.py)
    AGENT_GONE = "agent_gone"


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """A request `check` did not authenticate, and why (never the token)."""

    cause: AuthCause
    #: the credential the token matched, or None (missing, malformed, unknown)
    credential_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CredentialInfo:
    """What `credential list` shows: identity and scope, never the token or its hash."""

    credential_id: str
    agent: str
    channels: tuple[str, ...]
    actions: tuple[str, ...]
    created_at: int
    expires_at: int | None
    uid: int | None
    revoked_at: int | None
    label: str | None = None
    #: seconds since the epoch of the last authenticated use the daemon wrote (see
    #: LAST_USE_FLUSH_SECONDS), or None if never used
    last_used_at: int | None = None

    def active(self, now: int) -> bool:
        """Not revoked and not expired at `now`."""
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS credentials (
    credential_id TEXT    PRIMARY KEY,
    token_sha256  BLOB    NOT NULL UNIQUE,
    agent         TEXT    NOT NULL,
    channels      TEXT    NOT NULL,
    actions       TEXT    NOT NULL,
    created_at    INTEGER NOT NULL,
    expires_at    INTEGER,
    uid           INTEGER,
    revoked_at    INTEGER,
    label         TEXT,
    last_used_at  INTEGER
);
CREATE INDEX IF NOT EXISTS credentials_by_agent ON credentials (agent)
"""

#: Columns added after the first release: (name, type), added by `_upgrade` when missing.
_ADDED_COLUMNS: Final = (("label", "TEXT"), ("last_used_at", "INTEGER"))

_COLUMNS = (
    "credential_id, agent, channels, actions, created_at, expires_at, uid, revoked_at,"
    " label, last_used_at"
)

#: The columns whose update moves `generation` (module docstring): all but last use.
GENERATION_COLUMNS: Final = tuple(
    name for name in ("token_sha256", *(c.strip() for c in _COLUMNS.split(",")))
    if name != "last_used_at"
)
#: The generation row and its triggers. Not in `_SCHEMA`: open_private_db splits that on
#: ";", which a trigger's body contains. Idempotent; `_upgrade` runs it on every open.
_GENERATION_DDL: Final = (
    "CREATE TABLE IF NOT EXISTS generation"
    " (id INTEGER PRIMARY KEY CHECK (id = 0), value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO generation (id, value) VALUES (0, 0)",
    *(f"CREATE TRIGGER IF NOT EXISTS credentials_{name} AFTER {event} ON credentials"
      " BEGIN UPDATE generation SET value = value + 1 WHERE id = 0; END"
      for name, event in (("inserted", "INSERT"), ("deleted", "DELETE"),
                          ("changed", f"UPDATE OF {', '.join(GENERATION_COLUMNS)}"))),
)


def _token_hash(token: str) -> bytes:
    # The one place a presented token is hashed; tests count calls to prove that
    # malformed input never gets here.
    return hashlib.sha256(token.encode("ascii")).digest()


def _parse_authorization_unverified(header_value: str | None) -> str | None:
    """The token inside `Bearer <token>`, or None. Shape only; nothing is verified."""
    if not isinstance(header_value, str) or len(header_value) != MAX_AUTHORIZATION_CHARS:
        return None
    scheme, space, token = (
        header_value[: len(_SCHEME)],
        header_value[len(_SCHEME)],
        header_value[len(_SCHEME) + 1 :],
    )
    if scheme.lower() != _SCHEME or space != " ":
        return None
    # fullmatch on a fixed-length string: linear and tiny.
    if _TOKEN_RE.fullmatch(token) is None:
        return None
    return token


def _upgrade(conn: sqlite3.Connection) -> None:
    """Add the columns and the generation row an older sessions.db lacks (nothing is
    rewritten)."""
    present = {str(row[1]) for row in conn.execute("PRAGMA table_info(credentials)")}
    for name, kind in _ADDED_COLUMNS:
        if name not in present:
            try:
                conn.execute(f"ALTER TABLE credentials ADD COLUMN {name} {kind}")
            except sqlite3.OperationalError as exc:
                # Another process (the CLI beside the daemon) added it first.
                if "duplicate column" not in str(exc):
                    raise
    # After the columns: the trigger names them. One transaction, so no opener sees the
    # row without its triggers.
    with transaction(conn):
        for statement in _GENERATION_DDL:
            conn.execute(statement)


def _write_last_use(conn: sqlite3.Connection, noted: dict[str, int]) -> None:
    # Never moves a last use back: a CLI or an older flush may have written a later one.
    with transaction(conn):
        conn.executemany(
            "UPDATE credentials SET last_used_at = ? WHERE credential_id = ?"
            " AND (last_used_at IS NULL OR last_used_at < ?)",
            [(at, cid, at) for cid, at in noted.items()],
        )


def check_label(label: str | None) -> None:
    """Raises ValueError unless `label` is None or 1..MAX_LABEL_CHARS printable characters."""
    if label is None:
        return
    if (not isinstance(label, str) or not label or len(label) > MAX_LABEL_CHARS
            or not label.isprintable()):
        raise ValueError(f"label must be 1 to {MAX_LABEL_CHARS} printable characters")


def _info(row: tuple[object, ...]) -> CredentialInfo:
    (cid, agent, channels, actions, created_at, expires_at, uid, revoked_at, label,
     last_used_at) = row
    return CredentialInfo(
        credential_id=str(cid),
        agent=str(agent),
        channels=tuple(json.loads(str(channels))),
        actions=tuple(json.loads(str(actions))),
        created_at=_integer(created_at),
        expires_at=None if expires_at is None else _integer(expires_at),
        uid=None if uid is None else _integer(uid),
        revoked_at=None if revoked_at is None else _integer(revoked_at),
        label=None if label is None else str(label),
        last_used_at=None if last_used_at is None else _integer(last_used_at),
    )


def _integer(value: object) -> int:
    """An INTEGER column of our own table (the schema makes it one)."""
    if not isinstance(value, int):
        raise AssertionError(f"sessions: an INTEGER column held {type(value).__name__}")
    return value


def _scope_refusal(principal: Principal, peer_uid: int | None, now: int,
                   uid_bound_only: bool) -> AuthCause | None:
    """Why a credential that matched may not act for this peer now, or None."""
    if principal.expires_at is not None and now >= principal.expires_at:
        return AuthCause.EXPIRED
    if principal.uid is not None and peer_uid != principal.uid:
        return AuthCause.WRONG_UID
    if uid_bound_only and principal.uid is None:
        return AuthCause.NO_UID_OVER_TCP
    return None


@dataclass(frozen=True, slots=True)
class _Active:
    token_sha256: bytes
    principal: Principal


class SessionStore:
    """Credentials in `<state>/sessions.db`. Create with `SessionStore.open(state_dir)`."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        # Private: use SessionStore.open().
        self._conn = conn
        self._path = path
        self._active: dict[bytes, _Active] = {}
        #: token sha256 -> credential id, for every revoked credential (module docstring)
        self._revoked: dict[bytes, str] = {}
        self._data_version: int | None = None
        self._generation: int | None = None
        #: credential_id -> last second it authenticated, not yet written
        self._last_used: dict[str, int] = {}
        _upgrade(conn)
        self.reload()

    @classmethod
    def open(cls, state_dir: Path | str) -> SessionStore:
        """Open (creating if needed, 0600) the credential database under `state_dir`.

        Raises:
            OSError / sqlite3.Error: the directory or database cannot be opened.
        """
        directory = Path(state_dir)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / SESSIONS_FILENAME
        return cls(open_private_db(path, _SCHEMA), path)

    def close(self) -> None:
        """Write the last-use seconds still held in memory, then close."""
        try:
            self.flush_last_use()
        finally:
            self._conn.close()

    def flush_last_use(self) -> int:
        """Write every noted last-use second in one transaction on this store's own
        connection, here and now (blocking: shutdown, tests). Returns how many rows.

        On a database error the noted seconds are kept for the next flush and the error is
        raised (the caller logs it; requests go on).
        """
        noted = self.take_last_use()
        if not noted:
            return 0
        try:
            _write_last_use(self._conn, noted)
        except sqlite3.Error:
            self.keep_last_use(noted)
            raise
        return len(noted)

    def take_last_use(self) -> dict[str, int]:
        """The noted last-use seconds, now no longer held here (for `write_last_use`)."""
        noted, self._last_used = self._last_used, {}
        return noted

    def keep_last_use(self, noted: dict[str, int]) -> None:
        """Hold `noted` again after a failed write; a later use of the same credential,
        noted meanwhile, wins."""
        for cid, at in noted.items():
            self._last_used[cid] = max(at, self._last_used.get(cid, at))

    def write_last_use(self, noted: dict[str, int]) -> None:
        """Write `noted` on a connection of its own (module docstring): safe to call from
        a worker thread while the event loop goes on using this store.

        Raises:
            OSError / sqlite3.Error: the write failed; nothing of `noted` is written.
        """
        writer = open_private_db(self._path, "")
        try:
            _write_last_use(writer, noted)
        finally:
            writer.close()

    # -- the daemon's side ------------------------------------------------------------

    def reload(self) -> None:
        """Re-read every credential (SIGHUP, or another process committed): the unrevoked
        ones whole, the revoked ones as hash and id."""
        # The version, then the generation, then the rows: a commit between any two is
        # seen by the next request's check.
        self._data_version = self._version()
        self._generation = self._current_generation()
        rows = self._conn.execute(f"SELECT token_sha256, {_COLUMNS} FROM credentials").fetchall()
        active: dict[bytes, _Active] = {}
        revoked: dict[bytes, str] = {}
        for row in rows:
            info = _info(row[1:])
            digest = bytes(row[0])
            if info.revoked_at is not None:
                revoked[digest] = info.credential_id
                continue
            active[digest] = _Active(
                digest,
                Principal(
                    credential_id=info.credential_id,
                    agent=info.agent,
                    channels=frozenset(info.channels),
                    actions=frozenset(info.actions),
                    expires_at=info.expires_at,
                    uid=info.uid,
                    _key=_ISSUER,
                ),
            )
        self._active = active
        self._revoked = revoked

    def _version(self) -> int:
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def _current_generation(self) -> int:
        return int(self._conn.execute("SELECT value FROM generation WHERE id = 0").fetchone()[0])

    def _refresh_if_changed(self) -> None:
        version = self._version()
        if version == self._data_version:
            return
        # Another connection committed: a credential (the CLI), or only last use.
        generation = self._current_generation()
        if generation != self._generation:
            self.reload()
        else:
            self._data_version = version

    def authenticate(
        self, header_value: str | None, peer_uid: int | None, now: int,
        *, uid_bound_only: bool = False,
    ) -> Principal | None:
        """The principal a request's Authorization header proves, or None.

        Args:
            header_value: the raw Authorization header value (None when absent).
            peer_uid: the connecting process's uid from SO_PEERCRED (None when unknown).
            now: seconds since the epoch.
            uid_bound_only: refuse a credential bound to no uid (a request over loopback
                TCP, where every local user can connect: docs/configuration.md).

        Returns:
            The Principal, or None for every failure (missing, malformed, unknown,
            revoked, expired, wrong or unknown uid). There is deliberately no reason.
        """
        checked = self.check(header_value, peer_uid, now, uid_bound_only=uid_bound_only)
        return checked if isinstance(checked, Principal) else None

    def check(
        self, header_value: str | None, peer_uid: int | None, now: int,
        *, uid_bound_only: bool = False,
    ) -> Principal | Refused:
        """`authenticate`, with the cause of a refusal kept for the operator's log.

        Costs what `authenticate` costs: a well-formed token is one read of SQLite's
        change counter (shared memory) and dict lookups; no query, whatever the cause.

        Returns:
            The Principal, or `Refused` (the cause, and the credential id when the token
            matched a credential). Never to be shown to the agent (one fixed answer).
        """
        if header_value is None:
            return Refused(cause=AuthCause.MISSING)
        token = _parse_authorization_unverified(header_value)
        if token is None:
            return Refused(cause=AuthCause.MALFORMED)
        self._refresh_if_changed()
        digest = _token_hash(token)
        found = self._active.get(digest)
        if found is None or not hmac.compare_digest(found.token_sha256, digest):
            revoked = self._revoked.get(digest)
            if revoked is not None:
                return Refused(cause=AuthCause.REVOKED, credential_id=revoked)
            return Refused(cause=AuthCause.UNKNOWN)
        principal = found.principal
        cause = _scope_refusal(principal, peer_uid, now, uid_bound_only)
        if cause is not None:
            return Refused(cause=cause, credential_id=principal.credential_id)
        self._last_used[principal.credential_id] = now
        return principal

    # -- the operator's side (the CLI) ---------------------------------------------------

    def issue(
        self,
        *,
        agent: str,
        channels: frozenset[str],
        actions: frozenset[str],
        ttl_seconds: int | None,
        uid: int | None,
        now: int,
        label: str | None = None,
    ) -> tuple[str, str]:
        """Create a credential. Returns (credential_id, token); the token is never stored.

        Args:
            agent: the agent's pubkey, 64 lowercase hex (the caller checks the keystore).
            channels: one or more canonical (lowercase, hyphenated) channel UUIDs.
            actions: one or more wire action names.
            ttl_seconds: lifetime, or None for a credential that does not expire.
            uid: the Unix uid the peer must have, or None.
            now: seconds since the epoch.
            label: an operator's note shown by `credential list`, or None.

        Raises:
            ValueError: a malformed argument (message names the argument, never a token).
        """
        if not isinstance(agent, str) or _AGENT_RE.fullmatch(agent) is None:
            raise ValueError("agent must be 64 lowercase hex characters")
        if not channels or not all(
            isinstance(c, str) and _CHANNEL_RE.fullmatch(c) for c in channels
        ):
            raise ValueError("channels must be one or more canonical lowercase UUIDs")
        if not actions or not all(isinstance(a, str) and _ACTION_RE.fullmatch(a) for a in actions):
            raise ValueError("actions must be one or more action names")
        if ttl_seconds is not None and (
            isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or ttl_seconds <= 0
        ):
            raise ValueError("ttl_seconds must be a positive int or None")
        if uid is not None and (isinstance(uid, bool) or not isinstance(uid, int) or uid < 0):
            raise ValueError("uid must be a non-negative int or None")
        check_label(label)
        token = TOKEN_PREFIX + secrets.token_urlsafe(_TOKEN_BYTES)
        assert _TOKEN_RE.fullmatch(token) is not None, "token shape and regex disagree"
        credential_id = "cred_" + secrets.token_hex(8)
        self._conn.execute(
            "INSERT INTO credentials (credential_id, token_sha256, agent, channels, actions,"
            " created_at, expires_at, uid, revoked_at, label)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, ?)",
            (
                credential_id,
                _token_hash(token),
                agent,
                json.dumps(sorted(channels)),
                json.dumps(sorted(actions)),
                now,
                None if ttl_seconds is None else now + ttl_seconds,
                uid,
                label,
            ),
        )
        # Add the one new credential instead of re-reading them all: issuing n credentials
        # was O(n^2) (10,000 took minutes). Other processes' commits still trigger a full
        # reload, exactly as before.
        self._refresh_if_changed()
        digest = _token_hash(token)
        self._active[digest] = _Active(
            digest,
            Principal(
                credential_id=credential_id,
                agent=agent,
                channels=frozenset(channels),
                actions=frozenset(actions),
                expires_at=None if ttl_seconds is None else now + ttl_seconds,
                uid=uid,
                _key=_ISSUER,
            ),
        )
        return credential_id, token

    def list(self) -> list[CredentialInfo]:
        """Every credential ever issued (revoked ones too), oldest first. No tokens."""
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM credentials ORDER BY created_at, rowid"
        ).fetchall()
        return [_info(row) for row in rows]

    def grant(self, credential_id: str, actions: frozenset[str], *, now: int) -> tuple[str, ...] | None:
        """Add `actions` to one active credential's scope; never removes any.

        An existing credential gains an action only this way (issue 23): nothing a new
        release adds reaches it silently. The change is one UPDATE, so the daemon sees it on
        the next request (the change counter), like `issue` and `revoke`.

        Returns:
            The actions newly added, sorted (empty when it held them all already), or None
            when no active (unrevoked, unexpired) credential has that id.

        Raises:
            ValueError: `actions` is empty or holds a malformed name.
        """
        if not actions or not all(isinstance(a, str) and _ACTION_RE.fullmatch(a) for a in actions):
            raise ValueError("actions must be one or more action names")
        if not isinstance(credential_id, str) or CREDENTIAL_ID_RE.fullmatch(credential_id) is None:
            return None
        with transaction(self._conn):
            row = self._conn.execute(
                "SELECT actions FROM credentials WHERE credential_id = ? AND revoked_at IS NULL"
                " AND (expires_at IS NULL OR expires_at > ?)", (credential_id, now),
            ).fetchone()
            if row is None:
                return None  # nothing written: the commit ends a read, as a rollback would
            held = frozenset(json.loads(str(row[0])))
            added = tuple(sorted(actions - held))
            if added:
                self._conn.execute(
                    "UPDATE credentials SET actions = ? WHERE credential_id = ?",
                    (json.dumps(sorted(held | actions)), credential_id),
                )
        self.reload()
        return added

    def revoke(self, credential_id: str, *, now: int | None = None) -> bool:
        """Revoke one credential. Returns False if it is unknown or already revoked."""
        if not isinstance(credential_id, str) or CREDENTIAL_ID_RE.fullmatch(credential_id) is None:
            return False
        at = int(time.time()) if now is None else now
        changed = self._conn.execute(
            "UPDATE credentials SET revoked_at = ? WHERE credential_id = ? AND revoked_at IS NULL",
            (at, credential_id),
        ).rowcount
        self.reload()
        return bool(changed)

    def revoke_agent(self, agent_pubkey: str, *, now: int | None = None) -> int:
        """Revoke every credential of a removed or deleted agent. Returns how many.

        Blocking (a commit's fsync): the daemon calls it from a worker thread, never on the
        event loop (issue 22, L6). So it writes on a connection of its own, opened in that
        thread, and leaves this store's connection and its in-memory table to the loop:
        sharing them would let a transaction of the loop's (`flush_last_use` at close)
        swallow (and a rollback undo) the revocation, and the loop's reads wait on the
        thread's fsync. The write moves this connection's data_version and the
        generation, so the very next `authenticate` reloads and the revocation holds from
        the next request on, as for the CLI's.
        """
        at = int(time.time()) if now is None else now
        writer = open_private_db(self._path, "")
        try:
            changed = writer.execute(
                "UPDATE credentials SET revoked_at = ? WHERE agent = ? AND revoked_at IS NULL",
                (at, agent_pubkey),
            ).rowcount
        finally:
            writer.close()
        return int(changed)
