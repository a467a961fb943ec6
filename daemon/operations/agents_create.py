"""agents.create: mint a managed agent owned by the requester.

Steps (buzz-on-the-relay.md, "Managed agents"; design.md "Multi-event operations"):
1. Mint the key in custody, idempotently on (requester, requestId), bound to the request's
   ledger record (`ctx.mint`, daemon/pipeline/publisher.py): a retry after a crash that came
   before the pending record finds the same agent instead of minting another, and a key
   whose record is gone is never adopted (issue 22 H1).
   Custody makes the owner's NIP-OA tag, since the owner is a key this host holds. Then
   name it in the public directory (custody holds no names); the retry names it again, a
   no-op once named. Its depth is the directory's, derived from the owner chain.
2. Sign, in one custody hop and in publish order:
   a. the owner's kind 9000 put-user `["h", channel] ["p", agent] ["role", "bot"]` — first,
      because it is the event a relay is most likely to refuse (channel permissions);
   b. the owner's kind 30177 record, as Buzz writes it (`parallelism: 1`, no runtime: the
      runtime goes to the host's own record once the relay took the events, `set_runtime`);
   c. the agent's own kind 0 (`display_name`, `name`), which custody tags with `auth`.
3. If the first event is refused nothing took hold on the relay: the pipeline destroys the
   minted key (`rollback`) and answers `failed`. A refusal after an accepted event is not a
   clean failure; the pipeline answers `indeterminate` and the identical retry re-sends the
   same three events (see daemon/pipeline/broker.py).
Depth and runtime are policy's, checked before this runs.
"""

from __future__ import annotations

import json

from buzzwire import kinds
from buzzwire.contract import AgentsCreateArgs, AgentsCreateOutcome
from daemon.operations._base import Context, Plan
from daemon.operations._events import sign_all
from daemon.operations._managed import (
    KIND_MANAGED_AGENT,
    KIND_PUT_USER,
    record_content,
)
from daemon.operations.profile_set import KIND_METADATA
from daemon.pipeline.pending import DestroyAgent, SetRuntime



async def prepare(ctx: Context, args: AgentsCreateArgs) -> Plan:
    owner = ctx.principal.agent
    assert ctx.enroll is not None and ctx.mint is not None, "agents.create mints and names"
    agent = await ctx.mint()
    await ctx.enroll(agent.pubkey, args.display_name, owner)
    now = ctx.now()
    record = record_content(
        {
            "name": args.display_name,
            "system_prompt": args.system_prompt,
            "model": args.model,
            "provider": args.provider,
            "respond_to": args.respond_to,
        }
    )
    profile = json.dumps(
        {"display_name": args.display_name, "name": args.display_name},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    events = await sign_all(
        ctx,
        [
            (owner, KIND_PUT_USER,
             [("h", args.channel_id), ("p", agent.pubkey), ("role", kinds.PUT_USER_ROLE)], "", now),
            (owner, KIND_MANAGED_AGENT, [("d", agent.pubkey)], record, now),
            (agent.pubkey, KIND_METADATA, [], profile, now),
        ],
    )
    return Plan(
        events=tuple(events),
        outcome=AgentsCreateOutcome(
            agent_pubkey=agent.pubkey, display_name=args.display_name, channel_id=args.channel_id
        ),
        rollback=(DestroyAgent(pubkey=agent.pubkey),),
        commit=((SetRuntime(pubkey=agent.pubkey, runtime=args.runtime),)
                if args.runtime is not None else ()),
    )
