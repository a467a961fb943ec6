"""The pipeline's client of the custodian: what the daemon uses of `custody.Custody`, over
the custodian's socket (custody/custodian/messages.py), with the same names, values and errors.

Theory of operation:
- Async calls (signing, NIP-44, NIP-AE, lifecycle) take a connection from a small pool
  (at most `POOL` at once: the custodian answers one request per connection at a time)
  and give it back after the answer. A connection whose call failed or was cancelled
  mid-way is closed, never reused: its framing state is unknown.
- Every async call has a deadline (`DEADLINES`, from its start, the wait for a pooled
  connection included): a custodian that accepts and never answers (hung, stopped, or
  still starting behind systemd's socket) fails the call with CustodianUnavailable
  instead of holding it, and the task waiting on it, forever.
- The record lookups the pipeline makes synchronously (`agent`, `agents`, `chain`,
  `records_version`: the broker checks liveness on every request, the directory reads
  owners and tags) answer from `records`, a snapshot of every record kept fresh by the
  custodian's records version (custody/custodian/records.py). In the daemon a task of
  its nursery keeps it (`records.run`) over one async connection of its own
  (`fetch_version`, `fetch_records`, each bounded by `LOOKUP_TIMEOUT`), so a read never
  waits on the socket; a command without that task asks over one blocking connection
  with the same timeout under a lock (`lookup`, `ask_version`, `ask_records`): one
  deadline for the whole request, connect to last byte, so a custodian that trickles its
  answer cannot hold the caller (and the lock) past it. Either way no token hop, a local
  round trip. A lifecycle call that got an answer returns after a
  fresh snapshot (`records.changed`).
- The custodian may die (a crash, SIGKILL) and come back (systemd `Restart=always`).
  Every fault of the connection is `CustodianUnavailable`, a `CustodyError`, so the
  pipeline answers `failed` + `internal` as for any custody fault (or `indeterminate`
  where a publish may already have happened: the broker's own rule). All idle
  connections are dropped then, and the next call connects afresh: that is the reconnect.
  A request is sent again on a fresh connection only when it certainly never arrived (the
  send itself failed) or is a lookup (no effect).
- Errors: unknown_agent -> UnknownAgent, unseal_failed -> UnsealFailed, custody and
  refused and rate_limited -> CustodyError (refused: `IntentRefused`), invalid ->
  ValueError, bad_message and internal -> CustodianUnavailable. An answer of another
  table version is CustodianUnavailable naming both versions: a custodian not restarted
  after an upgrade, not a broken table.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from buzzwire.nostr import SignedEvent, UnsignedEvent
from custody._errors import CustodyError, UnknownAgent, UnsealFailed
from custody._records import KeyRecord, MemoryAddress
from custody.custodian import messages
from custody.custodian.records import CustodianUnavailable, RecordCache

__all__ = ["BackupWritten", "CustodianClient", "CustodianUnavailable", "IntentRefused", "POOL",
           "CALL_TIMEOUT", "BACKUP_TIMEOUT", "DEADLINES", "LOOKUP_TIMEOUT",
           "request", "decode_reply", "unb64"]

#: Connections at once for async calls: the signing batcher makes one hop at a time, and
#: NIP-44 and lifecycle calls rarely overlap more than this.
POOL: Final = 8
#: Seconds a lookup may take before the pipeline gives up on the custodian.
LOOKUP_TIMEOUT: Final = 5.0
#: Seconds an async call may take, from its start. Far above any row's own time (a hop of
#: 100 signatures through the custodian is ~14 ms, a sequential one ~1 ms:
#: docs/performance.md), and above a restart behind systemd's socket (RestartSec=1s, then
#: the token login: the call waits in the backlog and is answered); a custodian that
#: answers nothing for this long is treated as gone (`failed` + `internal`).
CALL_TIMEOUT: Final = 10.0
#: The backup row unseals every live agent and encrypts the file: up to MAX_BACKUP_NAMES
#: keys, ~35 s at the custodian's measured unseal-and-sign rate (~1,900/s in process,
#: docs/performance.md); ten minutes leaves room for a slow token and disk and still ends a
#: `keys backup` against a custodian that never answers.
BACKUP_TIMEOUT: Final = 600.0
#: Each row's deadline as an async call (the records' own questions, `records_version` and
#: `agents`, go over their own connection, bounded by LOOKUP_TIMEOUT).
DEADLINES: Final = {op: BACKUP_TIMEOUT if op == "backup" else CALL_TIMEOUT
                    for op in messages.OPS}
#: The custody op names the metrics know (Custody.observe_token_calls), per table row.
_OP_NAMES: Final = {"sign": "sign", "sign_auth": "sign_auth", "memory_address": "memory_address",
                    "encrypt": "encrypt_to_owner", "decrypt": "decrypt_from_owner_pair",
                    "mint": "mint", "import": "import", "destroy": "destroy",
                    "attach_auth": "attach_auth"}
#: The rows that change a record: the snapshot is asked again after each (records.py).
_LIFECYCLE: Final = frozenset({"mint", "import", "destroy", "attach_auth"})


class IntentRefused(CustodyError):
    """The custodian refused the intent (a kind or shape outside its list, a pair other
    than agent-owner, AUTH for another relay, an import under an agent held there without
    that owner's own tag)."""


@dataclass(frozen=True, slots=True)
class BackupWritten:
    """What the custodian's `backup` row wrote: its file (the custodian's path), the
    sha256 of its bytes, the agents in it and the age recipients it is encrypted to."""

    file: str
    sha256: str
    agents: tuple[str, ...]
    recipients: tuple[str, ...]


class _NotDelivered(Exception):
    pass


#: What a broken connection raises: the call (or lookup) fails, the connection is closed.
_FAULTS: Final = (_NotDelivered, OSError, trio.BrokenResourceError, trio.ClosedResourceError,
                  messages.BadMessage, EOFError)


def _record(value: object) -> KeyRecord | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CustodianUnavailable("the custodian answered no record")
    tag = value["auth_tag"]
    return KeyRecord(pubkey=value["pubkey"], owner=value["owner"],
                     auth_tag=None if tag is None else tuple(tag),
                     created_at=value["created_at"], deleted_at=value["deleted_at"],
                     mint_ref=value["mint_ref"])


def _version(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CustodianUnavailable("the custodian answered no version")
    return value


def _records(value: object) -> list[KeyRecord]:
    if not isinstance(value, list):
        raise CustodianUnavailable("the custodian answered no records")
    try:
        return [r for r in map(_record, value) if r is not None]
    except (KeyError, TypeError, ValueError):  # a record missing a member or mistyped
        # Raised in the daemon's records task, where anything but a CustodyError would
        # end the daemon: the custodian broke the table, as any other bad answer.
        raise CustodianUnavailable("the custodian's records broke the table") from None


def _raise(code: str, message: str) -> None:
    if code == "unknown_agent":
        raise UnknownAgent(message)
    if code == "unseal_failed":
        raise UnsealFailed(message)
    if code == "refused":
        raise IntentRefused(message)
    if code == "invalid":
        raise ValueError(message)
    if code in ("custody", "rate_limited"):
        raise CustodyError(message)
    raise CustodianUnavailable(f"custodian: {message}")


# The pipeline's half of the table (custody/custodian/messages.py): the custodian never
# sends a request nor reads an answer, so these live here, out of its process; an answer
# is read by the same `messages.parse` as a request, with the same rules.
def request(op: str, **args: object) -> bytes:
    return messages.encode({"v": messages.VERSION, "op": op, "args": args})


def decode_reply(body: bytes) -> tuple[bool, object]:
    """(True, value) for an ok answer; (False, (code, message)) for an error answer."""
    value = messages.parse(body)
    if value.keys() == {"v", "ok"}:
        return True, value["ok"]
    error = value.get("error")
    if (value.keys() == {"v", "error"} and isinstance(error, dict)
            and error.keys() == {"code", "message"} and error["code"] in messages.ERROR_CODES
            and isinstance(error["message"], str)):
        return False, (error["code"], error["message"])
    raise messages.BadMessage("not an answer of the table")


def unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _unwrap(body: bytes) -> object:
    try:
        ok, value = decode_reply(body)
    except messages.OtherVersion as exc:  # not tampering: a custodian of another build
        raise CustodianUnavailable(
            f"the custodian speaks table version {exc.version}, this build {messages.VERSION}: "
            "restart the custodian after an upgrade (docs/install.md, 11)") from None
    except messages.BadMessage:
        raise CustodianUnavailable("the custodian's answer broke the table") from None
    if not ok:
        if not isinstance(value, tuple):  # decode_reply's error form: (code, message)
            raise CustodianUnavailable("the custodian's answer broke the table")
        _raise(str(value[0]), str(value[1]))
    return value


class CustodianClient:
    """The custody facade's daemon-facing surface, answered by the custodian process."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._idle: list[trio.SocketStream] = []
        self._limiter = trio.CapacityLimiter(POOL)
        self._sync: socket.socket | None = None
        self._sync_lock = threading.Lock()
        #: the records' async connection (only `records` uses it, one check at a time)
        self._fetcher: trio.SocketStream | None = None
        self._fetcher_connections = 0
        self._observer: Callable[[str, float], None] | None = None
        self._closed = False
        #: connects of the blocking lookup connection so far (a new one: maybe a new custodian)
        self.connections = 0
        #: the public records, as the pipeline reads them (records.py)
        self.records = RecordCache(self)

    @classmethod
    async def open(cls, path: Path) -> CustodianClient:
        """Connect and take the first snapshot of the records (async: the event loop is
        not held); CustodianUnavailable if no custodian answers there within
        LOOKUP_TIMEOUT."""
        client = cls(path)
        try:
            await client.records.refreshed()
        except BaseException:
            client.close()
            raise
        return client

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection (a command's lookups need no event loop to end)."""
        self._closed = True
        self._drop()
        if self._fetcher is not None:
            self._fetcher.socket.close()
            self._fetcher = None
        with self._sync_lock:
            if self._sync is not None:
                self._sync.close()
                self._sync = None

    def observe_token_calls(self, observer: Callable[[str, float], None] | None) -> None:
        self._observer = observer

    # --- transport ---------------------------------------------------------------------

    def _drop(self) -> None:
        for stream in self._idle:
            stream.socket.close()
        self._idle.clear()

    async def _exchange(self, stream: trio.SocketStream, frame: bytes,
                        tail: bytearray | None) -> bytes:
        try:
            await stream.send_all(frame)
            if tail is not None:
                await stream.send_all(tail)  # a memoryview of it is sent: no copy is made
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise _NotDelivered from None
        header = await _receive_exactly(stream, messages.HEADER.size)
        return await _receive_exactly(stream, messages.frame_length(header))

    async def _call(self, op: str, *, tail: bytearray | None = None, **args: object) -> object:
        if self._closed:
            raise CustodyError("custody is closed")
        frame = request(op, **args)
        started = time.monotonic()
        try:
            body = await self._round_trip(op, frame, tail)
        except BaseException:
            if op in _LIFECYCLE:
                # No answer (gone, hung, cancelled): it may have taken effect. Check at
                # once, without waiting here: what did not answer the call would not
                # answer the check either.
                self.records.expire()
            raise
        if self._observer is not None and op in _OP_NAMES:
            self._observer(_OP_NAMES[op], time.monotonic() - started)
        if op not in _LIFECYCLE:
            return _unwrap(body)
        try:
            value = _unwrap(body)
        except Exception:
            with contextlib.suppress(CustodyError):  # its own error is the one to tell
                await self.records.changed()
            raise
        # An answer: this pipeline's next read must show it (raises CustodianUnavailable
        # when no snapshot can be taken: done, but not shown).
        await self.records.changed()
        return value

    async def _round_trip(self, op: str, frame: bytes, tail: bytearray | None) -> bytes:
        """`frame` (and `tail`) sent on a pooled connection, the answer's body back, within
        DEADLINES[op] of the start (the wait for a connection included)."""
        with trio.move_on_after(DEADLINES[op]):
            async with self._limiter:
                for attempt in (1, 2):
                    stream = self._idle.pop() if self._idle else None
                    try:
                        if stream is None:
                            stream = await trio.open_unix_socket(str(self.path))
                        body = await self._exchange(stream, frame, tail)
                    except BaseException as exc:  # noqa: BLE001 - every way out closes it
                        if stream is not None:
                            stream.socket.close()
                        if isinstance(exc, _FAULTS):
                            self._drop()  # all of them lead to the same (dead) process
                            self.records.expire()
                            if attempt == 1 and (isinstance(exc, _NotDelivered)
                                                 or op in messages.LOOKUPS):
                                continue
                            raise CustodianUnavailable("the custodian is not answering") from None
                        raise
                    self._idle.append(stream)
                    return body
        # The deadline passed (its connection was closed above, as for any cancellation).
        self._drop()
        self.records.expire()
        raise CustodianUnavailable(f"the custodian did not answer {op} in time")

    async def _fetch(self, op: str, **args: object) -> tuple[object, object]:
        """One record-lookup request on the records' own async connection, its answer and
        which connection gave it. Bounded by LOOKUP_TIMEOUT; retried once on a fresh
        connection if the old one failed (lookups have no effect), not if it timed out (a
        custodian that does not answer would only make the retry wait as long again).
        Only `records` calls it, under its lock: one request at a time."""
        if self._closed:
            raise CustodyError("custody is closed")
        frame = request(op, **args)
        for attempt in (1, 2):
            try:
                with trio.fail_after(LOOKUP_TIMEOUT):
                    if self._fetcher is None:
                        self._fetcher = await trio.open_unix_socket(str(self.path))
                        self._fetcher_connections += 1
                    body = await self._exchange(self._fetcher, frame, None)
                break
            except BaseException as exc:  # noqa: BLE001 - every way out closes it
                if self._fetcher is not None:
                    self._fetcher.socket.close()
                    self._fetcher = None
                if isinstance(exc, trio.TooSlowError):
                    raise CustodianUnavailable(f"the custodian did not answer {op} in time"
                                               ) from None
                if isinstance(exc, _FAULTS):
                    if attempt == 1:
                        continue
                    raise CustodianUnavailable("the custodian is not answering") from None
                raise
        return _unwrap(body), ("async", self._fetcher_connections)

    def lookup(self, op: str, **args: object) -> object:
        """One request of a record-lookup row on the blocking connection, its answer as
        sent (lookups have no effect: retried once on a fresh connection)."""
        return self._lookup(op, **args)[0]

    def _lookup(self, op: str, **args: object) -> tuple[object, object]:
        """Each attempt has one deadline, LOOKUP_TIMEOUT from its start, over the connect,
        the send and every receive (a timeout per `recv` would let a custodian that sends a
        byte at a time hold the caller, and `_sync_lock`, for as long as it likes). A
        timeout is not retried, as in `_fetch`: a custodian that does not answer in time
        would only make the retry wait as long again."""
        if self._closed:
            raise CustodyError("custody is closed")
        if op not in ("records_version", "agent", "agents", "chain"):
            raise ValueError(f"{op} is not a record lookup")
        frame = request(op, **args)
        with self._sync_lock:
            for attempt in (1, 2):
                deadline = time.monotonic() + LOOKUP_TIMEOUT
                try:
                    if self._sync is None:
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        try:
                            _wait_until(sock, deadline)
                            sock.connect(str(self.path))
                        except OSError:
                            sock.close()
                            raise
                        self._sync = sock
                        self.connections += 1
                    _wait_until(self._sync, deadline)
                    self._sync.sendall(frame)  # its timeout bounds the whole send
                    header = _recv_exactly(self._sync, messages.HEADER.size, deadline)
                    body = _recv_exactly(self._sync, messages.frame_length(header), deadline)
                    connection = ("blocking", self.connections)
                    break
                except (OSError, EOFError, messages.BadMessage) as exc:
                    if self._sync is not None:
                        self._sync.close()
                        self._sync = None
                    if isinstance(exc, TimeoutError):
                        self.records.expire()
                        raise CustodianUnavailable(f"the custodian did not answer {op} in time"
                                                   ) from None
                    if attempt == 2:
                        self.records.expire()
                        raise CustodianUnavailable("the custodian is not answering") from None
        return _unwrap(body), connection

    # --- what `records` asks: blocking (a command's reads) or async (the daemon's task) ---

    def ask_version(self) -> tuple[int, object]:
        """The custodian's records version and the connection it came over (blocking)."""
        value, connection = self._lookup("records_version")
        return _version(value), connection

    def ask_records(self) -> list[KeyRecord]:
        """Every record the custodian holds, tombstones included, oldest first (blocking)."""
        return _records(self._lookup("agents", include_deleted=True)[0])

    async def fetch_version(self) -> tuple[int, object]:
        """As `ask_version`, over the async connection."""
        value, connection = await self._fetch("records_version")
        return _version(value), connection

    async def fetch_records(self) -> list[KeyRecord]:
        """As `ask_records`, over the async connection."""
        return _records((await self._fetch("agents", include_deleted=True))[0])

    # --- record lookups (synchronous, as Custody's: the snapshot, `records`) ------------

    def agent(self, pubkey: str, *, include_deleted: bool = False) -> KeyRecord | None:
        record = self.records.get(pubkey) if isinstance(pubkey, str) else None
        return record if record is not None and (include_deleted or record.live) else None

    def agents(self, *, include_deleted: bool = False) -> list[KeyRecord]:
        return self.records.all(include_deleted=include_deleted)

    def records_version(self) -> int:
        return self.records.version()

    def chain(self, pubkey: str) -> list[KeyRecord]:
        """The agent's record and its owners' held here, nearest first."""
        return self.records.chain(pubkey)

    # --- intents -----------------------------------------------------------------------

    async def sign_event(self, agent: str, unsigned: UnsignedEvent) -> SignedEvent:
        return (await self.sign_events([(agent, unsigned)]))[0]

    async def sign_events(self, requests: Sequence[tuple[str, UnsignedEvent]]) -> list[SignedEvent]:
        intents = []
        for agent, unsigned in requests:
            if not isinstance(unsigned, UnsignedEvent):
                raise TypeError("sign_events takes (agent, UnsignedEvent) pairs")
            if unsigned.pubkey != agent:
                raise ValueError("the event's pubkey is not the signing agent")
            intents.append({"signer": agent, "kind": unsigned.kind,
                            "created_at": unsigned.created_at,
                            "tags": [list(t) for t in unsigned.tags], "content": unsigned.content})
        if not intents:
            return []
        value = await self._call("sign", events=intents)
        return [SignedEvent.from_json_obj(e) for e in value]  # type: ignore[attr-defined]

    async def require_relay(self, relay_url: str) -> None:
        """Raise CustodyError unless the custodian signs AUTH for `relay_url` (its
        `[custodian] relay_url` and the daemon's `[relay] url` are two files' keys: one
        edited alone refuses every AUTH, which a relay that asks for it shows as a refused
        publish, the cause only in the custodian's journal)."""
        signs_for = await self._call("relay")
        if signs_for != relay_url:
            raise CustodyError(f"it signs AUTH only for {signs_for!r}, and [relay] url is "
                               f"{relay_url!r}: every AUTH would be refused; make them the "
                               "same ([custodian] relay_url in the custodian's file)")

    async def check_token(self) -> str:
        """The custodian's token works now (its `token` row: an answer at most a second
        old); the active KEK's label. CustodyError: why it does not, as custody says it."""
        value = await self._call("token")
        kek = value.get("kek") if isinstance(value, dict) else None
        if not isinstance(kek, str):
            raise CustodianUnavailable("the custodian's answer broke the table")
        return kek

    async def sign_auth(self, agent: str, relay_url: str, challenge: str, created_at: int
                        ) -> SignedEvent:
        value = await self._call("sign_auth", agent=agent, relay_url=relay_url,
                                 challenge=challenge, created_at=created_at)
        return SignedEvent.from_json_obj(value)  # type: ignore[arg-type]

    async def memory_address(self, agent: str, slug: str) -> MemoryAddress:
        value = await self._call("memory_address", agent=agent, slug=slug)
        return MemoryAddress(**value)  # type: ignore[arg-type]

    def _owner(self, agent: str) -> str:
        record = self.agent(agent)
        if record is None:
            raise UnknownAgent(agent)
        return record.owner

    async def encrypt_to_owner(self, agent: str, plaintexts: Sequence[bytes]) -> tuple[str, ...]:
        items = tuple(plaintexts)
        if not items:
            return ()
        value = await self._call("encrypt", agent=agent, peer=self._owner(agent),
                                 plaintexts=[messages.b64(p) for p in items])
        return tuple(value)  # type: ignore[arg-type]

    async def decrypt_from_owner_pair(self, agent: str, payloads: Sequence[str]
                                      ) -> tuple[bytes | None, ...]:
        items = tuple(payloads)
        if not items:
            return ()
        value = await self._call("decrypt", agent=agent, peer=self._owner(agent),
                                 payloads=list(items))
        return tuple(None if p is None else unb64(p) for p in value)  # type: ignore[attr-defined]

    async def mint_agent(self, *, owner: str, mint_ref: str | None = None) -> KeyRecord:
        return _record(await self._call("mint", owner=owner, mint_ref=mint_ref))  # type: ignore[return-value]

    async def import_agent(self, secret_text: bytearray, *, owner: str,
                           auth_tag: Sequence[str] | None = None) -> KeyRecord:
        # The secret crosses the socket once, as the raw tail of the frame (messages.TAILS):
        # sent from this bytearray, read into one by the custodian; no str or bytes of it.
        try:
            if not isinstance(secret_text, bytearray):
                raise TypeError("secret_text must be a bytearray (so it can be zeroed)")
            if not 0 < len(secret_text) <= messages.MAX_SECRET_BYTES:
                raise CustodyError("malformed secret: expected 64 hex digits or an nsec1 "
                                   "bech32 string")
            value = await self._call("import", tail=secret_text,
                                     secret_bytes=len(secret_text), owner=owner,
                                     auth_tag=None if auth_tag is None else list(auth_tag))
        finally:
            secret_text[:] = bytes(len(secret_text))
        return _record(value)  # type: ignore[return-value]

    async def destroy_agent(self, pubkey: str) -> KeyRecord:
        return _record(await self._call("destroy", pubkey=pubkey))  # type: ignore[return-value]

    async def attach_auth_tag(self, pubkey: str, tag: Sequence[str]) -> KeyRecord:
        return _record(await self._call("attach_auth", pubkey=pubkey, tag=list(tag)))  # type: ignore[return-value]

    async def backup(self, names: Mapping[str, tuple[str, str | None]]) -> BackupWritten:
        """Ask the custodian to write a backup of every live agent to its own recipients
        and directory (neither is ours to choose). `names`: pubkey -> (name, creator), the
        directory entries the backup carries."""
        if len(names) > messages.MAX_BACKUP_NAMES:
            raise CustodyError(f"a backup names at most {messages.MAX_BACKUP_NAMES} agents")
        value = await self._call("backup", names=[
            {"pubkey": pubkey, "name": name, "creator": creator}
            for pubkey, (name, creator) in names.items()])
        if not isinstance(value, dict) or value.keys() != {"file", "sha256", "agents",
                                                           "recipients"}:
            raise CustodianUnavailable("the custodian answered no backup")
        return BackupWritten(file=str(value["file"]), sha256=str(value["sha256"]),
                             agents=tuple(value["agents"]),
                             recipients=tuple(value["recipients"]))

    def __repr__(self) -> str:
        return f"CustodianClient({str(self.path)!r})"


async def _receive_exactly(stream: trio.SocketStream, count: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = await stream.receive_some(count - len(chunks))
        if not chunk:
            raise EOFError
        chunks += chunk
    return bytes(chunks)


def _wait_until(sock: socket.socket, deadline: float) -> None:
    """The socket's next blocking call may wait until `deadline` (time.monotonic), no
    longer; TimeoutError if it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _recv_exactly(sock: socket.socket, count: int, deadline: float) -> bytes:
    """`count` bytes, all received by `deadline` (TimeoutError otherwise)."""
    chunks = bytearray()
    while len(chunks) < count:
        _wait_until(sock, deadline)
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            raise EOFError
        chunks += chunk
    return bytes(chunks)
