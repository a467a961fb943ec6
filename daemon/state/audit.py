"""The audit log: append-only, hash-chained JSON Lines, durable before a verdict leaves.

Rules (issue 10):
- One record per verdict after authentication, and one *intent* record before a
  publishing operation sends anything. A record holds facts only: time, credential id,
  agent pubkey, action, requestId, the body's MAC, status, code, event ids, and
  whether it was a replay. Never argument content, credentials or secrets: `AuditRecord`
  has no field that could carry them, and validates every field's shape in construction.
- The body is named by `bodyMac`, HMAC-SHA256 under the host's audit MAC key
  (daemon/state/audit_mac.py), never by an unkeyed digest: a body is mostly what its
  sender can rebuild, so a sha256 beside the requestId confirmed a guessed value offline.
  Lines written before carry `bodySha256` instead; they are read, shown and verified as
  ever (a log spans upgrades), and `append` refuses to write one (`BodyDigest`).
- Each line is canonical JSON (sorted keys, compact separators, ASCII only) ending in
  `\\n`. It carries `seq` (1, 2, 3, ... across all files), `prev` — the sha256 of the
  previous line's exact bytes without its newline (`GENESIS` for the very first record) —
  and `digest`, the sha256 of the line's own canonical JSON without `digest`. An edit
  breaks the record's digest (or its canonical form); a deletion, insertion or
  reordering breaks the next `prev`. `verify` names the first line where either fails.
- Files are `<dir>/audit-000001.jsonl`, `-000002`, ... (they sort by name). When the
  current file has reached `rotate_bytes`, the next record starts a new file; its `prev`
  is the hash of the previous file's last line, so the chain runs across files.
- Fail closed: `append` returns only after the record's bytes are fsynced; if they
  cannot be (disk full, read-only, permission, the file replaced), it raises
  `AuditUnavailable` with one fixed message and the operator log says why. The pipeline
  then answers `failed` + `internal` before anything is sent (docs/operations.md).
- Modes: the directory is 0700, files 0600, created with those modes (no window).

Theory of operation — group commit (the engine is daemon/state/_group_commit.py, shared with
the ledger): `append` queues the record; the first task to find no flush running becomes
the flusher and, in a worker thread, encodes everything queued (chaining each line to the
one before, in queue order), writes it with one `write` and one `fsync`, and repeats
until the queue is empty. Many concurrent callers share one fsync; a lone caller pays
one. A failed write truncates the file back to its last good length at once, before its
callers hear that it failed (and, if that cut fails too, before the next batch and at
close), so a failure never leaves a torn line inside the chain, nor whole lines of records
whose callers were told they are not in it.

Opening: the last line of the last file is read back (it must be a well-formed record
whose digest holds) and the chain continues from it. Bytes after the last newline are a
line a crash tore mid-write: its `append` never returned, so no verdict relied on it;
they are truncated and the operator log says how many bytes were dropped. A damaged
last *complete* line is not guessed at: opening fails (AuditUnavailable) and the operator
runs `buzz-broker audit verify`.

Identity (issue 13): before each batch the writer checks that the path still names the
open file (fstat of the descriptor vs stat of the path: device, inode, one link). A
renamed, deleted, replaced or hard-linked file fails the batch (AuditUnavailable,
`audit.unavailable`): records must never go where nobody will verify them. One writer per
log: `open` takes an exclusive flock on the directory.

Anchor (issue 13): a hash chain alone cannot show a cut tail or a consistently rewritten
suffix. The ledger writes `head` — only ever a durable record — into the state database
with its commits (daemon/state/ledger.py); `open(anchor=...)` refuses a log that does not reach
it (`_check_anchor`: from the file that holds the anchored record to the tail), and
`verify(anchor=...)` checks it whole. An operator who restored an older disk writes a
`Reanchor` record (`buzz-broker audit reanchor`). The daemon also logs `audit.head` to the
operator log at open, rotation and close: the anchor whoever can write both files and
database cannot move. No token-held HMAC key: docs/operations.md, "Anchoring", says why.

Kinds of line: `AuditRecord` (intent, verdict), `RefusalCount` (refusals past a burst,
daemon/state/refusal_audit.py), `ReadCount` (reads that ran, counted per window:
daemon/state/read_audit.py), `Reanchor` and `KeyEvent` (the key commands' intents and
outcomes, written by daemon/state/key_events.py into a chain of their own,
`<state>/key-events/`, since the running daemon holds the lock of `<state>/audit/`);
`_READERS` maps each phase to its reader. One chain code for both logs: `verify`, the
writer and the line format are the same.

Lock wait: the daemon opens with `lock_wait=0` (a second daemon fails at once); the key
commands wait a bounded time for each other (`open(lock_wait=...)`), so two at once take
turns instead of one failing or both forking the chain.

WARNING: `_FIELDS` / `_BODY_MEMBERS` / `_REFUSAL_FIELDS` / `_READ_FIELDS` /
`_REANCHOR_FIELDS` / `_KEY_FIELDS`, the entry classes, `_content`, their `from_json_obj`,
the field tables in docs/operations.md and "The key-event log" in docs/install.md must be
kept in sync.
"""

from __future__ import annotations

import datetime
import enum
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Final, TypeAlias, TypedDict, TypeVar

import trio

from daemon.state._group_commit import Failed, GroupCommit
from buzzwire.contract import PAIRING, ErrorCode, Status, is_request_id
from daemon.fault_log import FaultLog
from daemon.log import log_event
from daemon.state.sessions import CREDENTIAL_ID_RE

__all__ = [
    "AuditLog",
    "AuditRecord",
    "RefusalCount",
    "ReadCount",
    "MAX_READ_TARGETS",
    "Reanchor",
    "KeyEvent",
    "KeyAction",
    "KeyStage",
    "MAX_KEY_PUBKEYS",
    "MAX_KEY_RECIPIENTS",
    "MAX_KEY_TEXT",
    "MAX_KEY_LABEL",
    "AGE_RECIPIENT_RE",
    "text_fits",
    "Entry",
    "BodyDigest",
    "BodyKind",
    "AuditUnavailable",
    "Phase",
    "VerifyResult",
    "verify",
    "read_records",
    "LogLine",
    "AUDIT_DIRNAME",
    "GENESIS",
    "FORMAT",
    "DEFAULT_ROTATE_BYTES",
    "audit_files",
    "is_audit_file_name",
]

_log = logging.getLogger("buzz_broker.audit")

#: The directory under the state directory.
AUDIT_DIRNAME: Final = "audit"

#: Version of the record layout (`v`); a reader refuses any other.
FORMAT: Final = 1

#: `prev` of the first record of the first file: a fixed, documented value.
GENESIS: Final = hashlib.sha256(b"buzz-broker audit log genesis v1").hexdigest()

#: Rotate when a file reaches this size. A record is ~450 bytes, so 64 MiB holds ~150,000
#: verdicts: small enough to copy and verify in a second, few enough files for a year.
DEFAULT_ROTATE_BYTES: Final = 64 * 1024 * 1024

#: Smallest rotation size accepted (tests rotate after a few records).
MIN_ROTATE_BYTES: Final = 1024

#: The longest line `open` reads back when looking for the tail. A record is bounded
#: (9 events at most in a plan, 128-byte requestId), so 64 KiB is far beyond any record.
MAX_LINE_BYTES: Final = 64 * 1024

#: Most event ids one record may list (an agents.create plan publishes a handful).
MAX_EVENTS: Final = 64

#: How often `open(lock_wait=...)` tries the lock again.
_LOCK_POLL_SECONDS: Final = 0.02

DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600

_FILE_RE: Final = re.compile(r"audit-([0-9]{6,})\.jsonl")
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
_ACTION_RE: Final = re.compile(r"[a-z]+\.[a-z]+")
_TIME_RE: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z")

#: The one message an `AuditUnavailable` carries (the operator log holds the cause).
UNAVAILABLE_MESSAGE: Final = "the audit log cannot be written"


