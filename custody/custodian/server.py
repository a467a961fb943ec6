"""The custodian's server: one Unix socket, the pipeline's uid only, the message table only.

Theory of operation:
- Every connection's peer credentials (SO_PEERCRED, taken by the kernel at connect) are
  checked against `Settings.pipeline_uid` before a byte is read; another uid gets one
  `refused` answer and the connection is closed.
- A connection carries one request at a time: header, body (bounded by
  `messages.MAX_FRAME` before it is read), answer. The pipeline's client opens several
  connections for concurrency. A frame that breaks the table gets `bad_message` and the
  connection is closed: its state is unknown.
- Memory is bounded by `Settings.max_inflight_bytes`, not by connections: a frame's length
  is held from its header until its answer is sent (what is parsed from a request, and
  its answer, are a small multiple of it), and the one row whose answer its request does
  not bound, `agents` (every record), is answered one at a time.
- Each row of `messages.OPS` has one handler in `Custodian.HANDLERS`. The handlers call the
  in-process `custody.Custody` facade, which does the unsealing and the cryptography; what
  is added here is what a compromised pipeline must not decide: the closed list of event
  kinds and shapes (`intents`), the NIP-OA tag (custody adds it), the agent-owner pair for
  NIP-44, AUTH only for the configured relay, per-agent rate bounds and the hash-chained
  log (`ledger`).
- `token`: custody's check that the token works now (a hop), at most once per
  TOKEN_CHECK_SECONDS; the asks between get its answer.
- Error handling: custody's errors become their codes; anything else is `internal`, logged
  here by type name (and an OSError's errno name) only: its text could carry an argument.
- Write-ahead: a keystore change (mint, import, destroy, attach_auth) is an `intent` line,
  on disk, before custody is asked, then its outcome line naming the intent's seq: the
  change's own line, or `failed` (`_change`). A death between them leaves the intent, so
  no change is ever without a line; a request that changes nothing writes neither.
- A change made whose log line failed is owed (`SignLog`): until it is written every row
  but the lookups is refused (`custody`), so nothing more happens unrecorded.
- The log's lock is never waited for on the event loop (`appended`): a command beside it
  that is stopped holding the lock holds the rows that write a line, up to
  LOCK_WAIT_SECONDS each, never the lookups, a new connection or a SIGTERM.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket as stdsocket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

from buzzwire.nostr import UnsignedEvent
from custody import Custody, CustodyError, HeldOwner, KeyRecord, UnknownAgent, UnsealFailed
from custody._records import DEFAULT_MAX_RECORDS, RecordBound
from custody.custodian import intents, messages
from custody.custodian.backup import Bounds, TooSoon, write_backup
from custody.custodian.grace import Graveyard
from custody.custodian.ledger import RateBound, SignLog, failed_line, fault_name
from custody.custodian.messages import record_obj

__all__ = ["Settings", "Custodian", "serve", "record_bound"]

log = logging.getLogger("buzz_broker.custodian")

#: Connections at once: the pipeline's client keeps a few; more is a fault, refused.
MAX_CONNECTIONS: Final = 64
#: Ownership chains are at most this deep (the directory's depth bound is far below).
MAX_CHAIN: Final = 64
_PEERCRED = struct.Struct("3i")
#: A row's refusals, and its faults, are one log line per this many seconds, then a count:
#: a compromised pipeline could flood the unit's journal past its rate limit, which then
#: drops the lines that matter (the unseal door's warnings among them).
LINE_SECONDS: Final = 60.0
#: Seconds a row waits for the log's lock, which a command beside the custodian holds for
#: one append (milliseconds) unless it was stopped holding it: past this the row answers
#: `internal`, before the pipeline's own deadline (client.py CALL_TIMEOUT, 10 s) ends it.
LOCK_WAIT_SECONDS: Final = 5.0
#: Seconds between tries meanwhile (one flock call each).
LOCK_POLL_SECONDS: Final = 0.01
#: Seconds a `token` answer is given again, not asked anew: its hop queues beside the
#: signatures (with the token gone, ~0.6 s of logins: custody/_token.py LOGIN_ATTEMPTS),
#: so asks without end cost one a second; `status` reads an answer at most this old.
TOKEN_CHECK_SECONDS: Final = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    socket: Path
    pipeline_uid: int
    relay_url: str
    log_path: Path
    signatures_per_minute: int = 6000
    log_max_bytes: int = 64 * 1024 * 1024
    socket_mode: int = 0o660
    #: destroyed keys stay recoverable this long (custody/custodian/grace.py); 7 days
    destroy_grace_seconds: int = 7 * 86400
    #: records (live and destroyed) past which mint and import are refused: custody's
    #: bound, given to it at open (`record_bound`; <= messages.MAX_RECORDS)
    max_records: int = DEFAULT_MAX_RECORDS
    #: bytes of frames held at once, from header to answer (`Budget`; >= messages.MAX_FRAME)
    max_inflight_bytes: int = 32 * 1024 * 1024
    #: the `backup` row's recipients and directory ([backup]); none: the row is refused
    backup_recipients: tuple[str, ...] = ()
    backup_dir: Path | None = None
    #: its disk bound: files held and the least interval (custody/custodian/backup.py)
    backup_bounds: Bounds = Bounds()


def record_bound(settings: Settings) -> RecordBound:
    """Custody's record bound in the custodian (`Custody.open`), its refusal saying the way
    back here: this file's key, or forgetting destroyed records (custody/custodian/forget.py)."""
    return RecordBound(settings.max_records, remedy=(
        "raise [custodian] max_records or run `custodian FILE --forget-destroyed` (past "
        "their grace; naming keys, those now)"))


