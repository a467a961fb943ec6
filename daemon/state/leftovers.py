"""What the daemon keeps about a key beyond custody's record, and when it goes.

Custody's records are bounded by `max_records` (custody/_records.py `RecordBound`): a
create-delete loop stops there. What the daemon keeps per key must then go with the key
or with its record, or the loop would still grow it:
- its relay watermarks (daemon/state/sign_watermarks.py) and its runtime
  (daemon/state/runtimes.py): once the key cannot sign here again (`signers`: destroyed,
  with custody in the daemon; its record gone, with a custodian, whose `--recover` may
  bring a destroyed key back);
- its name (daemon/state/directory.py): once custody has no record of it (a custodian's
  `--forget-destroyed`; a removed agent is listed by name while its tombstone stays).

`prune` does all of it. It runs when the daemon starts (what an older version, or a prune that
faulted, left) and after each destroy (the DestroyAgent step, a failed agents.create's key,
`agent remove`): a loop destroys, so what it leaves goes as it goes. Blocking (each store
commits with an fsync): the daemon calls it from a worker thread after a destroy.
What went is one `leftovers.pruned` line (how many rows each store dropped; no pubkey).

A key source that lists none of the keys the stores hold is taken for a wrong one, not
for every agent gone: a daemon pointed at a custodian serving an empty or another
keystore (a rebuilt host's new custodian started before its `keys restore`, a wrong
`state_dir`) would otherwise drop every agent's name, watermarks and runtime at its
start. Then nothing is pruned and one `leftovers.unmatched` WARNING says so
(tests/adversarial/test_churn_residue.py::
test_a_key_source_holding_none_of_the_agents_prunes_nothing_and_says_so). The cost: once
every agent this daemon kept state for is really forgotten (`--forget-destroyed`, under
the custodian's uid), their rows stay, bounded by what was there, and the warning comes
at each start until an agent made since shares the stores with them (then they go) or the
operator deletes them. `agent forget` never leaves them: it drops the rows of exactly the
keys it forgot (`forget`).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Collection
from dataclasses import dataclass

from daemon.log import log_event
from daemon.state.directory import AgentDirectory, DirectoryError
from daemon.state.runtimes import RuntimeStore
from daemon.state.sign_watermarks import SignWatermarks, signers

__all__ = ["UNMATCHED", "UNMATCHED_FIX", "Pruned", "forget", "prune", "housekeep"]

_log = logging.getLogger("buzz_broker.leftovers")

#: What the `leftovers.unmatched` warning says, and what to do.
UNMATCHED = ("the key source holds none of the agents this daemon keeps state for: "
              "nothing was pruned")
UNMATCHED_FIX = ("check [custody] custodian_socket (the custodian's keystore: restored?) "
                  "and [state] dir; once every agent was really forgotten this repeats at "
                  "each start, and the rows stay, bounded by what was there")


@dataclass(frozen=True, slots=True, kw_only=True)
class Pruned:
    """What one prune did: the rows each store dropped; `unmatched`: none, since the key
    source lists none of the keys the stores hold (module docstring)."""

    names: int = 0
    watermarks: int = 0
    runtimes: int = 0
    unmatched: bool = False


def prune(directory: AgentDirectory, watermarks: SignWatermarks, runtimes: RuntimeStore, *,
          custodian: bool) -> Pruned:
    """Drop what the daemon keeps of keys that are gone (module docstring), unless the key
    source shares no key with the stores; `custodian`: a custodian holds the keys
    (`[custody] custodian_socket`). Logs what went, or the refusal.

    Raises:
        DirectoryError, sqlite3.Error, OSError: a store could not be read or written; what
            it holds stays for the next prune.
    """
    held = directory.named() | watermarks.agents() | runtimes.agents()
    records = {r.pubkey for r in directory.agents(include_deleted=True)}
    if held and not held & records:
        log_event(_log, "leftovers.unmatched", level=logging.WARNING, agents=len(held),
                  records=len(records), detail=UNMATCHED, fix=UNMATCHED_FIX)
        return Pruned(unmatched=True)

    def kept() -> set[str]:
        return signers(directory.agents(include_deleted=True), custodian=custodian)

    return _said(Pruned(watermarks=watermarks.prune(kept), runtimes=runtimes.prune(kept),
                        names=directory.prune()))


def housekeep(directory: AgentDirectory, watermarks: SignWatermarks, runtimes: RuntimeStore,
              *, custodian: bool) -> None:
    """`prune` as the daemon runs it, at start and after each destroy: housekeeping, so a
    fault is one WARNING `leftovers.unpruned` (its type, and the store's own words: a
    file, never a row), not raised; what stays goes at the next destroy or start."""
    try:
        prune(directory, watermarks, runtimes, custodian=custodian)
    except (OSError, sqlite3.Error, DirectoryError) as exc:
        log_event(_log, "leftovers.unpruned", level=logging.WARNING,
                  error=type(exc).__name__, detail=str(exc))


def forget(directory: AgentDirectory, watermarks: SignWatermarks, runtimes: RuntimeStore,
           pubkeys: Collection[str]) -> Pruned:
    """Drop what the daemon keeps of `pubkeys`, whose records `agent forget` just deleted:
    at once, a name written in the last PRUNE_AFTER_SECONDS too (that grace is for a
    custodian's records, which may lag; these are gone here), so an import of one takes
    the name it is given. Logs what went.

    Raises:
        DirectoryError, sqlite3.Error, OSError: a store could not be written.
    """
    return _said(Pruned(watermarks=watermarks.forget(pubkeys),
                        runtimes=runtimes.forget(pubkeys), names=directory.forget(pubkeys)))


def _said(pruned: Pruned) -> Pruned:
    if pruned.names or pruned.watermarks or pruned.runtimes:
        log_event(_log, "leftovers.pruned", names=pruned.names,
                  watermarks=pruned.watermarks, runtimes=pruned.runtimes)
    return pruned