class AuditUnavailable(Exception):
    """A record could not be made durable; nothing may be answered as if it were.

    `str()` is always `UNAVAILABLE_MESSAGE`. `detail` is the cause for the operator log
    (an errno name and the file), never shown to agents.
    """

    def __init__(self, detail: str = "", *, busy: bool = False) -> None:
        super().__init__(UNAVAILABLE_MESSAGE)
        self.detail = detail
        #: another writer held the log's lock (for longer than `open` was told to wait)
        self.busy = busy


class Phase(enum.Enum):
    """Why a record was written."""

    #: before a publishing operation sends anything; `events` are the ids about to go out
    INTENT = "intent"
    #: the verdict returned (or replayed) to the agent
    VERDICT = "verdict"
    #: refusals past a credential's burst, counted (`RefusalCount`)
    REFUSALS = "refusals"
    #: reads that ran, counted per credential and window (`ReadCount`, issue 24)
    READS = "reads"
    #: an operator moved the anchor to the log's head (`Reanchor`)
    REANCHOR = "reanchor"
    #: a key-custody command's intent or outcome (`KeyEvent`, the key-event log)
    KEY = "key"


def _utc_text(at: float) -> str:
    when = datetime.datetime.fromtimestamp(at, tz=datetime.timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


_T = TypeVar("_T")


def _member(obj: Mapping[str, object], name: str, kind: type[_T]) -> _T:
    """`obj[name]`, which must be a `kind` (bool is not an int here); ValueError naming it."""
    value = obj[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(name)
    return value


def _optional(obj: Mapping[str, object], name: str, kind: type[_T]) -> _T | None:
    """`obj[name]`, which must be None or a `kind`."""
    return None if obj[name] is None else _member(obj, name, kind)


def _parse_time(text: str) -> float:
    if _TIME_RE.fullmatch(text) is None:
        raise ValueError("time")
    when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return when.timestamp()


def _check_times(kind: str, times: tuple[float, ...]) -> None:
    for value in times:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value < 253402300800  # year 10000: the time format has four digits
        ):
            raise ValueError(f"{kind} times must be seconds since the epoch")


def _check_who(kind: str, times: tuple[float, ...], credential_id: str, agent: str,
               action: str | None) -> None:
    """The shape of the facts every per-credential line carries (a local error: our bug)."""
    _check_times(kind, times)
    if not isinstance(credential_id, str) or not CREDENTIAL_ID_RE.fullmatch(credential_id):
        raise ValueError(f"{kind}.credential_id must be cred_ + 16 hex")
    if not isinstance(agent, str) or not _HEX64.fullmatch(agent):
        raise ValueError(f"{kind}.agent must be 64 lowercase hex")
    if action is not None and (not isinstance(action, str) or not _ACTION_RE.fullmatch(action)):
        raise ValueError(f"{kind}.action must be a wire action name or None")


class BodyKind(enum.Enum):
    """How a line names the request body; the value is the line member that holds it."""

    #: HMAC-SHA256 of the body bytes under the host's audit MAC key
    #: (daemon/state/audit_mac.py): what every line is written with
    MAC = "bodyMac"
    #: sha256 of the body bytes, unkeyed: only in lines older versions wrote; read and
    #: verified, never written again
    SHA256 = "bodySha256"


@dataclass(frozen=True, slots=True, kw_only=True)
class BodyDigest:
    """A line's digest of the request body, and which kind it is.

    Fields:
        kind: `BodyKind.MAC` for every line written now; `SHA256` read from an old line.
        hex: 64 lowercase hex.
    """

    kind: BodyKind
    hex: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, BodyKind):
            raise TypeError("BodyDigest.kind must be a BodyKind")
        if not isinstance(self.hex, str) or not _HEX64.fullmatch(self.hex):
            raise ValueError("BodyDigest.hex must be 64 lowercase hex")

    @classmethod
    def mac(cls, hex_mac: str) -> BodyDigest:
        """The body's MAC (`BodyMac.of`): what the pipeline records."""
        return cls(kind=BodyKind.MAC, hex=hex_mac)