class Refused(Exception):
    """An intent outside what the custodian signs (answered `refused`)."""


Handler = Callable[["Custodian", Mapping[str, Any]], Awaitable[object]]


class Custodian:
    """Answers checked requests with custody. One per process."""

    def __init__(self, custody: Custody, settings: Settings) -> None:
        self.custody = custody
        self.settings = settings
        self.log = SignLog(settings.log_path, settings.log_max_bytes, wait=False)
        self.bound = RateBound(settings.signatures_per_minute)
        self.graveyard = Graveyard.beside(settings.log_path, settings.destroy_grace_seconds)
        self._backup_lock = trio.Lock()  # the row's bound check and its write are one step
        self._record_lock = trio.Lock()  # so is the record bound's check and its new record
        self.budget = Budget(settings.max_inflight_bytes)
        self.listing = trio.Lock()  # an `agents` answer (up to MAX_FRAME) built and sent
        self._token_lock = trio.Lock()  # one token check at a time; its waiters share it
        #: the last token check: (when, it worked, the KEK label or the fault's message)
        self._token_checked: tuple[float, bool, str] | None = None
        self._lines: dict[tuple[str, str], tuple[float, int]] = {}  # bounded by the table

    def _quiet(self, op: str, kind: str) -> int | None:
        """How many lines of (op, kind) were not written since its last; None: not now."""
        now = time.monotonic()
        last, count = self._lines.get((op, kind), (-LINE_SECONDS, 0))
        if now - last < LINE_SECONDS:
            self._lines[(op, kind)] = (last, count + 1)
            return None
        self._lines[(op, kind)] = (now, 0)
        return count

    def _owner_of(self, pubkey: str) -> str | None:
        record = self.custody.agent(pubkey)
        return None if record is None else record.owner

    def _spend(self, agents: Sequence[str]) -> None:
        counts: dict[str, int] = {}
        for agent in agents:
            counts[agent] = counts.get(agent, 0) + 1
        for agent, count in counts.items():
            # Held first: a bucket per key asked for would let a flood of others evict one.
            if self.custody.agent(agent) is None:
                raise UnknownAgent(agent)
            if not self.bound.take(agent, count):
                raise _RateLimited(agent)

    def _not_ahead(self, created_at: int) -> None:
        if created_at > time.time() + intents.MAX_FUTURE_SECONDS:
            raise Refused(f"created_at is more than {intents.MAX_FUTURE_SECONDS} s ahead "
                          "of the custodian's clock")

    def _pair(self, agent: str, peer: str) -> None:
        owner = self._owner_of(agent)
        if owner is None:
            raise UnknownAgent(agent)
        if peer != owner:
            raise Refused("NIP-44 is only between an agent and its recorded owner")

    # --- the handlers, one per row of messages.OPS ----------------------------------------

    async def records_version(self, args: Mapping[str, Any]) -> object:
        return self.custody.records_version()

    async def agent(self, args: Mapping[str, Any]) -> object:
        return record_obj(self.custody.agent(args["pubkey"],
                                             include_deleted=args["include_deleted"]))

    async def agents(self, args: Mapping[str, Any]) -> object:
        return [record_obj(r) for r in self.custody.agents(include_deleted=args["include_deleted"])]

    async def chain(self, args: Mapping[str, Any]) -> object:
        chain: list[object] = []
        record = self.custody.agent(args["pubkey"], include_deleted=True)
        while record is not None and len(chain) < MAX_CHAIN:
            chain.append(record_obj(record))
            record = self.custody.agent(record.owner, include_deleted=True)
        return chain

    async def relay(self, args: Mapping[str, Any]) -> object:
        return self.settings.relay_url

    async def token(self, args: Mapping[str, Any]) -> object:
        async with self._token_lock:
            checked = self._token_checked
            if checked is None or trio.current_time() - checked[0] >= TOKEN_CHECK_SECONDS:
                try:
                    works, said = True, await self.custody.check_token()
                except CustodyError as exc:  # custody's message: names no secret
                    works, said = False, str(exc)
                # Timed from its end: the asks that waited on it get it, however long it took.
                checked = self._token_checked = (trio.current_time(), works, said)
        _, works, said = checked
        if not works:
            raise CustodyError(said)
        return {"kek": said}

    async def _change(self, intent: dict[str, object], change: Callable[[], Awaitable[KeyRecord]],
                      line: Callable[[KeyRecord], dict[str, object]]) -> KeyRecord:
        """`change()` between its intent line (on disk first: a write that fails asks
        nothing) and its outcome: `line(record)`, or `failed` and the fault's type if it
        raises. The outcome names the intent's seq (lines of other rows come between)."""
        seq = await appended(self.log, [{"op": "intent", **intent}])
        try:
            record = await change()
        except Exception as exc:
            with contextlib.suppress(OSError):  # owed then; the answer is the refusal's
                await appended(self.log, [failed_line(seq, exc)], done=True)
            raise
        await appended(self.log, [{**line(record), "intent": seq}], done=True)
        return record

    def _room(self) -> None:
        # A mint-destroy loop would otherwise grow the keystore, the grace copies and the
        # `agents` answer (one frame) without end. Custody's own rule (`Custody.room`, which
        # its hop asks again), asked here first so a refusal writes no intent line.
        self.custody.room()

    async def mint(self, args: Mapping[str, Any]) -> object:
        async with self._record_lock:
            # A mint_ref used before answers its record again, from this read (at
            # max_records too: a retry is no new record): nothing is made, so no line.
            # Never through `mint_agent`, whose hop would make a key with no line if
            # `--forget-destroyed` dropped the record meanwhile.
            if args["mint_ref"] is not None and (
                    again := self.custody.minted(args["mint_ref"], args["owner"])) is not None:
                return record_obj(again)
            self._room()
            # Under an owner held here the new key's NIP-OA tag is the owner's signature: paid
            # from its bound, and said in the line: by the record, which says what custody
            # did (a `--recover` of the owner may land between this read and the hop).
            self._spend([] if self.custody.agent(args["owner"]) is None else [args["owner"]])
            # The key does not exist yet: the intent names what is known.
            record = await self._change(
                {"for": "mint", "owner": args["owner"], "mint_ref": args["mint_ref"]},
                functools.partial(self.custody.mint_agent, owner=args["owner"],
                                  mint_ref=args["mint_ref"]),
                lambda r: {"op": "mint", "agent": r.pubkey, "owner": r.owner,
                           **({"signed_by": r.owner} if r.auth_tag else {})})
        return record_obj(record)

    async def import_(self, args: Mapping[str, Any]) -> object:
        # args["secret"]: the frame's tail, a bytearray (`_connection`); custody zeroes it.
        # The caller knows that secret: no owner held here, or destroyed (`--recover` brings it
        # back), signs it a tag, else the caller signs "owned by" events past every check.
        if args["auth_tag"] is None and self.custody.agent(args["owner"],
                                                           include_deleted=True) is not None:
            raise Refused(f"owner {args['owner']} is an agent held (or destroyed) here: an "
                          "import under it needs the owner's own NIP-OA tag; mint one instead")
        async with self._record_lock:
            self._room()
            # Its pubkey is in the secret, which only custody parses: the intent names the owner.
            record = await self._change(
                {"for": "import", "owner": args["owner"]},
                functools.partial(self.custody.import_agent, args["secret"], owner=args["owner"],
                                  auth_tag=args["auth_tag"], held_owner=HeldOwner.REFUSE),
                lambda r: {"op": "import", "agent": r.pubkey, "owner": r.owner})
        return record_obj(record)

    async def destroy(self, args: Mapping[str, Any]) -> object:
        pubkey = args["pubkey"]
        async with self._record_lock:  # the copy, the destroy and its lines: one at a time
            try:
                copy = await self.custody.sealed_copy(pubkey)
            except UnknownAgent:  # destroyed already, or never held: answered from the record
                # alone, never by a call that changes one: a `--recover` may have revived
                # the key since, and only this custodian's destroys tombstone it again.
                if (held := self.custody.agent(pubkey, include_deleted=True)) is None:
                    raise
                if not held.live:
                    return record_obj(held)
                copy = await self.custody.sealed_copy(pubkey)
            # The copy is on disk before the key goes: a destroy is undone in the grace.
            self.graveyard.keep(pubkey, copy)
            record = await self._change(
                {"for": "destroy", "agent": pubkey},
                functools.partial(self.custody.destroy_agent, pubkey),
                lambda r: {"op": "destroy", "agent": r.pubkey})
        return record_obj(record)

    async def attach_auth(self, args: Mapping[str, Any]) -> object:
        pubkey, attach = args["pubkey"], functools.partial(
            self.custody.attach_auth_tag, args["pubkey"], args["tag"])
        async with self._record_lock:  # the check and the change: no twin slips between
            before = self.custody.agent(pubkey)
            # No change to make, so no line: answered from this read, not by `attach`, which
            # would change a key a `--recover` revived meanwhile, with no line.
            if before is None:
                raise UnknownAgent(pubkey)
            if before.auth_tag == tuple(args["tag"]):
                return record_obj(before)
            record = await self._change({"for": "attach_auth", "agent": pubkey}, attach,
                                        lambda r: {"op": "attach_auth", "agent": r.pubkey})
        return record_obj(record)

    async def sign(self, args: Mapping[str, Any]) -> object:
        planned = []
        owner_of = functools.cache(self._owner_of)  # a SQLite read per key, not per event
        for intent in args["events"]:
            signer, kind = intent["signer"], intent["kind"]
            self._not_ahead(intent["created_at"])
            fault = intents.check(signer, kind, intent["tags"], intent["content"], owner_of)
            if fault is not None:
                raise Refused(fault)
            planned.append((signer, UnsignedEvent(pubkey=signer, created_at=intent["created_at"],
                                                  kind=kind, tags=intent["tags"],
                                                  content=intent["content"])))
        self._spend([signer for signer, _ in planned])
        signed = await self.custody.sign_events(planned)
        await appended(self.log, [{"op": "sign", "agent": e.pubkey, "kind": e.kind,
                                   "id": e.id} for e in signed])
        return [e.to_json_obj() for e in signed]

    async def sign_auth(self, args: Mapping[str, Any]) -> object:
        if args["relay_url"] != self.settings.relay_url:
            # repr: the URL asked is the pipeline's text, and this line reaches the journal
            raise Refused(f"AUTH is signed only for {self.settings.relay_url!r}, the relay the "
                          f"custodian is configured with, not {args['relay_url']!r}")
        self._not_ahead(args["created_at"])
        self._spend([args["agent"]])
        event = await self.custody.sign_auth(args["agent"], self.settings.relay_url,
                                             args["challenge"], args["created_at"])
        await appended(self.log, [{"op": "sign_auth", "agent": event.pubkey,
                                   "kind": event.kind, "id": event.id}])
        return event.to_json_obj()

    async def memory_address(self, args: Mapping[str, Any]) -> object:
        address = await self.custody.memory_address(args["agent"], args["slug"])
        return {"author_pubkey": address.author_pubkey, "kind": address.kind,
                "d_tag": address.d_tag}

    async def encrypt(self, args: Mapping[str, Any]) -> object:
        self._pair(args["agent"], args["peer"])
        payloads = await self.custody.encrypt_to_owner(args["agent"], args["plaintexts"])
        await appended(self.log, [{"op": "encrypt", "agent": args["agent"],
                                   "count": len(payloads)}])
        return list(payloads)

    async def decrypt(self, args: Mapping[str, Any]) -> object:
        self._pair(args["agent"], args["peer"])
        opened = await self.custody.decrypt_from_owner_pair(args["agent"], args["payloads"])
        await appended(self.log, [{"op": "decrypt", "agent": args["agent"],
                                   "count": len(opened)}])
        return [None if p is None else messages.b64(p) for p in opened]

    async def backup(self, args: Mapping[str, Any]) -> object:
        # Recipients and directory are this process's configuration only (read at start,
        # never again: a file changed since is not what it runs): not in the row.
        if self.settings.backup_dir is None or not self.settings.backup_recipients:
            raise Refused("no backup is configured in the running custodian: it reads [backup] "
                          "from its file at start only; restart it after adding [backup]")
        async with self._backup_lock:
            written = await write_backup(
                self.custody, self.settings.backup_dir, self.settings.backup_recipients,
                {e["pubkey"]: {"name": e["name"], "creator": e["creator"]} for e in args["names"]},
                self.settings.backup_bounds, time.time())
        await appended(self.log, [{"op": "backup", "file": written.path.name,
                                   "sha256": written.sha256, "count": len(written.agents)}],
                       done=True)
        return {"file": str(written.path), "sha256": written.sha256,
                "agents": list(written.agents),
                "recipients": list(self.settings.backup_recipients)}

    HANDLERS: Mapping[str, Handler] = {
        "records_version": records_version, "agent": agent, "agents": agents, "chain": chain,
        "relay": relay, "token": token,
        "mint": mint, "import": import_, "destroy": destroy, "attach_auth": attach_auth,
        "sign": sign, "sign_auth": sign_auth, "memory_address": memory_address,
        "encrypt": encrypt, "decrypt": decrypt, "backup": backup,
    }

    async def _owed_first(self, op: str) -> None:
        """The log's owed lines written before a row that may add one, else it is refused."""
        try:
            await appended(self.log, [])
        except OSError as exc:
            if (quiet := self._quiet(op, "fault")) is not None:
                log.error("custodian refused %s: its log cannot be written: %s (%d not logged)",
                          op, fault_name(exc), quiet)
            raise CustodyError(
                f"the custodian's log cannot be written: {fault_name(exc)}") from None

    async def answer(self, request: messages.Request) -> bytes:
        """The answer frame to one checked request; never raises for custody's faults."""
        try:
            if request.op not in messages.LOOKUPS:
                await self._owed_first(request.op)
            return messages.reply_ok(await self.HANDLERS[request.op](self, request.args))
        except Refused as exc:
            if (quiet := self._quiet(request.op, "refused")) is not None:
                log.warning("custodian refused %s: %s (%d not logged)", request.op, exc, quiet)
            return messages.reply_error("refused", str(exc))
        except _RateLimited as exc:
            return messages.reply_error("rate_limited", f"agent {exc} is over its signing bound")
        except TooSoon as exc:  # the backup row's interval: a rate bound of its own
            return messages.reply_error("rate_limited", str(exc))
        except UnknownAgent as exc:
            return messages.reply_error("unknown_agent", exc.agent)
        except UnsealFailed as exc:
            return messages.reply_error("unseal_failed", exc.agent)
        except CustodyError as exc:
            return messages.reply_error("custody", str(exc))
        except (ValueError, TypeError) as exc:
            return messages.reply_error("invalid", str(exc))
        except Exception as exc:  # noqa: BLE001 - one answer, the process stays up
            if (quiet := self._quiet(request.op, "fault")) is not None:
                log.error("custodian fault in %s: %s (%d not logged)", request.op, fault_name(exc),
                          quiet)
            return messages.reply_error("internal", "custodian fault")


