"""`Custody`: the async facade the daemon and the CLI use. Intent-level calls only.

Theory of operation:
- `Custody.open` first hardens the process (`_process`: no core dumps, not dumpable, no
  same-uid ptrace), takes the state directory's lock shared (`_statelock`: no rotation
  runs meanwhile), opens the keystore, then logs in to the token (or joins the process's
  session) and finds and checks the active KEK (the keystore's record after a rotation,
  else the configured one). It unseals nothing: keys are opened lazily, one call at a
  time, so opening costs the same for 10 or 10,000 agents.
- With the unsealed-key cache on (`_cache`, off by default) a key unsealed once is reused
  from locked memory for a bounded time; off, every call unseals.
- Each call that needs a secret makes exactly one hop to the token worker (`_worker`), and
  inside that hop: read the sealed blob, unseal (authenticate, decrypt, re-derive and
  compare the pubkey), use the secret, wipe it. `sign_events` does a whole batch in one hop.
  Reading the blob inside the hop means a key destroyed a moment ago can never sign.
- Public checks that need no secret (does the agent exist, which owner tag does it carry,
  is the slug valid) run on the caller's thread before the hop, so bad requests never
  queue behind the token.
- Nothing returned is secret (events, pubkeys, records, d-tags, NIP-44 payloads), with one
  named exception: `decrypt_from_owner_pair` returns the plaintexts of the agent↔owner
  pair, which storage.get must hand to the agent. No conversation key ever leaves, and no
  call takes a peer: the owner is always custody's own record of the agent.

Errors: `CustodyError` and its two children (see _errors) for custody faults; ValueError or
TypeError for a caller's bug (a malformed pubkey, an event whose pubkey is not the agent's,
a foreign `auth` tag, a bad slug).
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from custody._errors import CustodyError, UnknownAgent
from custody._keystore import KeyRecord, Keystore, ReadIndex
from custody._nipae import MEMORY_KIND, MemoryAddress, check_slug, d_tag
from custody._nip44 import (
    MAX_PLAINTEXT,
    MIN_PLAINTEXT,
    NONCE_SIZE,
    DecryptFailed,
    conversation_key,
    decrypt,
    encrypt,
)
from custody._ownership import owned_through
from custody._records import CachePolicy, RecordBound
from buzzwire.nostr import SignedEvent, UnsignedEvent, is_hex64, require_pubkey
from custody._process import harden_process
from custody._activekek import active_kek, interrupted, recorded_kek
from custody._sealed import seal, unseal
from custody._statelock import StateLock
from custody._secp256k1 import is_xonly_pubkey, xonly_pubkey
from custody._secret import Secret, parse_secret_text, random_secret, wipe_bytes
from custody._signer import (
    OwnerTag, auth_event, make_owner_tag, owner_tag_fault, sign, with_owner_tag,
)
from custody._token import Token, TokenConfig
from custody._worker import in_token_worker

if TYPE_CHECKING:
    from custody._cache import UnsealedCache

T = TypeVar("T")

#: Most payloads one encrypt/decrypt call takes: NIP-BA's 256 observer frames. A call holds
#: the token worker for its whole batch, so the batch is bounded here, not by the caller.
MAX_PAYLOADS_PER_CALL = 256

__all__ = ["Custody", "HeldOwner"]

log = logging.getLogger("buzz_broker.custody")


def _require_owner_point(owner: str) -> None:
    """An owner must be a real x-only key: it signs NIP-OA tags and is the NIP-AE peer.

    A CustodyError, not a ValueError: the shape was already checked, and an owner that is
    64 hex digits but no curve point is bad operator input (`agent create --owner`), which
    the CLI shows as one line.
    """
    if not is_xonly_pubkey(bytes.fromhex(owner)):
        raise CustodyError(
            f"owner {owner} is not a secp256k1 x-only public key (no curve point has this x)"
        )


class HeldOwner(enum.Enum):
    """What `import_agent` does, given no `auth_tag`, when the owner is a live agent held
    here: the key's NIP-OA tag would be signed with that owner's key."""

    #: sign it: custody inside the daemon, whose importer can read every key here anyway
    SIGN = "sign"
    #: refuse it: the custodian, whose caller knows the imported key's secret and would
    #: carry the owner's attestation onto whatever it signs outside the custodian's checks
    REFUSE = "refuse"


class Custody:
    """Sealed agent keys under a PKCS#11 token. Create with `await Custody.open(...)`."""

    __slots__ = ("_token", "_keystore", "_index", "_closed", "_now", "_observer", "_lock",
                 "_cache", "_bound")

    def __init__(self, token: Token, keystore: Keystore, lock: StateLock,
                 cache: UnsealedCache | None, records: RecordBound, *,
                 _factory: object = None) -> None:
        if _factory is not _FACTORY:
            raise TypeError("use `await Custody.open(token_config, state_dir)`")
        self._token = token
        self._keystore = keystore
        self._bound = records
        #: the public reads' own read-only connection (see _keystore: never the writer's lock)
        self._index = ReadIndex(keystore.path)
        self._lock = lock
        self._cache = cache
        self._closed = False
        self._now: Callable[[], int] = lambda: int(time.time())
        self._observer: Callable[[str, float], None] | None = None

    # --- lifecycle -----------------------------------------------------------------

    @classmethod
    async def open(cls, token: TokenConfig, state_dir: Path,
                   cache: CachePolicy = CachePolicy(), *, exclusive: bool = False,
                   records: RecordBound = RecordBound()) -> Custody:
        """Log in, find and check the KEK (refusing one that could leave the token), open
        the keystore under `state_dir`. `cache` turns the unsealed-key cache on (`_cache`);
        `records` bounds the records mints and imports may make (`room`).
        `exclusive` holds the state lock alone (a command that must run with the custodian
        stopped: custody/custodian/keys.py's restore), so it refuses beside any other user.

        Raises:
            CustodyError: missing module or token, wrong PIN, no KEK, unsafe KEK, keystore
                unreadable, a rotation running, a configuration naming another token than
                the keys were moved to. The message names the fault and never a secret.

        First makes the process undumpable with core dumps off (`harden_process`): every
        process that opens custody (daemon, CLI, tests) will hold unsealed keys and the PIN.
        """
        harden_process()

        def work() -> Custody:
            # Log in before anything is written: a wrong PIN leaves no state directory.
            active = recorded_kek(token, Path(state_dir))
            opened = Token.open(token, active.kek_label)
            try:
                lock = (StateLock.exclusive if exclusive else StateLock.shared)(Path(state_dir))
                try:
                    keystore = Keystore.open(Path(state_dir))
                    meta = keystore.meta()
                    if active_kek(meta, token) != active:
                        keystore.close()
                        raise CustodyError("a key rotation finished while custody was "
                                           "opening; open it again")
                    left = interrupted(meta)
                    if left is not None:  # every agent works; the operator should finish
                        log.warning("an interrupted `keys rotate`/`keys migrate`: %s; run it "
                                    "again (daemon stopped) to finish", left)
                except BaseException:
                    lock.release()
                    raise
            except BaseException:
                opened.close()
                raise
            return cls(opened, keystore, lock, _cache_for(cache), records, _factory=_FACTORY)

        custody = await in_token_worker(work)
        log.info("custody open: token %r, keystore %s", token.token_label, custody._keystore.path)
        return custody

    async def aclose(self) -> None:
        """Release the token session (logged out when the process's last user closes) and
        the keystore. Idempotent."""
        if self._closed:
            return
        self._closed = True

        def work() -> None:
            try:
                if self._cache is not None:
                    self._cache.clear()
                self._token.close()
            finally:
                self._index.close()
                self._keystore.close()
                self._lock.release()

        await in_token_worker(work)

    async def __aenter__(self) -> Custody:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- public facts about the keys (no token call) ----------------------------------

    def agent(self, pubkey: str, *, include_deleted: bool = False) -> KeyRecord | None:
        """The agent key's public record (owner, tag, when made): None if unknown (or
        destroyed, unless include_deleted). Names and depth are the daemon's directory's."""
        self._check_open()
        if not is_hex64(pubkey):
            return None
        record = self._index.get(pubkey)
        if record is None or (not record.live and not include_deleted):
            return None
        return record

    def agents(self, *, include_deleted: bool = False) -> list[KeyRecord]:
        self._check_open()
        return self._index.all(include_deleted=include_deleted)

    def records_version(self) -> int:
        """A value that changes whenever any agent record may have changed, in this process
        or another (`agent remove` beside the daemon): a caller may keep `agent()` answers
        for as long as it stays the same. Costs no disk read."""
        self._check_open()
        return self._index.version()

    def room(self) -> None:
        """CustodyError, naming the bound and its way out, if the keystore holds `most`
        records (`RecordBound`), destroyed ones included. `_store` asks it in the hop; the
        custodian first, before its intent line. Another process's insert meanwhile (an
        `agent create` beside the daemon) can pass it by that one record."""
        self._check_open()
        bound = self._bound
        if self._index.count() >= bound.most:
            raise CustodyError(f"the keystore holds max_records ({bound.most}) records, "
                               f"destroyed ones included: {bound.remedy}")

    def minted(self, mint_ref: str, owner: str) -> KeyRecord | None:
        """The record a mint with `mint_ref` made for `owner`, destroyed or not; None if
        none did. Raises CustodyError if it was made for another owner."""
        self._check_open()
        return _made_for(self._index.by_mint_ref(mint_ref), owner)

    def _live(self, pubkey: str) -> KeyRecord:
        require_pubkey("agent", pubkey)
        record = self.agent(pubkey)
        if record is None:
            raise UnknownAgent(pubkey)
        return record

    # --- signing -------------------------------------------------------------------

    async def sign_event(self, agent: str, unsigned: UnsignedEvent) -> SignedEvent:
        """Sign `unsigned` as `agent`, adding the agent's NIP-OA owner tag (once) if it has one.

        Raises:
            UnknownAgent: no live agent `agent`.
            UnsealFailed: its sealed key did not open as that agent.
            ValueError: unsigned.pubkey != agent, or a foreign `auth` tag on the event.
        """
        return (await self.sign_events([(agent, unsigned)]))[0]

    async def sign_events(self, requests: Sequence[tuple[str, UnsignedEvent]]) -> list[SignedEvent]:
        """Sign many events (any agents) in one token hop. All or nothing: the first failure
        raises and no signature is returned. Same errors as `sign_event`."""
        self._check_open()
        planned: list[tuple[str, UnsignedEvent]] = []
        live = functools.cache(self._live)  # a SQLite read per agent, not per event
        for agent, unsigned in requests:
            if not isinstance(unsigned, UnsignedEvent):
                raise TypeError("sign_events takes (agent, UnsignedEvent) pairs")
            record = live(agent)
            if unsigned.pubkey != agent:
                raise ValueError("the event's pubkey is not the signing agent")
            planned.append((agent, with_owner_tag(unsigned, record.auth_tag)))
        if not planned:
            return []

        def work() -> list[SignedEvent]:
            # One unseal per run of one agent's events, not per event: observer.emit signs
            # up to 256 at once, and a TPM unseals in 8-15 ms (field-lab.md).
            signed: list[SignedEvent] = []
            for agent, run in itertools.groupby(planned, key=lambda pair: pair[0]):
                with self._unseal(agent) as secret:
                    signed.extend(sign(secret, unsigned) for _, unsigned in run)
            return signed

        return await self._hop("sign", work)

    async def sign_auth(
        self, agent: str, relay_url: str, challenge: str, created_at: int
    ) -> SignedEvent:
        """NIP-42 AUTH (kind 22242, tags relay and challenge) signed as `agent`."""
        self._check_open()
        record = self._live(agent)
        unsigned = auth_event(agent, relay_url, challenge, created_at, record.auth_tag)

        def work() -> SignedEvent:
            with self._unseal(agent) as secret:
                return sign(secret, unsigned)

        return await self._hop("sign_auth", work)

    async def memory_address(self, agent: str, slug: str) -> MemoryAddress:
        """NIP-AE address (author, kind 30174, d-tag) of `slug` for `agent`. K_c stays inside.

        Raises:
            UnknownAgent, UnsealFailed; CustodyError if the agent's stored owner is not a
            curve point (an agent stored before owners were checked); ValueError for a slug
            NIP-AE does not allow.
        """
        self._check_open()
        check_slug(slug)
        record = self._live(agent)
        # Agents stored before owners were checked as points may have one that is not: no
        # NIP-AE address exists for them, and that is custody's fault to report, not a bug.
        _require_owner_point(record.owner)

        def work() -> str:
            with self._unseal(agent) as secret:
                try:
                    return d_tag(secret, record.owner, slug)
                except ValueError:
                    # Belt and braces for the check above: the derivation's own refusal.
                    raise CustodyError(
                        f"no NIP-AE address for agent {agent}: the derivation refused its owner"
                    ) from None

        return MemoryAddress(author_pubkey=agent, kind=MEMORY_KIND, d_tag=await self._hop("memory_address", work))

    async def encrypt_to_owner(self, agent: str, plaintexts: Sequence[bytes]) -> tuple[str, ...]:
        """NIP-44 v2 payloads of `plaintexts` from `agent` to its recorded owner, in order.

        One unseal for the whole call, a fresh CSPRNG nonce per payload; the conversation
        key is derived and wiped inside the token hop. The owner is custody's own record of
        the agent, never an argument: no other pair can be addressed through this call.

        Raises:
            UnknownAgent, UnsealFailed; CustodyError for an owner that is no curve point;
            ValueError for a plaintext outside NIP-44's 1..65,535 bytes or more than
            MAX_PAYLOADS_PER_CALL of them; TypeError for a plaintext that is not bytes.
        """
        self._check_open()
        items = tuple(plaintexts)
        for plaintext in items:
            if not isinstance(plaintext, bytes):
                raise TypeError("encrypt_to_owner takes bytes plaintexts")
            if not MIN_PLAINTEXT <= len(plaintext) <= MAX_PLAINTEXT:
                raise ValueError("a NIP-44 plaintext is 1 to 65,535 bytes")
        record = self._owner_pair(agent, len(items))
        if not items:
            return ()
        nonces = [secrets.token_bytes(NONCE_SIZE) for _ in items]

        def work() -> tuple[str, ...]:
            key = self._pair_key(agent, record.owner)
            try:
                return tuple(encrypt(key, p, n) for p, n in zip(items, nonces, strict=True))
            finally:
                wipe_bytes(key)

        return await self._hop("encrypt_to_owner", work)

    async def decrypt_from_owner_pair(
        self, agent: str, payloads: Sequence[str]
    ) -> tuple[bytes | None, ...]:
        """The plaintexts of NIP-44 v2 `payloads` between `agent` and its recorded owner.

        Either party may have written them (the key is symmetric). A payload that does not
        open (another pair's, tampered, another version, not a payload) gives None in its
        place: to the caller that is an invalid record, never an error. One unseal per call.
        The caller verifies each event's signature before asking (NIP-44: validate, then
        decrypt).

        Raises:
            UnknownAgent, UnsealFailed; CustodyError for an owner that is no curve point;
            ValueError for more than MAX_PAYLOADS_PER_CALL payloads.
        """
        self._check_open()
        items = tuple(payloads)
        record = self._owner_pair(agent, len(items))
        if not items:
            return ()

        def work() -> tuple[bytes | None, ...]:
            key = self._pair_key(agent, record.owner)
            try:
                return tuple(_open_or_none(key, payload) for payload in items)
            finally:
                wipe_bytes(key)

        return await self._hop("decrypt_from_owner_pair", work)

    def _owner_pair(self, agent: str, count: int) -> KeyRecord:
        """The live agent's record, its owner checked as a NIP-44 peer (before any hop)."""
        if count > MAX_PAYLOADS_PER_CALL:
            raise ValueError(f"at most {MAX_PAYLOADS_PER_CALL} payloads per call")
        record = self._live(agent)
        _require_owner_point(record.owner)
        return record

    def _pair_key(self, agent: str, owner: str) -> bytes:
        """Inside the worker: the agent↔owner conversation key; the caller wipes it."""
        with self._unseal(agent) as secret:
            try:
                return conversation_key(secret, owner)
            except ValueError:
                raise CustodyError(
                    f"no NIP-44 key for agent {agent}: the derivation refused its owner"
                ) from None

    # --- agent lifecycle -----------------------------------------------------------

    async def mint_agent(self, *, owner: str, mint_ref: str | None = None) -> KeyRecord:
        """Make a new agent key for `owner`, seal it, store its record. Idempotent on
        `mint_ref`: a second call with the same mint_ref returns the first agent's record.

        The key comes from the kernel CSPRNG (see `_secret.random_secret`). When the owner
        is itself an agent held here, the agent's NIP-OA tag is signed now and stored.

        Raises:
            CustodyError: an owner that is no curve point; mint_ref already used for another
                owner; the record bound reached (`room`; a mint_ref made before is answered
                first); token or keystore faults.
            ValueError: a malformed owner or mint_ref.
        """
        self._check_open()
        require_pubkey("owner", owner)
        _require_owner_point(owner)
        if mint_ref is not None and (not isinstance(mint_ref, str) or not mint_ref):
            raise ValueError("mint_ref must be a non-empty str or None")

        def work() -> KeyRecord:
            existing = None if mint_ref is None else _made_for(
                self._keystore.by_mint_ref(mint_ref), owner)
            if existing is not None:
                return existing  # made before: nothing to say again
            with random_secret() as secret:
                made = self._store(secret, owner=owner, mint_ref=mint_ref, auth_tag=None)
            log.info("minted agent %s for owner %s", made.pubkey, owner)
            return made

        return await self._hop("mint", work)

    async def import_agent(
        self,
        secret_text: bytearray,
        *,
        owner: str,
        auth_tag: Sequence[str] | None = None,
        held_owner: HeldOwner = HeldOwner.SIGN,
    ) -> KeyRecord:
        """Seal an existing key: `secret_text` is 64 hex digits or `nsec1…`, zeroed here on
        every path (success, refusal, cancellation).

        `auth_tag`, if given, must be a NIP-OA tag by `owner` for this agent that verifies;
        without one, when the owner is a live agent held here, `held_owner` says whether
        its tag is signed or the import refused (checked inside the hop: a `--recover` of
        the owner beside a custodian cannot slip between a check and the signature).

        Raises:
            CustodyError: malformed secret, an owner that is no curve point, owner ==
                agent, an ownership cycle (the agent already owns the owner, directly or
                through its agents), agent already held (or
                tombstoned), an auth tag that does not verify, an owner held here under
                `HeldOwner.REFUSE`, the record bound reached (`room`); token or keystore
                faults.
            ValueError: a malformed owner.
        """
        # Zeroed on every way out, the early refusals included (the worker hop is never
        # abandoned, so this cannot race the parse that reads it).
        try:
            self._check_open()
            require_pubkey("owner", owner)
            _require_owner_point(owner)
            if not isinstance(secret_text, bytearray):
                raise TypeError("secret_text must be a bytearray (so it can be zeroed)")
            tag: OwnerTag | None = None
            if auth_tag is not None:
                items = tuple(auth_tag)
                if len(items) != 4 or not all(isinstance(item, str) for item in items):
                    raise CustodyError('auth tag must be ["auth", owner, conditions, sig]')
                tag = (items[0], items[1], items[2], items[3])

            def work() -> KeyRecord:
                with parse_secret_text(secret_text) as secret:
                    agent = xonly_pubkey(secret).hex()
                    if agent == owner:
                        raise CustodyError("owner equals the agent: an agent cannot own itself")
                    if owned_through(owner, agent, self._owner_of):
                        # A cycle would make the owner graph no tree: each agent could act
                        # for the other (and a lock order by ownership would deadlock).
                        raise CustodyError(
                            f"ownership cycle: {agent} already owns {owner}, directly or "
                            "through its agents; it cannot be owned by it"
                        )
                    existing = self._keystore.get(agent)
                    if existing is not None and existing.live:
                        raise CustodyError(f"agent {agent} is already held")
                    if existing is not None:
                        raise CustodyError(
                            f"agent {agent} was removed; its tombstone is kept, so it cannot be imported again"
                        )
                    fault = None if tag is None else owner_tag_fault(tag, agent=agent, owner=owner)
                    if fault is not None:
                        raise CustodyError(fault)
                    if (tag is None and held_owner is HeldOwner.REFUSE
                            and self._keystore.sealed_blob(owner) is not None):
                        raise CustodyError(f"owner {owner} is an agent held here: an import "
                                           "under it needs the owner's own NIP-OA tag")
                    return self._store(secret, owner=owner, mint_ref=None, auth_tag=tag)

            record = await self._hop("import", work)
        finally:
            if isinstance(secret_text, bytearray):
                secret_text[:] = bytes(len(secret_text))
        log.info("imported agent %s for owner %s", record.pubkey, owner)
        return record

    async def destroy_agent(self, pubkey: str) -> KeyRecord:
        """Remove the agent's sealed key; its public record stays as a tombstone.
        Destroying an already destroyed agent returns its tombstone.

        Raises:
            UnknownAgent: never held here.
        """
        self._check_open()
        require_pubkey("agent", pubkey)

        def work() -> KeyRecord | None:
            if self._cache is not None:
                self._cache.evict(pubkey)
            held = self._keystore.get(pubkey)
            if held is None or not held.live:  # destroyed already: its tombstone, no line
                return held
            tombstone = self._keystore.tombstone(pubkey, self._now())
            log.info("destroyed the key of agent %s (tombstone kept)", pubkey)
            return tombstone

        record = await self._hop("destroy", work)
        if record is None:
            raise UnknownAgent(pubkey)
        return record

    async def sealed_copy(self, pubkey: str) -> bytes:
        """The live agent's sealed blob, as stored (sealed under the KEK: no secret in it),
        for the custodian's destroy grace period (custody/custodian/server.py).

        Raises:
            UnknownAgent: no live agent with that key.
        """
        self._check_open()
        self._live(pubkey)

        def work() -> bytes | None:
            return self._keystore.sealed_blob(pubkey)

        blob = await self._hop("destroy", work)
        if blob is None:
            raise UnknownAgent(pubkey)
        return blob

    async def attach_auth_tag(self, pubkey: str, tag: Sequence[str]) -> KeyRecord:
        """Store an owner-made NIP-OA tag for a live agent whose owner signs elsewhere (a
        person): from then on every event the agent signs carries exactly this tag.

        Verified first: `["auth", owner, conditions, sig]`, the owner the agent's recorded
        owner, and the owner's BIP-340 signature over the agent's pubkey and conditions.

        Raises:
            UnknownAgent: no live agent with that key.
            CustodyError: a malformed tag, another owner, a signature that does not verify.
        """
        self._check_open()
        record = self._live(pubkey)
        items = tuple(tag)
        fault = owner_tag_fault(items, agent=pubkey, owner=record.owner)
        if fault is not None:
            raise CustodyError(fault)
        owner_tag: OwnerTag = (items[0], items[1], items[2], items[3])
        if record.auth_tag == owner_tag:
            return record  # held already: nothing to write or say again

        def work() -> KeyRecord | None:
            return self._keystore.set_auth_tag(pubkey, owner_tag, self._now())

        updated = await self._hop("attach_auth", work)
        if updated is None:
            raise UnknownAgent(pubkey)
        log.info("attached the owner's NIP-OA tag to agent %s", pubkey)
        return updated

    async def check_token(self) -> str:
        """Does the token work now? One hop of `Token.check` (no agent key touched); the
        active KEK's label. The custodian's `token` row, which bounds how often it asks.

        Raises:
            CustodyError: the token, its login or its KEK fails now; the message says which.
        """
        self._check_open()
        return await self._hop("check_token", self._token.check)

    def observe_token_calls(self, observer: Callable[[str, float], None] | None) -> None:
        """Call `observer(op, seconds)` after every token worker hop (for metrics).

        `op` is one of sign, sign_auth, memory_address, encrypt_to_owner,
        decrypt_from_owner_pair, mint, import, destroy, attach_auth, check_token; the
        observer sees names and durations only, never an argument.
        """
        self._observer = observer

    async def _hop(self, op: str, work: Callable[[], T]) -> T:
        started = time.monotonic()
        try:
            return await in_token_worker(work)
        finally:
            if self._observer is not None:
                self._observer(op, time.monotonic() - started)

    # --- inside the worker -------------------------------------------------------------

    def _unseal(self, agent: str) -> Secret:
        blob = self._keystore.sealed_blob(agent)
        if blob is None:
            raise UnknownAgent(agent)  # destroyed since the caller's check
        if self._cache is not None and self._cache.enabled:
            cached = Secret()
            if self._cache.get(agent, blob, cached):
                return cached
        secret = unseal(self._token, blob, agent)
        if self._cache is not None:
            self._cache.put(agent, blob, secret)
        return secret

    def _store(
        self,
        secret: Secret,
        *,
        owner: str,
        mint_ref: str | None,
        auth_tag: OwnerTag | None,
    ) -> KeyRecord:
        self.room()  # in the hop: this process's mints and imports pass it one at a time
        agent = xonly_pubkey(secret).hex()
        if agent == owner:
            raise CustodyError("owner equals the agent: an agent cannot own itself")
        if auth_tag is None and self._keystore.sealed_blob(owner) is not None:
            with self._unseal(owner) as owner_secret:
                auth_tag = make_owner_tag(owner_secret, owner, agent)
        blob = seal(self._token, secret, agent)
        now = self._now()
        record = KeyRecord(pubkey=agent, owner=owner, auth_tag=auth_tag, created_at=now,
                           deleted_at=None, mint_ref=mint_ref)
        self._keystore.insert(record, blob, now)
        return record

    def _owner_of(self, pubkey: str) -> str | None:
        """The recorded owner of a key held here (tombstones included), else None."""
        record = self._keystore.get(pubkey)
        return None if record is None else record.owner

    def _check_open(self) -> None:
        if self._closed:
            raise CustodyError("custody is closed")

    def __repr__(self) -> str:
        return f"Custody({self._token!r}, {self._keystore!r}, closed={self._closed})"


def _cache_for(policy: CachePolicy) -> UnsealedCache | None:
    """The unsealed-key cache `policy` asks for; None (and `_cache` never imported) when off."""
    if not policy.entries:
        return None
    from custody._cache import UnsealedCache

    return UnsealedCache(policy)


def _made_for(minted: KeyRecord | None, owner: str) -> KeyRecord | None:
    """`minted`, the record a mint_ref made, if it was made for `owner`."""
    if minted is not None and minted.owner != owner:
        raise CustodyError(f"mint_ref {minted.mint_ref!r} was used for another owner")
    return minted


def _open_or_none(key: bytes, payload: str) -> bytes | None:
    try:
        return decrypt(key, payload)
    except DecryptFailed:
        return None


_FACTORY = object()