#: The body members a line may carry, exactly one of them (`AuditRecord.from_json_obj`).
_BODY_MEMBERS: Final[Mapping[str, BodyKind]] = {kind.value: kind for kind in BodyKind}


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditRecord:
    """What one audit line says (without its chain fields). Validated in construction.

    Fields:
        phase: INTENT before publishing, VERDICT for the answer.
        at: seconds since the epoch (written with millisecond precision, UTC).
        credential_id: `cred_` + 16 hex, the credential that authenticated.
        agent: 64 lowercase hex, the acting agent's pubkey.
        action: the wire action name, or None when the body named no valid action.
        request_id: the envelope's requestId (1-128 visible ASCII bytes).
        body: the request body's digest: its MAC (`bodyMac`) in every record written
            now; a record read from an older line may hold its sha256 (`bodySha256`).
        status: the verdict's status (VERDICT); None for INTENT.
        code: the verdict's error code, or None.
        events: event ids (64 hex): about to be published (INTENT) or published (VERDICT).
        replayed: the verdict was a replay from the ledger (nothing ran again).
        d_tag: 64 lowercase hex, the NIP-AE record a memory action (storage.*) touched,
            or None. The slug is never recorded: NIP-AE keeps it out of the clear, and the
            line member `dTag` is present only when this is set.
    """

    phase: Phase
    at: float
    credential_id: str
    agent: str
    action: str | None
    request_id: str
    body: BodyDigest
    status: Status | None
    code: ErrorCode | None
    events: tuple[str, ...] = ()
    replayed: bool = False
    d_tag: str | None = None

    def __post_init__(self) -> None:
        # Local errors (our bug): the pipeline builds records from values it has checked.
        if self.d_tag is not None and (not isinstance(self.d_tag, str)
                                       or not _HEX64.fullmatch(self.d_tag)):
            raise ValueError("AuditRecord.d_tag must be 64 lowercase hex or None")
        if not isinstance(self.phase, Phase):
            raise TypeError("AuditRecord.phase must be a Phase")
        if self.phase not in (Phase.INTENT, Phase.VERDICT):
            raise ValueError("AuditRecord.phase is intent or verdict (other kinds have types)")
        _check_who("AuditRecord", (self.at,), self.credential_id, self.agent, self.action)
        if not is_request_id(self.request_id):
            raise ValueError("AuditRecord.request_id must be a valid requestId")
        if not isinstance(self.body, BodyDigest):
            raise TypeError("AuditRecord.body must be a BodyDigest")
        if not isinstance(self.events, tuple) or len(self.events) > MAX_EVENTS or not all(
            isinstance(e, str) and _HEX64.fullmatch(e) for e in self.events
        ):
            raise ValueError("AuditRecord.events must be a tuple of 64-hex event ids")
        if not isinstance(self.replayed, bool):
            raise TypeError("AuditRecord.replayed must be a bool")
        if self.code is not None and not isinstance(self.code, ErrorCode):
            raise TypeError("AuditRecord.code must be an ErrorCode or None")
        if self.phase is Phase.INTENT:
            if self.status is not None or self.code is not None or self.replayed:
                raise ValueError("an intent record has no status, code or replay")
            return
        if not isinstance(self.status, Status):
            raise ValueError("a verdict record needs a Status")
        if self.status is Status.SUCCEEDED:
            if self.code is not None:
                raise ValueError("a succeeded verdict has no code")
        elif self.code is None or self.status not in PAIRING[self.code]:
            raise ValueError("the status/code pair is not allowed by the contract")

    @classmethod
    def from_json_obj(cls, obj: Mapping[str, object]) -> AuditRecord:
        """Read the content fields of a parsed line (chain fields are checked by `verify`).

        Raises:
            ValueError: a field is missing, extra or malformed (message names the field).
        """
        body_members = [name for name in _BODY_MEMBERS if name in obj]
        if len(body_members) != 1:
            raise ValueError("fields (bodyMac or bodySha256, exactly one)")
        [body_member] = body_members
        rest = set(obj) - {body_member}
        if rest != _FIELDS and rest != _FIELDS | {"dTag"}:
            raise ValueError("fields")
        if obj["v"] != FORMAT:
            raise ValueError("v")
        try:
            phase = Phase(obj["phase"])
            status = None if obj["status"] is None else Status(obj["status"])
            code = None if obj["code"] is None else ErrorCode(obj["code"])
        except ValueError:
            raise ValueError("phase/status/code") from None
        time_text, events = obj["time"], obj["events"]
        if not isinstance(time_text, str) or not isinstance(events, list):
            raise ValueError("time/events")
        try:
            return cls(
                phase=phase,
                at=_parse_time(time_text),
                credential_id=_member(obj, "credential", str),
                agent=_member(obj, "agent", str),
                action=_optional(obj, "action", str),
                request_id=_member(obj, "requestId", str),
                body=BodyDigest(kind=_BODY_MEMBERS[body_member],
                                hex=_member(obj, body_member, str)),
                status=status,
                code=code,
                events=tuple(events),
                replayed=_member(obj, "replayed", bool),
                d_tag=_member(obj, "dTag", str) if "dTag" in obj else None,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None


#: Every member of a line, exactly, but its one body member (`_BODY_MEMBERS`) and the
#: memory actions' `dTag` (docs/operations.md has the table).
_FIELDS: Final = frozenset({
    "v", "seq", "prev", "digest", "time", "phase", "credential", "agent", "action",
    "requestId", "status", "code", "events", "replayed",
})


def _canonical(obj: Mapping[str, object]) -> bytes:
    # ASCII only: the same object always has the same bytes, and no byte can end a line.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
        "ascii"
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class RefusalCount:
    """Refusals past a credential's burst, counted instead of written one by one.

    Every one of them is still in the ledger under (agent, requestId) with its digest and
    verdict (spec I3); this line says how many the audit log did not list, and when.

    Fields:
        at: when the count was written; since: when the first counted refusal was answered.
        credential_id, agent, action, code: what every counted refusal shares.
        count: how many (at least 1).
    """

    at: float
    since: float
    credential_id: str
    agent: str
    action: str | None
    code: ErrorCode
    count: int

    @property
    def phase(self) -> Phase:
        return Phase.REFUSALS

    def __post_init__(self) -> None:
        _check_who("RefusalCount", (self.at, self.since), self.credential_id, self.agent,
                   self.action)
        if not isinstance(self.code, ErrorCode) or Status.FAILED not in PAIRING[self.code]:
            raise ValueError("RefusalCount.code must be an ErrorCode allowed with failed")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError("RefusalCount.count must be a positive int")

    @classmethod
    def from_json_obj(cls, obj: Mapping[str, object]) -> RefusalCount:
        """Read a `refusals` line's content fields. Raises ValueError naming the field."""
        if set(obj) != _REFUSAL_FIELDS or obj["v"] != FORMAT or obj["status"] != "failed":
            raise ValueError("fields")
        try:
            code = ErrorCode(obj["code"])
        except ValueError:
            raise ValueError("code") from None
        time_text, since_text = obj["time"], obj["since"]
        if not isinstance(time_text, str) or not isinstance(since_text, str):
            raise ValueError("time/since")
        try:
            return cls(at=_parse_time(time_text), since=_parse_time(since_text),
                       credential_id=_member(obj, "credential", str),
                       agent=_member(obj, "agent", str),
                       action=_optional(obj, "action", str),
                       code=code, count=_member(obj, "count", int))
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None


#: Most targets (channels, d tags) one `reads` line lists: a line stays a few KiB, far
#: below MAX_LINE_BYTES; a key with more is written as several lines.
MAX_READ_TARGETS: Final = 64
_TARGET_RE: Final = re.compile(
    r"[0-9a-f]{64}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadCount:
    """Reads that ran (channel.read, storage.address, storage.get), counted, not listed.

    A read has no effects and leaves no ledger record (issue 24): this line is what the
    host keeps of it. One per (credential, agent, action, status, code) per window
    (daemon/state/read_audit.py).

    Fields:
        at: when the count was written; since: when the first counted read was answered.
        credential_id, agent, action, status, code: what every counted read shares.
        count: how many (at least 1).
        targets: (target, count) pairs, sorted: the channel a channel.read read, or the
            NIP-AE d tag a storage.get read (never the slug); empty for storage.address.
            When not empty, the counts add up to `count`.
    """

    at: float
    since: float
    credential_id: str
    agent: str
    action: str
    status: Status
    code: ErrorCode | None
    count: int
    targets: tuple[tuple[str, int], ...] = ()

    @property
    def phase(self) -> Phase:
        return Phase.READS

    def __post_init__(self) -> None:
        _check_who("ReadCount", (self.at, self.since), self.credential_id, self.agent,
                   self.action)
        if not isinstance(self.action, str):
            raise ValueError("ReadCount.action must be a wire action name")
        if not isinstance(self.status, Status):
            raise ValueError("ReadCount.status must be a Status")
        if self.code is None:
            if self.status is not Status.SUCCEEDED:
                raise ValueError("ReadCount: a verdict other than succeeded has a code")
        elif not isinstance(self.code, ErrorCode) or self.status not in PAIRING[self.code]:
            raise ValueError("ReadCount: the status/code pair is not allowed by the contract")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError("ReadCount.count must be a positive int")
        if not isinstance(self.targets, tuple) or len(self.targets) > MAX_READ_TARGETS:
            raise ValueError(f"ReadCount.targets must be a tuple of at most {MAX_READ_TARGETS}")
        for pair in self.targets:
            if (not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], str)
                    or not _TARGET_RE.fullmatch(pair[0]) or isinstance(pair[1], bool)
                    or not isinstance(pair[1], int) or pair[1] < 1):
                raise ValueError("ReadCount.targets must be (channel id or d tag, count) pairs")
        if list(self.targets) != sorted(self.targets) or len(
                {t for t, _n in self.targets}) != len(self.targets):
            raise ValueError("ReadCount.targets must be sorted, each target once")
        if self.targets and sum(n for _t, n in self.targets) != self.count:
            raise ValueError("ReadCount: the targets' counts must add up to count")

    @classmethod
    def from_json_obj(cls, obj: Mapping[str, object]) -> ReadCount:
        """Read a `reads` line's content fields. Raises ValueError naming the field."""
        if set(obj) != _READ_FIELDS or obj["v"] != FORMAT:
            raise ValueError("fields")
        try:
            status = Status(obj["status"])
            code = None if obj["code"] is None else ErrorCode(obj["code"])
        except ValueError:
            raise ValueError("status/code") from None
        time_text, since_text, targets = obj["time"], obj["since"], obj["targets"]
        if not isinstance(time_text, str) or not isinstance(since_text, str):
            raise ValueError("time/since")
        if not isinstance(targets, dict):
            raise ValueError("targets")
        try:
            return cls(at=_parse_time(time_text), since=_parse_time(since_text),
                       credential_id=_member(obj, "credential", str),
                       agent=_member(obj, "agent", str), action=_member(obj, "action", str),
                       status=status, code=code, count=_member(obj, "count", int),
                       targets=tuple(sorted(targets.items())))
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Reanchor:
    """An operator accepted this log's head in place of the anchor it no longer reaches.

    Fields:
        at: when. anchored_seq, anchored_head: the anchor that was given up (what the log
        reached before, e.g., a disk was restored from an older backup). uid: who ran it.
    """

    at: float
    anchored_seq: int
    anchored_head: str
    uid: int

    @property
    def phase(self) -> Phase:
        return Phase.REANCHOR

    def __post_init__(self) -> None:
        _check_times("Reanchor", (self.at,))
        for number in (self.anchored_seq, self.uid):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise ValueError("Reanchor.anchored_seq and uid must be non-negative ints")
        if not isinstance(self.anchored_head, str) or not _HEX64.fullmatch(self.anchored_head):
            raise ValueError("Reanchor.anchored_head must be 64 lowercase hex")

    @classmethod
    def from_json_obj(cls, obj: Mapping[str, object]) -> Reanchor:
        """Read a `reanchor` line's content fields. Raises ValueError naming the field."""
        if set(obj) != _REANCHOR_FIELDS or obj["v"] != FORMAT:
            raise ValueError("fields")
        time_text = obj["time"]
        if not isinstance(time_text, str):
            raise ValueError("time")
        try:
            return cls(at=_parse_time(time_text),
                       anchored_seq=_member(obj, "anchoredSeq", int),
                       anchored_head=_member(obj, "anchoredHead", str),
                       uid=_member(obj, "uid", int))
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None


