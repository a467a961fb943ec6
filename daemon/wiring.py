"""Wiring: open custody, the stores, the audit log and the relay pool; build the pipeline.

Rules:
- This is the one module that builds and connects the daemon's components, and the one
  that closes them: `running` is an async context manager owning every resource and every
  background task (trio: its nursery owns them; `started()` of each long-lived task is
  awaited before the broker is handed out). Nothing here judges a request.
- A component that cannot open is one `StartupError` line for the operator (token, PIN,
  KEK, state directory, audit log, relay URL); nothing half-open is left behind.
- Order at exit (reverse of opening): the background tasks stop, the open refusal counts
  and the audit anchor are written while the audit log is still open, then the audit log,
  the stores and custody close, each shielded so a cancelled daemon still closes them.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Final

import trio

from buzzwire.contract import ACTIONS
from custody import CustodyError
from custody.custodian.client import CustodianClient

if TYPE_CHECKING:  # the facade loads the PKCS#11 binding: not where a custodian holds the keys
    from custody import Custody
from daemon.state.directory import AgentDirectory, DirectoryError
from daemon.state.audit import AUDIT_DIRNAME, AuditLog, AuditUnavailable
from daemon.pipeline.broker import Broker
from daemon.config import Config, ConfigError, require_relay
from daemon.hostkey import HostKeyError
from daemon.relay.cursor import CursorCodec
from daemon.state.audit_mac import BodyMac
from daemon.state.ledger import KeptLayout, KeptReason, Ledger
from daemon.state.sweep_clock import HOLD_SECONDS, SweepClock
from daemon.log import log_event
from daemon.metrics import Metrics
from daemon.pipeline.observer import ObserverIntake, ObserverQueue
from daemon.state.observer_seq import ObserverSeq
from daemon.state.ratelimit import RateLimiter
from daemon.relay.pool import RelayPool, RelayTimeouts
from daemon.relay.windows import WindowCache
from daemon.state.runtimes import RuntimeStore
from daemon.state import leftovers
from daemon.state.sign_watermarks import SignWatermarks
from daemon.state.sessions import LAST_USE_FLUSH_SECONDS, SessionStore

__all__ = ["running", "relay_pool", "StartupError", "SWEEP_INTERVAL_SECONDS"]

_log = logging.getLogger("buzz_broker.wiring")

#: How often the ledger's retention sweep runs (design.md: the database stays bounded).
SWEEP_INTERVAL_SECONDS: Final = 3600.0


class StartupError(Exception):
    """The daemon cannot start; the message is one line for the operator."""


def relay_pool(config: Config, custody: Custody | CustodianClient,
               observer: Callable[[str, str, float], None] | None = None) -> RelayPool:
    """The relay pool for `config`, authenticating each agent's connection through custody.

    Custody signs each AUTH itself, and its fault (CustodyError: the custodian gone or
    hung, the token not working) is not turned into the pool's `AuthNotSigned`: that would
    make it a failed AUTH, the relay's answer (`action_failed`), when it is this host's.
    It reaches the pool's caller as it is, and is answered as custody failing to sign the
    event itself: `failed` + `internal` (daemon/pipeline/broker.py, publisher.py).

    Raises:
        ValueError: the relay URL is refused (see daemon.relay.protocol.check_relay_url).
    """

    timeouts = RelayTimeouts(
        connect=config.relay.connect_timeout,
        ok=config.relay.ok_timeout,
        eose=config.relay.eose_timeout,
        idle_seconds=config.relay.idle_seconds,
    )
    if config.relay.url is None:  # no default relay (daemon/config.py)
        raise ValueError("[relay] url is not set")
    pool = RelayPool(config.relay.url, custody.sign_auth, timeouts=timeouts, observer=observer,
                     max_result_bytes=config.relay.max_result_bytes,
                     max_live_subscriptions=config.relay.max_live_subscriptions,
                     max_receive_bytes=config.relay.max_receive_bytes)
    if config.relay.read_window_bytes > 0 and config.relay.max_live_subscriptions > 0:
        pool.windows = WindowCache(pool, max_bytes=config.relay.read_window_bytes,
                                   idle_seconds=config.relay.idle_seconds)
    return pool


def _shielded(close: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """A close that still runs to the end when the daemon is being cancelled."""

    async def run() -> None:
        with trio.CancelScope(shield=True):
            await close()

    return run


@asynccontextmanager
async def running(
    config: Config,
    *,
    config_loader: Callable[[], Config] | None = None,
    checkpoint: Callable[[str], None] | None = None,
) -> AsyncIterator[Broker]:
    """Open custody, the stores and the relay pool, and the broker over them; close all on exit.

    Args:
      config: the loaded configuration.
      config_loader: re-reads the configuration on SIGHUP (policy only).
      checkpoint: called with the name of each step in `daemon.pipeline.publisher.CHECKPOINTS` as
        a request passes it. The crash tests kill the process there; production passes None.

    Raises:
      StartupError: one line naming what is wrong (token, PIN, KEK, state directory).
    """
    try:
        relay_url = require_relay(config)  # before the slow token login
    except ConfigError as exc:
        raise StartupError(str(exc)) from None
    state_dir = Path(config.state.dir)
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"state directory {state_dir}: {exc.strerror}") from None
    async with AsyncExitStack() as stack:
        custody: Custody | CustodianClient
        try:
            if config.custody.custodian_socket:
                # The keys are the custodian's (docs/custodian.md): no token here.
                try:
                    custody = await CustodianClient.open(Path(config.custody.custodian_socket))
                except CustodyError as exc:  # the line names where it asked
                    raise StartupError(f"custodian at {config.custody.custodian_socket}: "
                                       f"{exc}") from None
                # Its first snapshot is taken: from here on the records are read only from
                # the snapshot, which the nursery's `records.run` keeps (below).
                custody.records.tend()
            else:
                from custody import Custody  # loads the PKCS#11 binding: only when used

                custody = await Custody.open(config.pkcs11.token(), state_dir,
                                             config.pkcs11.cache(),
                                             records=config.custody.records())
        except CustodyError as exc:
            raise StartupError(str(exc)) from None
        stack.push_async_callback(_shielded(custody.aclose))
        if isinstance(custody, CustodianClient):
            try:
                await custody.require_relay(relay_url)
            except CustodyError as exc:
                raise StartupError(f"custodian at {config.custody.custodian_socket}: "
                                   f"{exc}") from None
        try:
            # With a custodian the key records are its answers: the keystore is not ours to
            # open. Without, a version-1 keystore's names are taken into the directory here.
            directory = AgentDirectory.open(
                state_dir, custody.records if isinstance(custody, CustodianClient) else None)
            stack.callback(directory.close)
            live = directory.agents()  # read now: an unreadable directory stops the start
        except DirectoryError as exc:
            raise StartupError(f"agent directory: {exc}") from None
        try:
            sessions = SessionStore.open(state_dir)
            stack.callback(sessions.close)
            ledger = Ledger.open(
                state_dir / "ledger.db",
                retention_seconds=config.state.ledger_retention_seconds,
                max_bytes_per_principal=config.state.ledger_max_bytes_per_agent,
                max_refusal_bytes_per_credential=(
                    config.state.ledger_max_refusal_bytes_per_credential),
            )
            stack.callback(ledger.close)
            if ledger.layout_kept is not None:
                _log_layout_kept(ledger.layout_kept)
            limiter = RateLimiter.open(state_dir, config.limits)
            stack.callback(limiter.close)
            cursors = CursorCodec.open(state_dir)
            body_mac = BodyMac.open(state_dir)
            runtimes = RuntimeStore.open(state_dir)
            stack.callback(runtimes.close)
            observer_seq = ObserverSeq.open(state_dir)
            stack.callback(observer_seq.close)
            watermarks = SignWatermarks.open(state_dir)
            stack.callback(watermarks.close)
        except (OSError, sqlite3.Error, HostKeyError) as exc:
            raise StartupError(f"state directory {state_dir}: {exc}") from None
        # What an older version or a prune that faulted left goes, as after each destroy.
        leftovers.housekeep(directory, watermarks, runtimes,
                            custodian=isinstance(custody, CustodianClient))
        try:
            audit = AuditLog.open(state_dir / AUDIT_DIRNAME, anchor=ledger.audit_anchor)
        except AuditUnavailable as exc:
            raise StartupError(f"audit log: {exc.detail or exc}") from None
        stack.push_async_callback(_shielded(audit.aclose))
        if ledger.audit_anchor is None and audit.head[0] > 0:
            # A ledger from before anchors, or one deleted: nothing to hold the log to.
            log_event(_log, "audit.anchor_adopted", level=logging.WARNING,
                      seq=audit.head[0], head=audit.head[1])
        # From here every ledger commit records the audit head it follows.
        ledger.anchor_audit(lambda: audit.head)

        metrics = Metrics(actions=ACTIONS)
        custody.observe_token_calls(metrics.token_call)

        try:
            relay = relay_pool(config, custody, observer=metrics.relay_round_trip)
        except ValueError as exc:
            raise StartupError(f"relay url: {exc}") from None
        observer = ObserverIntake(queue=ObserverQueue(config.observer, relay.publish),
                                  seq=observer_seq, clock=time.time)
        relay.watermarks = watermarks
        broker = Broker(
            config=config,
            custody=custody,
            directory=directory,
            sessions=sessions,
            ledger=ledger,
            relay=relay,
            cursors=cursors,
            limiter=limiter,
            audit=audit,
            body_mac=body_mac,
            runtimes=runtimes,
            watermarks=watermarks,
            config_loader=config_loader,
            metrics=metrics,
            checkpoint=checkpoint,
            observer=observer,
        )

        async def last_counts() -> None:
            # Before the audit log closes: the open refusal and read counts, then the anchor.
            await broker.refusals.flush(everything=True)
            await broker.reads.flush(everything=True)
            try:
                await ledger.anchor()
            except sqlite3.Error as exc:
                log_event(_log, "ledger.fault", level=logging.ERROR, step="anchor",
                          error=type(exc).__name__, detail=str(exc))

        stack.push_async_callback(_shielded(last_counts))
        async with trio.open_nursery() as nursery:
            if isinstance(custody, CustodianClient):
                # The records are read on every request, from the snapshot this task keeps
                # (custody/custodian/records.py): no request waits on the custodian's socket.
                await nursery.start(custody.records.run)
            await nursery.start(relay.run)
            await nursery.start(broker.signer.run)
            await nursery.start(limiter.flush_periodically)
            nursery.start_soon(_sweep_forever, ledger, metrics)
            nursery.start_soon(_flush_last_use_forever, sessions)
            await nursery.start(broker.refusals.run)
            await nursery.start(broker.reads.run)
            await nursery.start(observer.queue.run)
            log_event(_log, "broker.ready", agents=len(live), relay=relay_url)
            for record in live:
                if record.auth_tag is None:
                    # Its owner is a person whose key is not here: its events carry no
                    # NIP-OA tag until the owner signs one (`agent attach-auth`).
                    log_event(_log, "agent.auth_tag_missing", level=logging.WARNING,
                              agent=record.pubkey, owner=record.owner,
                              fix="buzz-broker agent attach-auth")
            try:
                yield broker
            finally:
                nursery.cancel_scope.cancel()


#: What `ledger.layout_kept` says for each reason the old layout stayed at start.
_LAYOUT_KEPT_WHY: Final[Mapping[KeptReason, str]] = {
    KeptReason.TOO_MANY_RECORDS: "too many records to move at start",
    KeptReason.NOT_ENOUGH_FREE_DISK: "not enough free disk to move the records",
}


def _log_layout_kept(kept: KeptLayout) -> None:
    """One WARNING at start: the ledger kept its WITHOUT ROWID table (daemon/state/ledger.py,
    `_migrate_rowid`), why, what that costs, and that a later start may still move it."""
    log_event(_log, "ledger.layout_kept", level=logging.WARNING, reason=kept.reason.value,
              records=kept.records, move_bytes=kept.move_bytes, free_bytes=kept.free_bytes,
              detail=(f"{_LAYOUT_KEPT_WHY[kept.reason]}: the ledger keeps its old table, which"
                      " works as before, a record over ~1 KB taking a 4 KiB page of its own;"
                      " it holds only records within retention, so a later start may move it"
                      " once fewer are kept"))


async def _sweep_forever(ledger: Ledger, metrics: Metrics) -> None:
    # The wall clock is believed only where a steady one would be (a clock read days
    # ahead would sweep records that have not expired): daemon/state/sweep_clock.py.
    clock = SweepClock(ledger.newest_record_time, wall=time.time)
    while True:
        reading = clock.read()
        if reading.hold_began:
            # Once per hold. The first round after a start measures from the newest record,
            # so a downtime looks the same: not a warning then.
            log_event(_log, "ledger.sweep_held",
                      level=logging.INFO if reading.since_open else logging.WARNING,
                      ahead=reading.held, believed_after=HOLD_SECONDS,
                      since="newest_record" if reading.since_open else "last_sweep")
        # A full disk, a lock held past the busy timeout or a damaged file fails this
        # round only: the requests still get their envelopes (docs/reliability.md), so the
        # daemon must not end over housekeeping. One line per round: the interval bounds
        # the rate, and the next round tries again.
        try:
            removed = await ledger.sweep(reading.now)
            if removed:
                log_event(_log, "ledger.swept", removed=removed)
            metrics.set_ledger_size(await ledger.count())
        except sqlite3.Error as exc:
            log_event(_log, "ledger.fault", level=logging.ERROR, step="sweep",
                      error=type(exc).__name__, detail=str(exc))
        await trio.sleep(SWEEP_INTERVAL_SECONDS)


async def _flush_last_use_forever(sessions: SessionStore) -> None:
    # Last use is noted in memory per request and written here, in a worker thread: the
    # commit's fsync, or a wait behind another writer, must not stop every request
    # (daemon/state/sessions). `SessionStore.close` writes the rest at shutdown.
    while True:
        await trio.sleep(LAST_USE_FLUSH_SECONDS)
        noted = sessions.take_last_use()
        if not noted:
            continue
        try:
            await trio.to_thread.run_sync(sessions.write_last_use, noted)
        except (OSError, sqlite3.Error) as exc:
            sessions.keep_last_use(noted)
            log_event(_log, "sessions.last_use_unwritten", level=logging.WARNING,
                      error=type(exc).__name__, detail=str(exc))
