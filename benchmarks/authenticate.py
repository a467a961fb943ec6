"""What authentication costs per request now that it checks the agent and notes last use.

Run: .venv/bin/python benchmarks/authenticate.py [--seconds S] [--credentials N]

Issue 13: a credential whose agent is not live authenticates nothing (one keystore read
per request), and `credential list` shows last use, noted in memory per request and
written once a minute. Measured in one process, on a real SoftHSM2 token's keystore and a
real sessions.db with N credentials (default 1,000), each figure as calls per second and
as a ratio to the baseline:
- baseline: `SessionStore.authenticate` (token parse, hash, dict lookup, last-use note);
- + liveness, kept per version: the same, then what the pipeline does — custody's
  records version (SQLite's change counter), and `Custody.agent(pubkey)` only when it moved;
- + liveness, query each time: `Custody.agent(pubkey)` on every call (the simpler design);
- + a durable last-use write per request (the alternative we did not take): the same as
  baseline, then one UPDATE committed with the store's synchronous=FULL (an fsync);
- the periodic flush: `flush_last_use` after every credential was used once — its cost
  once a minute, for all N credentials together.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# First, always: a script's own folder leads sys.path, and there `custody` is
# benchmarks/custody.py, not the package (with the repository on PYTHONPATH too, as a
# clone's tests run, a check for it already there left the folder first).
sys.path.insert(0, str(REPO))

import trio  # noqa: E402

from benchmarks._harness import import_agents, issue_credentials, make_token, workdir  # noqa: E402
from benchmarks.custody import rate_sync as rate  # noqa: E402
from custody import Custody, TokenConfig  # noqa: E402
from daemon.state.sessions import SessionStore  # noqa: E402


async def bench(token: TokenConfig, state: Path, seconds: float, n: int) -> None:
    pubkeys = await import_agents(token, state, 20)
    agents = issue_credentials(state, [pubkeys[i % len(pubkeys)] for i in range(n)],
                               [str(uuid.uuid4())])
    headers = [f"Bearer {a.credential}" for a in agents]
    custody = await Custody.open(token, state)
    store = SessionStore.open(state)
    conn = store._conn  # the alternative's write goes through the store's own connection
    now = int(time.time())
    try:
        def baseline(i: int) -> None:
            assert store.authenticate(headers[i % n], None, now) is not None

        def with_liveness_query(i: int) -> None:
            principal = store.authenticate(headers[i % n], None, now)
            assert principal is not None and custody.agent(principal.agent) is not None

        live: dict[str, bool] = {}
        seen: list[tuple[int, int] | None] = [None]

        def with_liveness_cached(i: int) -> None:
            # What daemon/pipeline/broker.py `_agent_live` does.
            principal = store.authenticate(headers[i % n], None, now)
            assert principal is not None
            version = custody.records_version()
            if version != seen[0]:
                live.clear()
                seen[0] = version
            if principal.agent not in live:
                live[principal.agent] = custody.agent(principal.agent) is not None
            assert live[principal.agent]

        def with_durable_write(i: int) -> None:
            principal = store.authenticate(headers[i % n], None, now)
            assert principal is not None
            conn.execute("UPDATE credentials SET last_used_at = ? WHERE credential_id = ?",
                         (now + i, principal.credential_id))

        figures = {
            "authenticate (baseline)": rate(baseline, seconds),
            "+ liveness, kept per version": rate(with_liveness_cached, seconds),
            "+ liveness, query each time": rate(with_liveness_query, seconds),
            "+ durable last-use write": rate(with_durable_write, min(seconds, 2.0)),
        }
        base = figures["authenticate (baseline)"]
        print(f"{n} credentials, {len(pubkeys)} agents; {seconds:.1f} s per figure")
        for name, value in figures.items():
            print(f"  {name:<32} {value:>10,.0f}/s  {1e6 / value:>8.1f} µs/call"
                  f"  ratio {value / base:.3f}")
        for i in range(n):
            baseline(i)
        started = time.perf_counter()
        written = store.flush_last_use()
        took = time.perf_counter() - started
        print(f"  flush_last_use of {written} credentials: {took * 1000:.1f} ms, once a "
              f"minute ({took / written * 1e6:.1f} µs per credential)")
    finally:
        store.close()
        await custody.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--credentials", type=int, default=1000)
    args = parser.parse_args()
    with workdir() as tmp:
        token = make_token(tmp / "token")
        trio.run(bench, token, tmp / "state", args.seconds, args.credentials)


if __name__ == "__main__":
    main()
