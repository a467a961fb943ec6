"""storage.get: the current value of one encrypted-memory record (NIP-BA Memory, NIP-AE).

Steps: the slug's address (custody derives d; the owner is custody's record), the
versions at it on the relay, the head chosen exactly as NIP-AE does (daemon/operations/
_memory.py), decrypted in custody. No valid head, or a memory tombstone, is `{}`; a
relay that cannot be read is `failed` (`action_failed`), never `{}`.

The value is a secret (decrypted memory): it is in the answer, never in a log line, and
never kept for replay: a read leaves no ledger record (issue 24; an earlier version's
sealed record still opens, daemon/pipeline/sealed_verdict.py).
"""

from __future__ import annotations

from buzzwire.contract import StorageGetArgs, StorageGetOutcome, Verdict
from daemon.operations._base import Context
from daemon.operations._memory import address_of, read_head

ACTION = "storage.get"


async def execute(ctx: Context, args: StorageGetArgs) -> Verdict:
    head, _versions = await read_head(ctx, await address_of(ctx, args.slug))
    return Verdict.succeeded(
        ACTION, StorageGetOutcome(value=None if head is None else head.text))