class KeyAction(enum.Enum):
    """Which key-custody command a `KeyEvent` is about."""

    BACKUP = "backup"
    RESTORE = "restore"
    ROTATE = "rotate"
    MIGRATE = "migrate"
    #: a restore the custodian ran under its own uid, recorded afterwards by the daemon's
    #: side from the custodian's names file (`agent import-names`): not a command of this
    #: uid's, so its intent comes after the keys were sealed (daemon/cli/agent.py)
    CUSTODIAN_RESTORE = "custodian-restore"
    #: `agent forget`: removed agents' records deleted (custody in the daemon; a
    #: custodian's `--forget-destroyed` writes its own log): the outcome names them
    FORGET = "forget"


class KeyStage(enum.Enum):
    """Where in its command a `KeyEvent` was written."""

    #: before anything is unsealed or sealed; written and fsynced, or the command stops
    INTENT = "intent"
    #: the command finished: what it moved
    DONE = "done"
    #: the command stopped on a fault: its one line
    FAILED = "failed"


#: Most pubkeys one key-event line lists (~67 bytes each, far below MAX_LINE_BYTES). A
#: command that moved more writes several `done` lines with the same `op` (`key_events`).
MAX_KEY_PUBKEYS: Final = 256
#: Most age recipients one backup may name (the line must stay far below MAX_LINE_BYTES).
MAX_KEY_RECIPIENTS: Final = 64
#: Longest file path or fault line a key event holds, and longest label or user name,
#: counted as written (JSON-escaped): with 256 pubkeys and 64 recipients a line stays
#: under half of MAX_LINE_BYTES.
MAX_KEY_TEXT: Final = 4096
MAX_KEY_LABEL: Final = 256

_OP_RE: Final = re.compile(r"[0-9a-f]{16}")
#: An age X25519 recipient: `age1` + 58 bech32 characters (custody checks the checksum).
AGE_RECIPIENT_RE: Final = re.compile(r"age1[02-9ac-hj-np-z]{58}")

#: action -> the optional facts a line about it may carry (the others are null / empty).
_KEY_FACTS: Final[Mapping[KeyAction, frozenset[str]]] = {
    KeyAction.BACKUP: frozenset({"agents", "pubkeys", "file", "sha256", "recipients"}),
    KeyAction.RESTORE: frozenset({"agents", "pubkeys", "held", "file", "sha256"}),
    KeyAction.CUSTODIAN_RESTORE: frozenset({"agents", "pubkeys", "held", "file", "sha256"}),
    KeyAction.ROTATE: frozenset({"agents", "old_token", "old_kek", "new_token", "new_kek"}),
    KeyAction.MIGRATE: frozenset({"agents", "old_token", "old_kek", "new_token", "new_kek"}),
    KeyAction.FORGET: frozenset({"agents", "pubkeys"}),
}
#: Facts only an outcome knows: what was moved.
_KEY_DONE_ONLY: Final = frozenset({"agents", "pubkeys", "held"})


def text_fits(value: str, limit: int) -> bool:
    """`value` is not empty and takes at most `limit` bytes as a JSON string."""
    return bool(value) and len(json.dumps(value, ensure_ascii=True)) - 2 <= limit


def _check_text(kind: str, name: str, value: object, limit: int) -> None:
    if value is not None and (not isinstance(value, str) or not text_fits(value, limit)):
        raise ValueError(f"{kind}.{name} must be None or 1-{limit} bytes of JSON text")


