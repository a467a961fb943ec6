"""The custodian, killed (SIGKILL) after it has done one request of `op` and before it
answers: the worst moment for the pipeline, the effect done and no word of it.

    python -m tests.custodian.crashing_custodian CONFIG OP
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from custody.custodian.main import main
from custody.custodian.server import Custodian
from tests.fixtures.kill import kill_at


def _arm(op: str) -> None:
    handler = Custodian.HANDLERS[op]
    checkpoint = kill_at("custodian", op)

    async def killing(self: Custodian, args: Mapping[str, Any]) -> object:
        result = await handler(self, args)
        checkpoint(op)
        return result

    Custodian.HANDLERS = {**Custodian.HANDLERS, op: killing}


if __name__ == "__main__":
    _arm(sys.argv[2])
    sys.exit(main([sys.argv[1]]))
