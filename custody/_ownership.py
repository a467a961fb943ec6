"""The owner graph's one rule: it has no cycle. `import_agent` asks `owned_through`; restore
checks a whole backup at once, held to its answers (tests/backup/test_restore_bounds.py).

Why no cycle: an owner may act for its agents (NIP-OA tags, agents.update / delete), so a
cycle would let each agent of it act for the others, and an order by ownership (the
directory's depth, a lock order) would not exist.

Public data only: pubkeys and who owns whom.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["owned_through"]


def owned_through(start: str, ancestor: str, owner_of: Callable[[str], str | None]) -> bool:
    """True iff `ancestor` owns `start`, or its owner, and so on up the chain.

    So adding "`ancestor` is owned by `start`" would close a cycle.

    Args:
        start: where the walk starts (the owner an agent is about to get).
        ancestor: the agent about to be added.
        owner_of: an agent's owner, or None where the graph ends (a person, a key not
            held). Tombstones count: a removed agent's ownership still happened.

    The walk ends on a pubkey already seen, so a loop stored by a version from before
    cycles were refused cannot make it run forever.
    """
    seen: set[str] = set()
    current = start
    while current not in seen:
        seen.add(current)
        owner = owner_of(current)
        if owner is None:
            return False
        if owner == ancestor:
            return True
        current = owner
    return False
