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
"""

from __future__ import annotations

from daemon.state.directory import AgentDirectory
from daemon.state.runtimes import RuntimeStore
from daemon.state.sign_watermarks import SignWatermarks, signers

__all__ = ["prune"]


def prune(directory: AgentDirectory, watermarks: SignWatermarks, runtimes: RuntimeStore, *,
          custodian: bool) -> None:
    """Drop what the daemon keeps of keys that are gone (module docstring); `custodian`:
    a custodian holds the keys (`[custody] custodian_socket`).

    Raises:
        DirectoryError, sqlite3.Error, OSError: a store could not be read or written; what
            it holds stays for the next prune.
    """
    def kept() -> set[str]:
        return signers(directory.agents(include_deleted=True), custodian=custodian)

    watermarks.prune(kept)
    runtimes.prune(kept)
    directory.prune()
