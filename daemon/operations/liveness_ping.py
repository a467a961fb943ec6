"""liveness.ping: refused as `unsupported`, after the contract has checked its arguments.

NIP-BA "Live signals": the host MUST reject a turn not bound to the session's channel
before any effect. A turn is the agent runtime's, process-local; this host runs no runtime
and learns of no turn. Nothing binds a `turnId` to a session here: a credential names an
agent, its channels and its actions (daemon/state/sessions.py), and no action tells the
host that a turn began or ended. So the host cannot tell a bound turn from an invented one,
and publishing a keepalive for whatever `turnId` is sent would be the unchecked effect the
rule forbids. `unsupported` is NIP-BA's normal answer for a best-effort live signal
(clients MUST carry on without it), and nothing is published (docs/protocol.md,
"liveness.ping").

Invalid arguments (a channel that is not a UUID, an empty or 301-character `turnId`) are
still `invalid_request`, decided by the contract before this runs; a credential without the
action or the channel is still `unauthorized` (daemon/pipeline/policy.py).

The refusal is made before execution, by the judgement's authorize step (policy
`UNOFFERED`): nothing runs, so it is recorded as the refusal it is — charged to its
credential's refusal share, no tombstone, no `live` unit — not as an effect (every ping
used to leave a record on the agent's account and a tombstone for good). `prepare` is
never reached; it answers the same refusal should anything route a ping here.
"""

from __future__ import annotations

from typing import Final

from buzzwire.contract import LivenessPingArgs, Verdict
from daemon.operations._base import Context
from daemon.pipeline.policy import UNOFFERED

__all__ = ["prepare", "UNBOUND_TURNS"]

#: The operator-facing message of the refusal (fixed text, style.md #12).
UNBOUND_TURNS: Final = UNOFFERED["liveness.ping"].message


async def prepare(ctx: Context, args: LivenessPingArgs) -> Verdict:
    refusal = UNOFFERED["liveness.ping"]
    return Verdict.failed(refusal.code, refusal.message)