class _RateLimited(Exception):
    pass


async def appended(log: SignLog, entries: list[dict[str, object]], *,
                   done: bool = False) -> int:
    """`log.append(entries, done=done)` (a log opened with `wait=False`), tried again every
    LOCK_POLL_SECONDS while another writer holds its lock, so the event loop goes on
    meanwhile. The first try is made before any checkpoint: with the lock free, nothing
    (a cancellation) comes between a change and its line.

    Raises:
        BlockingIOError: the lock was still held after LOCK_WAIT_SECONDS; with `done` the
            lines are owed (`SignLog.append`), as for any write that fails.
        OSError: the write failed.
    """
    deadline = trio.current_time() + LOCK_WAIT_SECONDS
    while True:
        try:
            return log.append(entries, done=done)
        except BlockingIOError:
            if trio.current_time() >= deadline:
                raise
            if done:  # owed now: each try writes them first
                entries = []
        await trio.sleep(LOCK_POLL_SECONDS)


class Budget:
    """Bytes of frames held at once: a frame waits before its body is read until its
    length fits, and holds it until its answer is sent."""

    def __init__(self, total: int) -> None:
        self.free = total
        self._lot = trio.lowlevel.ParkingLot()

    @contextlib.asynccontextmanager
    async def held(self, count: int) -> AsyncIterator[None]:
        while self.free < count:
            await self._lot.park()
        self.free -= count
        try:
            yield
        finally:
            self.free += count
            self._lot.unpark_all()