class KeyFacts(TypedDict, total=False):
    """What a command adds to its key events: `KeyEvent`'s optional fields but `pubkeys`
    (the outcome lists those itself, split by `outcome_lines`)."""

    agents: int | None
    held: int | None
    file: str | None
    sha256: str | None
    recipients: tuple[str, ...]
    old_token: str | None
    old_kek: str | None
    new_token: str | None
    new_kek: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyEvent:
    """One line of the key-event log: a key-custody command's intent or its outcome.

    The commands that move agent keys across custody's edge (`keys backup`, `keys restore`,
    `keys rotate`, `keys migrate`) write one INTENT before anything is unsealed or sealed,
    then a DONE or FAILED line with the same `op`; so does `agent forget` before it deletes
    removed agents' records (its outcome: the records that went). Facts only, never a
    secret: there is no field that could hold one (an identity file's contents, a PIN, a
    key).

    Fields:
        at: seconds since the epoch. op: 16 lowercase hex, one per command run (pairs the
        intent with its outcome when two commands interleave). action, stage: see the enums.
        uid, user: the operator (user None when the uid has no passwd entry).
        agents: how many agents were moved (DONE only). pubkeys: their pubkeys (DONE
        only, at most MAX_KEY_PUBKEYS a line). held: restore: agents already held here.
        file, sha256: the backup file's path and the sha256 of its bytes.
        recipients: backup: the age recipients (public keys) it is encrypted to.
        old_token, old_kek, new_token, new_kek: rotate/migrate: token and KEK labels
        (an intent names what is known before custody runs; the outcome names all four).
        fault: FAILED only: the one line the command reported.
    """

    at: float
    op: str
    action: KeyAction
    stage: KeyStage
    uid: int
    user: str | None
    agents: int | None = None
    pubkeys: tuple[str, ...] = ()
    held: int | None = None
    file: str | None = None
    sha256: str | None = None
    recipients: tuple[str, ...] = ()
    old_token: str | None = None
    old_kek: str | None = None
    new_token: str | None = None
    new_kek: str | None = None
    fault: str | None = None

    @property
    def phase(self) -> Phase:
        return Phase.KEY

    def __post_init__(self) -> None:
        # Local errors (our bug): the commands build events from values they have checked.
        _check_times("KeyEvent", (self.at,))
        if not isinstance(self.op, str) or not _OP_RE.fullmatch(self.op):
            raise ValueError("KeyEvent.op must be 16 lowercase hex")
        if not isinstance(self.action, KeyAction) or not isinstance(self.stage, KeyStage):
            raise TypeError("KeyEvent.action/stage must be a KeyAction/KeyStage")
        for name in ("uid", "agents", "held"):
            number = getattr(self, name)
            if (number is not None or name == "uid") and (
                    isinstance(number, bool) or not isinstance(number, int) or number < 0):
                raise ValueError(f"KeyEvent.{name} must be a non-negative int")
        for name in ("file", "fault"):
            _check_text("KeyEvent", name, getattr(self, name), MAX_KEY_TEXT)
        for name in ("user", "old_token", "old_kek", "new_token", "new_kek"):
            _check_text("KeyEvent", name, getattr(self, name), MAX_KEY_LABEL)
        if self.sha256 is not None and (
                not isinstance(self.sha256, str) or not _HEX64.fullmatch(self.sha256)):
            raise ValueError("KeyEvent.sha256 must be 64 lowercase hex")
        if not isinstance(self.pubkeys, tuple) or len(self.pubkeys) > MAX_KEY_PUBKEYS or not all(
                isinstance(p, str) and _HEX64.fullmatch(p) for p in self.pubkeys):
            raise ValueError(f"KeyEvent.pubkeys must be a tuple of at most {MAX_KEY_PUBKEYS} "
                             "64-hex pubkeys")
        if not isinstance(self.recipients, tuple) or len(
                self.recipients) > MAX_KEY_RECIPIENTS or not all(
                isinstance(r, str) and AGE_RECIPIENT_RE.fullmatch(r) for r in self.recipients):
            raise ValueError(f"KeyEvent.recipients must be a tuple of at most "
                             f"{MAX_KEY_RECIPIENTS} age recipients (age1…)")
        allowed = _KEY_FACTS[self.action]
        present = {name for name in _KEY_OPTIONAL if getattr(self, name) not in (None, ())}
        if present - allowed:
            raise ValueError(f"KeyEvent: {self.action.value} has no {sorted(present - allowed)}")
        if self.stage is not KeyStage.DONE and present & _KEY_DONE_ONLY:
            raise ValueError("KeyEvent: agents, pubkeys and held are facts of a done outcome")
        if self.stage is KeyStage.DONE and self.agents is None:
            raise ValueError("KeyEvent: a done outcome says how many agents it moved")
        if self.agents is not None and len(self.pubkeys) > self.agents:
            raise ValueError("KeyEvent: more pubkeys than agents")
        if (self.fault is not None) != (self.stage is KeyStage.FAILED):
            raise ValueError("KeyEvent: a fault is what a failed outcome, and only it, carries")
        # A backup the custodian writes (its own recipients and file, chosen there) is
        # recorded before it is asked: its intent names neither; its outcome both.
        if self.action is KeyAction.BACKUP and not self.recipients and (
                self.file is not None or self.stage is KeyStage.DONE):
            raise ValueError("KeyEvent: a backup names its recipients")

    @classmethod
    def from_json_obj(cls, obj: Mapping[str, object]) -> KeyEvent:
        """Read a `key` line's content fields. Raises ValueError naming the field."""
        if set(obj) != _KEY_FIELDS or obj["v"] != FORMAT:
            raise ValueError("fields")
        try:
            action, stage = KeyAction(obj["event"]), KeyStage(obj["stage"])
        except ValueError:
            raise ValueError("event/stage") from None
        time_text, pubkeys, recipients = obj["time"], obj["pubkeys"], obj["recipients"]
        if not isinstance(time_text, str) or not isinstance(pubkeys, list) or not isinstance(
                recipients, list):
            raise ValueError("time/pubkeys/recipients")
        try:
            return cls(
                at=_parse_time(time_text), op=_member(obj, "op", str), action=action,
                stage=stage, uid=_member(obj, "uid", int), user=_optional(obj, "user", str),
                agents=_optional(obj, "agents", int), pubkeys=tuple(pubkeys),
                held=_optional(obj, "held", int), file=_optional(obj, "file", str),
                sha256=_optional(obj, "sha256", str), recipients=tuple(recipients),
                old_token=_optional(obj, "oldToken", str), old_kek=_optional(obj, "oldKek", str),
                new_token=_optional(obj, "newToken", str), new_kek=_optional(obj, "newKek", str),
                fault=_optional(obj, "fault", str),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None


#: The facts `_KEY_FACTS` governs (attribute names).
_KEY_OPTIONAL: Final = ("agents", "pubkeys", "held", "file", "sha256", "recipients",
                        "old_token", "old_kek", "new_token", "new_kek")


#: Anything the log holds: one line each.
Entry: TypeAlias = AuditRecord | RefusalCount | ReadCount | Reanchor | KeyEvent

_CHAIN_FIELDS: Final = frozenset({"v", "seq", "prev", "digest", "time", "phase"})
_REFUSAL_FIELDS: Final = _CHAIN_FIELDS | {
    "since", "credential", "agent", "action", "status", "code", "count"}
_READ_FIELDS: Final = _CHAIN_FIELDS | {
    "since", "credential", "agent", "action", "status", "code", "count", "targets"}
_REANCHOR_FIELDS: Final = _CHAIN_FIELDS | {"anchoredSeq", "anchoredHead", "uid"}
_KEY_FIELDS: Final = _CHAIN_FIELDS | {
    "op", "event", "stage", "uid", "user", "agents", "pubkeys", "held", "file", "sha256",
    "recipients", "oldToken", "oldKek", "newToken", "newKek", "fault"}

#: phase -> how its content is read (the table `_check_line` and `read_records` use).
_READERS: Final[Mapping[str, Callable[[Mapping[str, object]], Entry]]] = {
    Phase.INTENT.value: AuditRecord.from_json_obj,
    Phase.VERDICT.value: AuditRecord.from_json_obj,
    Phase.REFUSALS.value: RefusalCount.from_json_obj,
    Phase.READS.value: ReadCount.from_json_obj,
    Phase.REANCHOR.value: Reanchor.from_json_obj,
    Phase.KEY.value: KeyEvent.from_json_obj,
}


def _content(entry: Entry) -> dict[str, object]:
    if isinstance(entry, RefusalCount):
        return {
            "time": _utc_text(entry.at),
            "phase": Phase.REFUSALS.value,
            "since": _utc_text(entry.since),
            "credential": entry.credential_id,
            "agent": entry.agent,
            "action": entry.action,
            "status": Status.FAILED.value,
            "code": entry.code.value,
            "count": entry.count,
        }
    if isinstance(entry, ReadCount):
        return {
            "time": _utc_text(entry.at),
            "phase": Phase.READS.value,
            "since": _utc_text(entry.since),
            "credential": entry.credential_id,
            "agent": entry.agent,
            "action": entry.action,
            "status": entry.status.value,
            "code": None if entry.code is None else entry.code.value,
            "count": entry.count,
            "targets": dict(entry.targets),
        }
    if isinstance(entry, Reanchor):
        return {
            "time": _utc_text(entry.at),
            "phase": Phase.REANCHOR.value,
            "anchoredSeq": entry.anchored_seq,
            "anchoredHead": entry.anchored_head,
            "uid": entry.uid,
        }
    if isinstance(entry, KeyEvent):
        return {
            "time": _utc_text(entry.at),
            "phase": Phase.KEY.value,
            "op": entry.op,
            "event": entry.action.value,
            "stage": entry.stage.value,
            "uid": entry.uid,
            "user": entry.user,
            "agents": entry.agents,
            "pubkeys": list(entry.pubkeys),
            "held": entry.held,
            "file": entry.file,
            "sha256": entry.sha256,
            "recipients": list(entry.recipients),
            "oldToken": entry.old_token,
            "oldKek": entry.old_kek,
            "newToken": entry.new_token,
            "newKek": entry.new_kek,
            "fault": entry.fault,
        }
    return {
        "time": _utc_text(entry.at),
        "phase": entry.phase.value,
        "credential": entry.credential_id,
        "agent": entry.agent,
        "action": entry.action,
        "requestId": entry.request_id,
        entry.body.kind.value: entry.body.hex,
        "status": None if entry.status is None else entry.status.value,
        "code": None if entry.code is None else entry.code.value,
        "events": list(entry.events),
        "replayed": entry.replayed,
        # Only on memory actions' lines, so every other line keeps its member set.
        **({"dTag": entry.d_tag} if entry.d_tag is not None else {}),
    }


def _record_obj(record: Entry, *, seq: int, prev: str) -> dict[str, object]:
    return {"v": FORMAT, "seq": seq, "prev": prev, **_content(record)}


def _encode_line(record: Entry, *, seq: int, prev: str) -> bytes:
    """The canonical line bytes (without the newline) with `digest` filled in."""
    obj = _record_obj(record, seq=seq, prev=prev)
    obj["digest"] = _sha256(_canonical(obj))
    return _canonical(obj)


def _read_entry(obj: Mapping[str, object]) -> Entry:
    """The entry a parsed line holds. Raises ValueError naming what is wrong."""
    phase = obj.get("phase")
    reader = _READERS.get(phase) if isinstance(phase, str) else None
    if reader is None:
        raise ValueError("phase")
    entry: Entry = reader(obj)
    return entry


def _check_line(line: bytes) -> tuple[dict[str, object] | None, str | None]:
    """(parsed object, None) for a well-formed line, else (None, reason). No chain check."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None, "not a JSON object"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    if _canonical(obj) != line:
        return None, "not in canonical form (the line was edited)"
    try:
        _read_entry(obj)
    except ValueError as exc:
        return None, f"malformed record ({exc})"
    seq, prev, digest = obj["seq"], obj["prev"], obj["digest"]
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        return None, "malformed record (seq)"
    if not isinstance(prev, str) or not _HEX64.fullmatch(prev):
        return None, "malformed record (prev)"
    body = {k: v for k, v in obj.items() if k != "digest"}
    if digest != _sha256(_canonical(body)):
        return None, "digest does not match the record (the record was edited)"
    return obj, None


def is_audit_file_name(name: str) -> bool:
    """Is `name` an audit file's (`audit-NNNNNN.jsonl`), as this module writes them?"""
    return _FILE_RE.fullmatch(name) is not None


def audit_files(directory: Path) -> list[tuple[int, Path]]:
    """The audit files in `directory`, as (number, path), in chain order.

    Other names in the directory are ignored.
    """
    found = []
    for entry in os.scandir(directory):
        match = _FILE_RE.fullmatch(entry.name)
        if match is not None:
            found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


def _file_name(number: int) -> str:
    return f"audit-{number:06d}.jsonl"


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyResult:
    """What `verify` found.

    ok: every record checked out (and the head matched, when one was expected).
    records: how many records were checked before stopping.
    head: sha256 of the last good line (GENESIS when there is none).
    seq: the `seq` of that line (0 when there is none): with `head`, the pair an operator
        remembers and gives back as `contains`.
    file, line, reason: the first bad record (1-based line), or None when ok.
    torn_tail: the last file ends in a partial line without a newline (a crash mid-write;
        never acknowledged, dropped by the daemon's next open). Does not make ok False.
    """

    ok: bool
    records: int
    head: str
    seq: int = 0
    file: str | None = None
    line: int | None = None
    reason: str | None = None
    torn_tail: bool = False


def verify(path: Path | str, *, expect_head: str | None = None,
           anchor: tuple[int, str] | None = None, contains: tuple[int, str] | None = None,
           archived: bool = False) -> VerifyResult:
    """Check the chain of an audit directory, or of one audit file.

    A directory is checked whole: files numbered 1, 2, ... without a gap, the first
    record's `prev` is `GENESIS`, and every record chains to the one before, across files.
    A single file is checked on its own: its first `prev` is taken as given unless it is
    file number 1.

    Args:
        path: the audit directory (normally `<state>/audit`) or one `audit-NNNNNN.jsonl`.
        expect_head: a head hash remembered from before (the operator log's `audit.head`);
            a log whose last good line hashes to something else fails (tail removed).
        anchor: (seq, hash) the log must reach (the state database's anchor): record
            `seq` must hash to `hash`. The log may go on past it.
        contains: (seq, hash) an operator remembered (an `audit.head` line, or an earlier
            `verify`): checked as `anchor` is, with its own words. This is a transparency
            log's consistency check: the log still holds that head, everything after it
            chains from it, and the whole chain before it verifies from the start.
        archived: the oldest files were moved to an archive (docs/operations.md): the
            directory may start at any number, and its first record's `prev` is taken as
            given. The files present must still be consecutive.

    Raises:
        OSError: the path cannot be read (the CLI reports it).
    """
    path = Path(path)
    if path.is_dir():
        files = audit_files(path)
        first = files[0][0] if archived and files else 1
        for index, (number, file) in enumerate(files, start=first):
            if number != index:
                return VerifyResult(
                    ok=False, records=0, head=GENESIS, file=str(file), line=None,
                    reason=f"expected {_file_name(index)} here: an audit file is missing",
                )
        anchored = first == 1
    else:
        match = _FILE_RE.fullmatch(path.name)
        files = [(int(match.group(1)) if match else 0, path)]
        anchored = match is not None and int(match.group(1)) == 1

    # Records the chain must reach with a given hash, and what each is called in a fault.
    reached: list[tuple[tuple[int, str], str]] = []
    if anchor is not None:
        reached.append((anchor, "the anchored head"))
    if contains is not None:
        reached.append((contains, "the head given"))
    records, head, seq = 0, GENESIS, 0
    # Where checking starts: (0, GENESIS) for a whole log, else the first link present.
    start: tuple[int, str] = (0, GENESIS)
    torn = False
    for position, (_number, file) in enumerate(files):
        last_file = position == len(files) - 1
        with open(file, "rb") as handle:
            for lineno, raw in enumerate(handle, start=1):
                if not raw.endswith(b"\n"):
                    if last_file:
                        torn = True
                        break
                    return VerifyResult(ok=False, records=records, head=head, file=str(file),
                                        line=lineno, reason="partial line inside the chain")
                line = raw[:-1]
                obj, reason = _check_line(line)
                if obj is None:
                    return VerifyResult(ok=False, records=records, head=head, file=str(file),
                                        line=lineno, reason=reason)
                if records == 0 and not anchored:
                    # An unanchored single file: trust its first link, check the rest.
                    head, seq = str(obj["prev"]), _member(obj, "seq", int) - 1
                    start = (seq, head)
                if obj["prev"] != head:
                    return VerifyResult(
                        ok=False, records=records, head=head, file=str(file), line=lineno,
                        reason="prev does not chain to the record before it (a record was "
                               "removed, inserted or moved here, or the one before rewritten)",
                    )
                if obj["seq"] != seq + 1:
                    return VerifyResult(
                        ok=False, records=records, head=head, file=str(file), line=lineno,
                        reason=f"seq {obj['seq']} where {seq + 1} was expected",
                    )
                seq += 1
                records += 1
                head = _sha256(line)
                for (at, expected), what in reached:
                    if seq == at and head != expected:
                        return VerifyResult(
                            ok=False, records=records, head=head, seq=seq, file=str(file),
                            line=lineno, reason=f"record {seq} is not {what} (the log was "
                                                "rewritten from here, or replaced)",
                        )
    for (at, expected), what in reached:
        if at < start[0] or (at == start[0] and expected != start[1]):
            # Archived away (or a lone file): what is not here cannot be vouched for.
            return VerifyResult(
                ok=False, records=records, head=head, seq=seq, file=None, line=None,
                reason=f"{what} is record {at}, before the first record checked here "
                       f"({start[0] + 1}): it cannot be checked without the files before",
                torn_tail=torn,
            )
        if seq < at:
            return VerifyResult(
                ok=False, records=records, head=head, seq=seq, file=None, line=None,
                reason=f"the log ends at record {seq} but {what} is record {at} (records "
                       "were cut from the end, or a file was deleted)",
                torn_tail=torn,
            )
    if expect_head is not None and expect_head != head:
        return VerifyResult(
            ok=False, records=records, head=head, seq=seq, file=None, line=None,
            reason="the last record is not the expected head (records were removed from "
                   "the end, or the log was replaced)",
            torn_tail=torn,
        )
    return VerifyResult(ok=True, records=records, head=head, seq=seq, torn_tail=torn)


@dataclass(frozen=True, slots=True, kw_only=True)
class LogLine:
    """One line of the log as `read_records` yields it."""

    file: str
    line: int
    #: the entry, or None when the line is damaged (not well-formed, or torn)
    record: Entry | None
    #: the line's bytes without the newline (canonical JSON when `record` is not None)
    raw: bytes


def read_records(directory: Path | str) -> Iterator[LogLine]:
    """Every line of the log in order, for display (`audit show`).

    It checks each line's form and digest, not the chain (`verify` does that).

    Raises:
        OSError: a file cannot be read.
    """
    for _number, file in audit_files(Path(directory)):
        with open(file, "rb") as handle:
            for lineno, raw in enumerate(handle, start=1):
                record: Entry | None = None
                line = raw[:-1] if raw.endswith(b"\n") else raw
                if raw.endswith(b"\n"):
                    obj, _reason = _check_line(line)
                    if obj is not None:
                        record = _read_entry(obj)
                yield LogLine(file=file.name, line=lineno, record=record, raw=line)


# --------------------------------------------------------------------------- the writer


def _default_open(path: Path, flags: int) -> int:
    return os.open(path, flags, FILE_MODE)


class AuditLog:
    """The writer. Create with `AuditLog.open(directory, rotate_bytes=...)`; one per daemon."""

    def __init__(
        self,
        directory: Path,
        *,
        rotate_bytes: int,
        opener: Callable[[Path, int], int],
    ) -> None:
        # Private: use AuditLog.open(). State below is touched only by the flusher thread
        # (one at a time, under `_group`'s limiter) once open() has returned.
        self._dir = directory
        self._rotate_bytes = rotate_bytes
        self._opener = opener
        self._fd = -1
        self._number = 0
        self._size = 0  # bytes of the current file known durable
        self._seq = 0
        self._prev = GENESIS
        self._dirty = False  # a write failed: truncate to `_size` before the next one
        # (seq, hash) of the last fsynced record, as one tuple so another thread (the
        # ledger's flusher, writing the anchor) reads a consistent pair without a lock.
        self._durable: tuple[int, str] = (0, GENESIS)
        self._dir_fd = -1  # holds the flock that keeps a second writer out
        # A flush that raises instead of answering is a bug; its callers still fail closed.
        self._group: GroupCommit[Entry, None] = GroupCommit(
            self._write_batch, flush_failed=lambda: AuditUnavailable("audit flush failed")
        )
        self._closed = False
        # While the disk refuses, every batch fails the same way (a full disk: every
        # request): one line a minute per cause, then a count (the flusher's alone).
        self._write_faults = FaultLog(_log, "audit.unavailable", level=logging.ERROR)
        #: how many write+fsync batches ran; the benchmark reports records per batch.
        self.batches = 0
        #: the last batch failed (set by the flusher thread, read on the event loop): a
        #: record that is not written one by one (a read's count) must not be relied on
        #: until a write succeeds again (daemon/state/read_audit.py)
        self.failing = False

    @classmethod
    def open(
        cls,
        directory: Path | str,
        *,
        rotate_bytes: int = DEFAULT_ROTATE_BYTES,
        anchor: tuple[int, str] | None = None,
        lock_wait: float = 0.0,
        _opener: Callable[[Path, int], int] = _default_open,
    ) -> AuditLog:
        """Open (creating if needed) the audit directory and continue its chain.

        Args:
            directory: normally `<state>/audit`; created 0700 (an existing one is tightened).
            rotate_bytes: start a new file once the current one reaches this size.
            anchor: (seq, hash) the log must still reach (the state database's anchor);
                None when there is none yet. The records from it to the tail are checked.
            lock_wait: seconds to wait for another writer to let go of the log (0: do not
                wait; the daemon). A command that writes a few lines and closes (the
                key-event log) waits, so two commands run at once take turns.
            _opener: test seam — how a file is opened (path, os flags) -> fd. The
                descriptor must be the file at that path (every batch checks it is).

        Raises:
            AuditUnavailable: the directory or the last file cannot be opened or written,
                or the last complete record is damaged (run `buzz-broker audit verify`), or
                the log does not reach `anchor` (cut, deleted, replaced: `audit verify`,
                then restore it or `buzz-broker audit reanchor`), or another process holds
                the log (`busy` is then True). `detail` says which; the daemon must not start.
            ValueError: `rotate_bytes` below `MIN_ROTATE_BYTES` (a bug).
        """
        if isinstance(rotate_bytes, bool) or not isinstance(rotate_bytes, int):
            raise TypeError("rotate_bytes must be an int")
        if rotate_bytes < MIN_ROTATE_BYTES:
            raise ValueError(f"rotate_bytes must be at least {MIN_ROTATE_BYTES}")
        log = cls(Path(directory), rotate_bytes=rotate_bytes, opener=_opener)
        try:
            log._open_tail(lock_wait)
            if anchor is not None:
                _check_anchor(audit_files(log._dir), anchor, tail=log._durable)
        except OSError as exc:
            log._close_fd()
            raise _unavailable("open", exc, log._dir) from None
        except _Locked:
            log._close_fd()
            waited = f" (waited {lock_wait:g} s)" if lock_wait else ""
            detail = f"another process has the log open{waited} ({log._dir})"
            log_event(_log, "audit.unavailable", level=logging.ERROR, detail=detail)
            raise AuditUnavailable(detail, busy=True) from None
        except _Damaged as exc:
            log._close_fd()
            detail = f"{exc.args[0]}; run `buzz-broker audit verify`"
            log_event(_log, "audit.damaged", level=logging.ERROR, detail=detail)
            raise AuditUnavailable(detail) from None
        log_event(_log, "audit.head", seq=log._seq, head=log._prev, file=_file_name(log._number))
        return log

    @property
    def head(self) -> tuple[int, str]:
        """(seq, sha256) of the last durable record: anchor it elsewhere to detect truncation.

        Safe to read from any thread (the ledger's flusher writes it into the anchor).
        """
        return self._durable

    def _open_tail(self, lock_wait: float) -> None:
        try:
            os.mkdir(self._dir, DIR_MODE)
        except FileExistsError:
            pass
        info = os.stat(self._dir, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(20, "not a directory")
        if info.st_mode & 0o777 != DIR_MODE:
            os.chmod(self._dir, DIR_MODE)
        # One writer per log: a second daemon, or `audit reanchor` while one serves, would
        # fork the chain. The lock lives on the directory, so it needs no extra file.
        self._dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        deadline = time.monotonic() + lock_wait
        while True:
            try:
                fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # Polled, not a blocking flock: the wait must end at the deadline.
                if time.monotonic() >= deadline:
                    raise _Locked() from None
                time.sleep(_LOCK_POLL_SECONDS)
        files = audit_files(self._dir)
        # The newest non-empty file holds the tail; a trailing empty file (a crash right
        # after a rotation created it) is simply where writing continues.
        tail_line: bytes | None = None
        for number, path in reversed(files):
            tail_line = self._read_tail(path, truncate=number == files[-1][0])
            if tail_line is not None:
                break
        if tail_line is not None:
            obj, reason = _check_line(tail_line)
            if obj is None:
                raise _Damaged(f"the last audit record is damaged: {reason}")
            self._seq = _member(obj, "seq", int)
            self._prev = _sha256(tail_line)
            self._durable = (self._seq, self._prev)
        self._number = files[-1][0] if files else 1
        path = self._dir / _file_name(self._number)
        self._fd = self._opener(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        )
        self._size = os.fstat(self._fd).st_size
        if not files:
            _fsync_dir(self._dir)

    def _read_tail(self, path: Path, *, truncate: bool) -> bytes | None:
        """The last complete line of `path`, or None if it has none; drops a torn tail."""
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size == 0:
                return None
            start = max(0, size - MAX_LINE_BYTES)
            handle.seek(start)
            block = handle.read()
        cut = block.rfind(b"\n")
        if cut < 0:
            if start > 0:
                raise _Damaged(f"no line ending in the last {MAX_LINE_BYTES} bytes of {path.name}")
            complete_end = 0
        else:
            complete_end = start + cut + 1
        if complete_end < size:
            if not truncate:
                raise _Damaged(f"{path.name} ends in a partial line inside the chain")
            # A torn final line: its append never returned, so nobody was told it was
            # written. Dropping it is the only way the chain can continue.
            with open(path, "r+b") as handle:
                handle.truncate(complete_end)
                os.fsync(handle.fileno())
            log_event(_log, "audit.torn_tail_dropped", level=logging.WARNING,
                      file=path.name, bytes=size - complete_end)
        if complete_end == 0:
            return None
        body = block[:cut]
        previous = body.rfind(b"\n")
        if previous < 0 and start > 0:
            raise _Damaged(f"the last line of {path.name} is longer than {MAX_LINE_BYTES} bytes")
        return body[previous + 1:]

    # ------------------------------------------------------------------ appending

    async def append(self, record: Entry) -> None:
        """Write `record` durably (fsynced) at the end of the chain; return only then.

        Concurrent callers are batched (one write + fsync for many); order is the order of
        the calls.

        Raises:
            AuditUnavailable: it could not be written; it is not in the log.
            ValueError: a bug: an `AuditRecord` naming its body by anything but its MAC
                (lines are never written with an unkeyed digest again; module rules).

        Cancellation: a cancelled caller stops waiting, but its record may still be
        written by the batch it joined (the flush itself is shielded, because the other
        callers' durability depends on it).
        """
        if isinstance(record, AuditRecord) and record.body.kind is not BodyKind.MAC:
            raise ValueError("an audit record is written with its body's MAC (bodyMac)")
        if self._closed:
            raise AuditUnavailable("the audit log is closed")
        await self._group.submit(record)

    def _write_batch(self, batch: Sequence[Entry]) -> list[None | Failed]:
        # Worker thread. Writes `batch` in order, in as few write+fsync rounds as the
        # rotation size allows; the chain state moves only after an fsync succeeded.
        done = 0
        try:
            if self._dirty:
                os.ftruncate(self._fd, self._size)
                os.fsync(self._fd)
                self._dirty = False
            while done < len(batch):
                if self._size >= self._rotate_bytes:
                    self._rotate()
                self._check_identity()
                data = bytearray()
                seq, prev = self._seq, self._prev
                end = done
                while end < len(batch) and (not data or self._size + len(data) < self._rotate_bytes):
                    line = _encode_line(batch[end], seq=seq + 1, prev=prev)
                    data += line + b"\n"
                    seq, prev = seq + 1, _sha256(line)
                    end += 1
                self._dirty = True
                _write_all(self._fd, bytes(data))
                os.fsync(self._fd)
                self._dirty = False
                self._size += len(data)
                self._seq, self._prev = seq, prev
                self._durable = (seq, prev)
                self.batches += 1
                self.failing = False
                done = end
        except (OSError, _Replaced) as exc:
            where = self._dir / _file_name(self._number)
            detail = (f"audit file replaced: {exc.args[0]} ({where})" if isinstance(exc, _Replaced)
                      else _detail("write", exc, where))
            self.failing = True
            self._write_faults.record((detail,), detail=detail, lost=len(batch) - done)
            # Cut the failed round's bytes off now, before its callers hear "failed": a
            # short write can leave whole lines of their records, and should the process
            # die (or stop with no batch after this one) they would read back as valid,
            # chained records of verdicts the callers were told were not made.
            self._truncate_dirty()
            # Each caller raises its own exception, with the cause for the operator log.
            failed = [Failed(AuditUnavailable(detail)) for _ in batch[done:]]
            return [None] * done + failed
        return [None] * len(batch)

    def _truncate_dirty(self) -> bool:
        """Cut the file back to its last durable size if a write failed; True once clean.

        Flusher thread (or `aclose`, once no flush can run). If the cut itself fails,
        `_dirty` stays set, so the next batch (which cuts before it writes, failing closed
        if it cannot) or `aclose` tries again.
        """
        if not self._dirty or self._fd < 0:
            return not self._dirty
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError as exc:
            where = self._dir / _file_name(self._number)
            detail = _detail("truncate", exc, where)
            self._write_faults.record((detail,), detail=detail)
            return False
        self._dirty = False
        return True

    def _check_identity(self) -> None:
        """The path must still name the open file, and nothing else may link to it.

        A renamed, deleted or replaced file would take records nobody could find (or the
        verifier would read a different file than the one written): fail closed instead.
        """
        mine = os.fstat(self._fd)
        try:
            there = os.stat(self._dir / _file_name(self._number), follow_symlinks=False)
        except FileNotFoundError:
            raise _Replaced("the path no longer exists (renamed or deleted)") from None
        if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
            raise _Replaced("the path names another file than the one open")
        if mine.st_nlink != 1:
            raise _Replaced(f"the open file has {mine.st_nlink} links, not 1")

    def _rotate(self) -> None:
        # Open the next file first: if that fails, the current one stays in use and the
        # next batch tries again (the size still says "rotate").
        number = self._number + 1
        path = self._dir / _file_name(number)
        fd = self._opener(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                          | os.O_NOFOLLOW)
        try:
            _fsync_dir(self._dir)
        except OSError:
            os.close(fd)
            raise
        os.close(self._fd)
        self._fd, self._number, self._size = fd, number, 0
        log_event(_log, "audit.head", seq=self._seq, head=self._prev, file=_file_name(number),
                  rotated=True)

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)  # releases the flock
            self._dir_fd = -1

    async def aclose(self) -> None:
        """Stop accepting records, let a running flush finish, and close the file."""
        self._closed = True
        # Let queued records finish: their callers are waiting for a durable answer.
        while not self._group.idle:
            await trio.sleep(0.001)
        # A failed write whose cut failed too must not outlive us: its records' callers
        # were told they are not in the log (`_write_batch`). No flush can run now.
        if self._dirty and not await trio.to_thread.run_sync(self._truncate_dirty):
            log_event(_log, "audit.unavailable", level=logging.ERROR,
                      detail=(f"audit close: lines of a failed write may remain after byte "
                              f"{self._size} of {_file_name(self._number)}"),
                      fix="buzz-broker audit verify")
        if self._fd >= 0:
            log_event(_log, "audit.head", seq=self._seq, head=self._prev,
                      file=_file_name(self._number), closed=True)
        self._close_fd()


class _Damaged(Exception):
    """The tail cannot be continued safely (open refuses)."""


class _Locked(Exception):
    """Another open log (a process, or an object here) holds the directory's lock."""


class _Replaced(Exception):
    """The audit file's path no longer names the open file (`_check_identity`)."""


def _check_anchor(files: list[tuple[int, Path]], anchor: tuple[int, str], *,
                  tail: tuple[int, str]) -> None:
    """Raise `_Damaged` unless record `anchor[0]` hashes to `anchor[1]` and chains to `tail`.

    Reads only from the file that holds the anchored record onwards: the records before it
    are counted, not parsed (the chain up to the anchor was checked when it was written;
    `audit verify` checks it whole).
    """
    seq, head = anchor
    if seq == 0:
        if head != GENESIS:
            raise _Damaged("the anchor names record 0 with a hash other than GENESIS")
        return
    if tail[0] < seq:
        raise _Damaged(
            f"the log ends at record {tail[0]} but the anchored head is record {seq}: records "
            "were cut from the end or a file was deleted (restore it, or after a restore from "
            "backup run `buzz-broker audit reanchor`)")
    start = 0
    for index in range(len(files) - 1, -1, -1):
        first = _first_seq(files[index][1])
        if first is not None and first <= seq:
            start = index
            break
    else:
        raise _Damaged(f"no audit file holds the anchored record {seq}")
    expected: int | None = None
    current: str | None = None
    for _number, path in files[start:]:
        with open(path, "rb") as handle:
            for raw in handle:
                if not raw.endswith(b"\n"):
                    break  # open() truncated a torn tail; nothing else can end without one
                line = raw[:-1]
                if expected is None:
                    obj, reason = _check_line(line)
                    if obj is None:
                        raise _Damaged(f"the first record of {path.name} is damaged: {reason}")
                    expected = _member(obj, "seq", int)
                if expected < seq:
                    expected += 1
                    continue
                obj, reason = _check_line(line)
                if obj is None or obj["seq"] != expected or (
                        current is not None and obj["prev"] != current):
                    raise _Damaged(
                        f"{path.name}: record {expected} is damaged or does not chain "
                        f"({reason or 'seq/prev'}); the log was rewritten after the anchor")
                current = _sha256(line)
                if expected == seq and current != head:
                    raise _Damaged(
                        f"record {seq} is not the anchored head: the log was rewritten or "
                        "replaced (after a restore from backup run `buzz-broker audit reanchor`)")
                expected += 1
    if current != tail[1]:
        raise _Damaged("the records after the anchor do not lead to the log's last record")


def _first_seq(path: Path) -> int | None:
    """seq of the first record of `path`, or None when it has none that can be read."""
    with open(path, "rb") as handle:
        first = handle.readline(MAX_LINE_BYTES)
    if not first.endswith(b"\n"):
        return None
    obj, _reason = _check_line(first[:-1])
    return None if obj is None else _member(obj, "seq", int)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(directory: Path) -> None:
    # A new file's name is durable only once its directory is fsynced.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _detail(what: str, exc: OSError, where: Path) -> str:
    name = os.strerror(exc.errno) if exc.errno is not None else type(exc).__name__
    return f"audit {what} failed: {name} ({where})"


def _unavailable(what: str, exc: OSError, where: Path) -> AuditUnavailable:
    detail = _detail(what, exc, where)
    log_event(_log, "audit.unavailable", level=logging.ERROR, detail=detail)
    return AuditUnavailable(detail)
