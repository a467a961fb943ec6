"""Rotation and migration: every agent resealed under a new KEK, in this token or another.

One machine for both (`rotate`): `keys rotate` targets a new KEK in the same token,
`keys migrate` the KEK a second token's configuration names. The secrets never leave
custody: each is unsealed by the source token and sealed by the target token inside the
one token worker, as a signature would be.

The steps, each a named checkpoint (`CHECKPOINTS`; the tests SIGKILL the process at each):
  planned            the target (token, KEK label) is recorded in the keystore
  new_kek            the target KEK exists in the target token and passed its checks
                     (generated where missing; a TPM's are operator-made, found by label)
  staged             every live agent's key resealed under it, in the `reseal` table
  verified           every staged blob opened again through the target token, its pubkey
                     re-derived (the same door, `_sealed.unseal`, that signing uses)
  swapped            ONE transaction: each agent's blob replaced by its staged one, the
                     active (token, KEK) recorded, the old one recorded as retiring
  old_kek_destroyed  the old KEK (both halves) destroyed in its token
Then the retiring record is cleared.

Why a crash anywhere leaves every agent usable: before `swapped` commits, every blob is
still the old one, under the old KEK, which nothing has touched; from the commit on, every
blob is a new one, under the new KEK, which was made and checked before. Blobs name their
KEK (format 2) and the keystore names the active token and KEK, so the daemon opens the
right one either way. A run after a crash finishes what is left: a retiring KEK recorded
means only its destruction is left, done once every live key has been sealed again under
the active KEK (whatever sealed a key after the crash, no key is under the KEK that goes:
`_finish`); a plan recorded means the
same target is used again (its KEK found, staging redone from scratch), unless the
operator names another with --new-kek-label (a warning names the planned one, unused).

Rules:
- It holds the state directory's lock EXCLUSIVELY (`_statelock`): the daemon and every
  other custody command must be stopped, and cannot start while it runs. A `Journal`
  records the run under that lock: a record written after its release would race a
  process starting then (the custodian's log would fork).
- Nothing is recorded or made before the source KEK (the one the agents are sealed under)
  has opened: a mistyped `[pkcs11] kek_label` leaves no plan and no new key (`_open_source`).
- Nothing is destroyed before the swap has committed, and only a KEK the keystore records
  as retiring (never the active one).
- A blob that does not open (any defence) stops the run before anything changes, naming
  the agent: rotation never drops an agent.
- Other keys in the token are not touched: rotation and migration move only the agents'
  KEK. The cursor MAC key is not a token key (`<state_dir>/cursor-mac.key`, daemon.relay.cursor):
  cursors stay valid across both. There is no audit MAC key (the audit log is a hash
  chain, daemon.state.audit).
- One state directory per KEK: destroying the old KEK breaks any other state directory
  that shares it (tests use one KEK label each).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
import sqlite3
from pathlib import Path

from custody._activekek import (
    ACTIVE_KEK,
    ACTIVE_TOKEN,
    PLAN_KEK,
    PLAN_TOKEN,
    RETIRING_KEK,
    RETIRING_TOKEN,
    ActiveKek,
    active_kek,
    require_configured,
)
from custody._errors import CustodyError, UnsealFailed
from custody._kekinit import destroy_kek, init_kek, kek_obtainable, kek_present
from custody._keystore import Keystore
from custody._sealed import seal, unseal
from custody._secret import Secret
from custody._statelock import StateLock
from custody._token import Token, TokenConfig, require_kek_label
from custody._worker import require_lock

__all__ = ["CHECKPOINTS", "ROTATION_CHECKPOINTS", "Journal", "RotationReport", "rotate"]

log = logging.getLogger("buzz_broker.custody")

CHECKPOINTS = ("planned", "new_kek", "staged", "verified", "swapped", "old_kek_destroyed")
ROTATION_CHECKPOINTS = CHECKPOINTS  # custody's surface name for them

@dataclass(frozen=True, slots=True)
class RotationReport:
    """What a run did. Public facts only."""

    agents: int
    old: ActiveKek
    new: ActiveKek
    seal: str
    destroyed: tuple[str, ...]
    #: "rotated", or "finished" (an interrupted run's last step was all that was left).
    outcome: str


class Journal(Protocol):
    """Records a run; each call is made holding the state lock. `begun` before anything
    changes (raising stops the run there), then `done` or `failed` with what ended it and
    whether the swap stands by then (`swapped`: True, every agent is sealed under the new
    KEK and the keystore names it active, the old one yet to go: a rerun finishes; False,
    nothing changed; None, the keystore could not say)."""

    def begun(self) -> None: ...
    def done(self, report: RotationReport) -> None: ...
    def failed(self, fault: Exception, *, swapped: bool | None) -> None: ...


class _Staging(Keystore):
    """The keystore with the rotation's own writes: custody_meta, and the `reseal` table
    (the staged blobs, swapped in by ONE transaction). Only a rotation opens it, holding
    the state directory's lock exclusively."""

    __slots__ = ()

    def set_meta(self, values: dict[str, str | None]) -> None:
        """Set (a str) or clear (None) each name, all in one transaction."""
        try:
            with self.transaction() as db:
                _write_meta(db, values)
        except sqlite3.Error as exc:
            raise CustodyError(f"keystore write failed: {exc}") from None

    def live_blobs(self) -> list[tuple[str, bytes]]:
        """(pubkey, sealed blob) of every live agent."""
        rows = self._query("SELECT pubkey, sealed FROM keys WHERE deleted_at IS NULL"
                           " ORDER BY pubkey")
        return [(pubkey, bytes(sealed)) for pubkey, sealed in rows]

    def stage(self, blobs: list[tuple[str, bytes]]) -> None:
        """Replace the staging table's contents with `blobs`, in one transaction."""
        try:
            with self.transaction() as db:
                db.execute("DELETE FROM reseal")
                db.executemany("INSERT INTO reseal (pubkey, sealed) VALUES (?, ?)", blobs)
        except sqlite3.Error as exc:
            raise CustodyError(f"keystore write failed: {exc}") from None

    def staged(self) -> list[tuple[str, bytes]]:
        rows = self._query("SELECT pubkey, sealed FROM reseal ORDER BY pubkey")
        return [(pubkey, bytes(sealed)) for pubkey, sealed in rows]

    def swap_staged(self, expected: list[tuple[str, bytes]], meta: dict[str, str | None],
                    now: int) -> None:
        """In ONE transaction: every live agent's blob becomes its staged blob, `meta` is
        set, the staging table emptied. `expected` is each live agent's blob the staged one
        was made from: if any differs, or an agent has no staged blob, nothing changes.

        Raises:
            CustodyError: the keystore changed since staging, or the write failed.
        """
        try:
            with self.transaction() as db:
                live = db.execute("SELECT pubkey, sealed FROM keys WHERE deleted_at IS NULL"
                                  " ORDER BY pubkey").fetchall()
                if [(p, bytes(b)) for p, b in live] != expected:
                    raise CustodyError("the keystore changed during the rotation; run it again")
                changed = db.execute(
                    "UPDATE keys SET sealed = (SELECT sealed FROM reseal"
                    " WHERE reseal.pubkey = keys.pubkey), updated_at = ?"
                    " WHERE deleted_at IS NULL"
                    " AND pubkey IN (SELECT pubkey FROM reseal)", (now,)).rowcount
                if changed != len(expected):
                    raise CustodyError("not every live agent has a resealed blob; run it again")
                _write_meta(db, meta)
                db.execute("DELETE FROM reseal")
        except sqlite3.Error as exc:
            raise CustodyError(f"keystore write failed: {exc}") from None
        # The old blobs are still in WAL frames: move the pages home and truncate the WAL.
        self._checkpoint_truncate()