def peer_uid(sock: trio.socket.SocketType) -> int:
    """The connecting process's uid, as the kernel recorded it at connect()."""
    raw = sock.getsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_PEERCRED, _PEERCRED.size)
    _pid, uid, _gid = _PEERCRED.unpack(raw)
    return int(uid)


async def _read_exactly(stream: trio.SocketStream, count: int) -> bytearray | None:
    """`count` raw bytes into a bytearray sized once (recv_into: no copy of them, and no
    bytes object of a secret tail, exists); None, zeroed, if the peer stops short."""
    buf = bytearray(count)
    view, got = memoryview(buf), 0
    try:
        while got < count:
            n = await stream.socket.recv_into(view[got:])
            if not n:
                buf[:] = bytes(count)
                return None
            got += n
    except BaseException:
        buf[:] = bytes(count)
        raise
    finally:
        view.release()
    return buf


async def _connection(custodian: Custodian, stream: trio.SocketStream,
                      active: list[int]) -> None:
    try:
        if active[0] > MAX_CONNECTIONS:
            await stream.send_all(messages.reply_error("refused", "too many connections"))
            return
        uid = peer_uid(stream.socket)
        if uid != custodian.settings.pipeline_uid:
            log.warning("custodian refused a peer of uid %d", uid)
            await stream.send_all(messages.reply_error("refused", "peer uid refused"))
            return
        while True:
            header = await _read_exactly(stream, messages.HEADER.size)
            if header is None:
                return
            if not await _exchange(custodian, stream, header):
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        return  # OSError: the raw recv_into (_read_exactly), as a peer that closed unread
    finally:
        active[0] -= 1
        await stream.aclose()


