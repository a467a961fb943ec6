"""An in-memory relay query that behaves like a real NIP-01 relay where it matters for paging.

Per filter: the matching events, newest `created_at` first, ties inside a second in an
order chosen by a seeded random generator (a real relay cuts a second wherever it likes),
cut at min(limit, cap). The reply is the union of every filter's events — an event that
several filters match is sent once per filter, as relays do — shuffled.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from daemon.relay.paging import matches


class FakeRelay:
    def __init__(self, events: Sequence[Mapping[str, object]], *, cap: int, seed: int) -> None:
        self.events = list(events)
        self.cap = cap
        self.random = random.Random(seed)
        self.requests: list[list[dict[str, object]]] = []

    async def query(self, filters: list[dict[str, object]]) -> list[object]:
        self.requests.append(filters)
        reply: list[object] = []
        for flt in filters:
            hits = [ev for ev in self.events if matches(ev, flt)]
            self.random.shuffle(hits)
            hits.sort(key=lambda ev: -int(ev["created_at"]))  # type: ignore[call-overload]
            limit = flt.get("limit", self.cap)
            assert isinstance(limit, int) and limit >= 1
            reply.extend(hits[: min(limit, self.cap)])
        self.random.shuffle(reply)
        return reply
