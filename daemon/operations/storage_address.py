"""storage.address: the NIP-AE address of one encrypted-memory record. No relay I/O.

The d-tag is a keyed hash of the slug under K_c, the NIP-44 conversation key between the
agent's secret and its owner's public key; K_c never leaves custody, only the address does.
"""

from __future__ import annotations

from buzzwire.contract import StorageAddressArgs, StorageAddressOutcome, Verdict
from daemon.operations._base import Context

ACTION = "storage.address"


async def execute(ctx: Context, args: StorageAddressArgs) -> Verdict:
    address = await ctx.custody.memory_address(ctx.principal.agent, args.slug)
    return Verdict.succeeded(
        ACTION,
        StorageAddressOutcome(
            author_pubkey=address.author_pubkey, kind=address.kind, d_tag=address.d_tag
        ),
    )