async def _exchange(custodian: Custodian, stream: trio.SocketStream, header: bytearray) -> bool:
    """One request: its body read once its length fits the budget, answered, the answer
    sent; False: close the connection."""
    try:
        length = messages.frame_length(header)
        async with custodian.budget.held(length):
            body = await _read_exactly(stream, length)
            if body is None:
                return False
            request = messages.decode_request(body)
            del body
            tail = messages.TAILS.get(request.op)
            if tail is None:
                alone = custodian.listing if request.op == "agents" else contextlib.nullcontext()
                async with alone:  # every record: the one answer its request does not bound
                    await stream.send_all(await custodian.answer(request))
                return True
            secret = await _read_exactly(stream, int(request.args[tail]))  # type: ignore[call-overload]
            if secret is None:
                return False
            try:
                answer = await custodian.answer(
                    messages.Request(request.op, {**request.args, "secret": secret}))
            finally:
                secret[:] = bytes(len(secret))
            await stream.send_all(answer)
            return True
    except messages.BadMessage as exc:
        await stream.send_all(messages.reply_error("bad_message", str(exc)))
        return False


def refuse_if_served(path: Path) -> None:
    """A socket file at `path` that someone answers on is another custodian's: never take it.
    Nor anything there that is no socket (a bind would fail, inside the nursery, unsaid)."""
    if path.exists() and not path.is_socket():
        raise CustodyError(f"{path} exists and is not a socket: move it, or name another "
                           "[custodian] socket")
    if path.is_socket():
        with stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM) as probe:
            if probe.connect_ex(str(path)) == 0:
                raise CustodyError(f"another custodian is listening on {path}")


async def serve(custodian: Custodian, *, inherited: stdsocket.socket | None = None,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on `custodian.settings.socket` until cancelled; started() once listening.

    `inherited`: the listening socket systemd bound (custody/custodian/activation.py); its
    owner and mode are the socket unit's, and it is neither bound nor removed here; one
    bound here is removed at the end while the path is still that socket."""
    path = custodian.settings.socket
    bound: int | None = None
    if inherited is not None:
        sock = trio.socket.from_stdlib_socket(inherited)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():
            path.unlink()  # a killed custodian's: nobody answered on it (`refuse_if_served`)
        sock = trio.socket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        old = os.umask(0o177)  # no moment where the socket is more open than its mode
        try:
            await sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, custodian.settings.socket_mode)
        bound = path.stat().st_ino
    sock.listen(MAX_CONNECTIONS)
    listener = trio.SocketListener(sock)
    active = [0]

    async def handle(stream: trio.SocketStream) -> None:
        active[0] += 1
        await _connection(custodian, stream, active)

    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(handle, [listener], handler_nursery=nursery)
    finally:
        custodian.log.close()
        with contextlib.suppress(OSError):
            if bound is not None and path.stat().st_ino == bound:
                path.unlink()