def _write_meta(db: sqlite3.Connection, values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            db.execute("DELETE FROM custody_meta WHERE name = ?", (name,))
        else:
            db.execute("INSERT INTO custody_meta (name, value) VALUES (?, ?)"
                       " ON CONFLICT (name) DO UPDATE SET value = excluded.value", (name, value))


def rotate(source: TokenConfig, target: TokenConfig, state_dir: Path,
           new_kek: str | None = None,
           checkpoint: Callable[[str], None] | None = None,
           journal: Journal | None = None) -> RotationReport:
    """Reseal every live agent from `source`'s active KEK to a new KEK in `target`'s token.

    `target` is `source` for a rotation. `new_kek` names the new KEK (required where the
    token cannot generate keys and the operator made them); else an interrupted run's
    planned KEK is used again, else a rotation makes `<kek_label>-<8 hex>` and a migration
    uses `target.kek_label`. `checkpoint(name)` is
    called after each step (tests kill the process there). `journal`, if given, records
    the run under the lock (`Journal`).

    Raises:
        CustodyError: custody in use, a configuration that names the wrong token, a blob
            that does not open, a token that refuses a key; nothing is changed before the
            swap, and a later run finishes after it.
    """
    require_lock()
    lock = StateLock.exclusive(state_dir)
    try:
        keystore = _Staging.open(state_dir)
        try:
            if journal is not None:
                journal.begun()
            try:
                report = _rotate(keystore, source, target, new_kek, checkpoint or (lambda _: None))
            except Exception as fault:
                if journal is not None:
                    journal.failed(fault, swapped=_swapped(keystore))
                raise
            if journal is not None:
                journal.done(report)
            return report
        finally:
            keystore.close()
    finally:
        lock.release()


def _swapped(keystore: _Staging) -> bool | None:
    """Whether the keystore records a retiring KEK: the swap has committed (this run's or
    an earlier one's) and the old KEK is not destroyed yet. None if it cannot be read."""
    try:
        return RETIRING_KEK in keystore.meta()
    except (sqlite3.Error, CustodyError):
        return None


def _rotate(keystore: _Staging, source: TokenConfig, target: TokenConfig,
            new_kek: str | None, checkpoint: Callable[[str], None]) -> RotationReport:
    meta = keystore.meta()
    if RETIRING_KEK in meta:
        return _finish(keystore, meta, source, target, checkpoint)
    current = active_kek(meta, source)
    require_configured(current, source)
    planned = meta.get(PLAN_KEK) if meta.get(PLAN_TOKEN) == target.token_label else None
    label = new_kek or planned or (
        target.kek_label if target.token_label != source.token_label
        else f"{source.kek_label}-{secrets.token_hex(4)}")
    require_kek_label(label)
    if ActiveKek(target.token_label, label) == current:
        raise CustodyError(f"KEK {label!r} in token {target.token_label!r} is the active one")
    if not kek_obtainable(target, label):
        raise CustodyError(
            f"token {target.token_label!r} cannot generate keys: make the new KEK pair "
            f"(AES-256 and HMAC-SHA256, labels LABEL and LABEL-mac) as docs/install.md says, "
            "then run this again with --new-kek-label LABEL")
    if meta.get(PLAN_KEK) not in (None, label):
        log.warning("an interrupted run planned KEK %r in token %r; moving to %r instead "
                    "(the planned key, if it was made, is unused: remove it from the token)",
                    meta[PLAN_KEK], meta.get(PLAN_TOKEN), label)
    # The source KEK is opened before anything is recorded or made: a mistyped
    # [pkcs11] kek_label must leave no plan in the keystore and no new key in the token.
    source_token = _open_source(source, current)
    try:
        keystore.set_meta({PLAN_TOKEN: target.token_label, PLAN_KEK: label})
        checkpoint("planned")
        init_kek(target, label)
        checkpoint("new_kek")
        target_token = Token.open(target, label)
        try:
            originals = _stage_resealed(keystore, (source_token,), target_token, checkpoint)
            new = ActiveKek(target.token_label, label)
            keystore.swap_staged(originals, {
                ACTIVE_TOKEN: new.token_label, ACTIVE_KEK: new.kek_label,
                PLAN_TOKEN: None, PLAN_KEK: None,
                RETIRING_TOKEN: current.token_label, RETIRING_KEK: current.kek_label,
            }, int(time.time()))
            seal_kind = target_token.seal
        finally:
            target_token.close()
    finally:
        source_token.close()
    checkpoint("swapped")
    destroyed = _destroy_retiring(keystore, source, current, checkpoint)
    return RotationReport(len(originals), current, new, seal_kind, destroyed, "rotated")


def _open_source(source: TokenConfig, current: ActiveKek) -> Token:
    """The KEK the agents are sealed under, opened; refused, naming the label, when the
    token has none by it: `keys init` (Token.open's remedy) would make an empty one there."""
    require_kek_label(current.kek_label)
    if not kek_present(source, current.kek_label):
        raise CustodyError(
            f"token {source.token_label!r} has no KEK labelled {current.kek_label!r} to "
            "rotate from: check [pkcs11] kek_label (the agents' keys are sealed under the "
            "KEK it names); nothing was changed")
    return Token.open(source, current.kek_label)


def _stage_resealed(keystore: _Staging, sources: tuple[Token, ...], target: Token,
                    checkpoint: Callable[[str], None]) -> list[tuple[str, bytes]]:
    """Stage every live agent's key, opened by the first of `sources` that opens it, sealed
    under `target`'s active KEK, and open each staged blob again; the blobs staged from."""
    originals = keystore.live_blobs()
    staged = []
    for agent, blob in originals:
        with _open_by_any(sources, blob, agent) as secret:
            staged.append((agent, seal(target, secret, agent)))
    keystore.stage(staged)
    checkpoint("staged")
    for agent, blob in keystore.staged():
        with unseal(target, blob, agent):
            pass
    checkpoint("verified")
    return originals


def _open_by_any(tokens: tuple[Token, ...], blob: bytes, agent: str) -> Secret:
    for token in tokens[:-1]:
        try:
            return unseal(token, blob, agent)
        except UnsealFailed:
            continue
    return unseal(tokens[-1], blob, agent)


def _finish(keystore: _Staging, meta: dict[str, str], source: TokenConfig,
            target: TokenConfig, checkpoint: Callable[[str], None]) -> RotationReport:
    """An earlier run committed its swap and died before destroying the old KEK.

    Every live key is sealed again under the active KEK before the old one goes: between
    that run and this one something may have sealed a key under the retiring KEK (a
    `--recover` did, before it resealed), and a blob names its KEK by label only, which a
    migration's two tokens may share, so no look at the blobs can tell which token's."""
    retiring = ActiveKek(meta[RETIRING_TOKEN], meta[RETIRING_KEK])
    new = active_kek(meta, source)
    configs = {c.token_label: c for c in (target, source)}
    config = configs.get(retiring.token_label)
    if config is None or new.token_label not in configs:
        raise CustodyError(
            f"an interrupted run left KEK {retiring.kek_label!r} to destroy in token "
            f"{retiring.token_label!r}: run this with configurations for that token and "
            f"{new.token_label!r}"
        )
    active = Token.open(configs[new.token_label], new.kek_label)
    try:
        sources = [active]
        if retiring.token_label != new.token_label:  # the same token opens both KEKs
            with contextlib.suppress(CustodyError):  # gone: destroyed before the crash
                sources.append(Token.open(config, retiring.kek_label))
        try:
            originals = _stage_resealed(keystore, tuple(sources), active, lambda _: None)
            keystore.swap_staged(originals, {}, int(time.time()))
        finally:
            for token in sources[1:]:
                token.close()
    finally:
        active.close()
    destroyed = _destroy_retiring(keystore, config, retiring, checkpoint)
    return RotationReport(len(keystore.live_blobs()), retiring, new, "", destroyed, "finished")


def _destroy_retiring(keystore: _Staging, config: TokenConfig, retiring: ActiveKek,
                      checkpoint: Callable[[str], None]) -> tuple[str, ...]:
    if active_kek(keystore.meta(), config) == retiring:
        raise CustodyError("refusing to destroy the active KEK")  # the swap's record says not
    destroyed = destroy_kek(config, retiring.kek_label)
    checkpoint("old_kek_destroyed")
    keystore.set_meta({RETIRING_TOKEN: None, RETIRING_KEK: None})
    return destroyed
