"""storage.put: replace one encrypted-memory record (NIP-BA Memory, NIP-AE Writing).

On the relay: kind 30174 signed by the agent, tags exactly `["d", d]` then `["p", owner]`
(no slug anywhere in the clear), content the NIP-44 v2 payload, encrypted in custody from
the agent to its owner, of exactly the body NIP-BA fixes (`StoragePutArgs.body`:
{"slug":s,"value":v}, or core's {"slug":"core","profile":v}; the contract has bounded it to
65,535 compact bytes). created_at follows NIP-AE's monotonic rule over the versions read
(`_memory.write_created_at`), and a clock-poisoned head is refused.

What is stored: the plan holds only the signed event (ciphertext) and the Published
outcome, so the pending record never holds the slug or the value. Serialized per agent
by the pipeline (a read-merge-write on the head), so two puts of one agent cannot pick
the same created_at.
"""

from __future__ import annotations

from buzzwire.contract import PublishOutcome, StoragePutArgs
from daemon.operations._base import Context, Plan
from daemon.operations._events import sign
from daemon.operations._memory import MEMORY_KIND, address_of, read_head, write_created_at


async def prepare(ctx: Context, args: StoragePutArgs) -> Plan:
    address = await address_of(ctx, args.slug)
    _head, versions = await read_head(ctx, address)
    created_at = write_created_at(ctx.now(), versions)
    (content,) = await ctx.custody.encrypt_to_owner(address.agent, [args.body()])
    event = await sign(ctx, address.agent, MEMORY_KIND,
                       [("d", address.d_tag), ("p", address.owner)], content,
                       created_at=created_at)
    return Plan(
        events=(event,),
        outcome=PublishOutcome(event_id=event.id, kind=event.kind, created_at=event.created_at),
    )
