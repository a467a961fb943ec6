"""What a read leaves on disk: bytes per read to the ledger and the audit log, before and after.

The fleet of issue 24: `--agents` agents (64) × `--channels` channels each (4), every one
read `--rounds` times (channel.read, default window, a fresh requestId each) against
nostr-sdk's LocalRelay, through the real daemon (`buzz-broker serve`), 16 at a time. Run
twice on copies of one state directory: "before" is the daemon of a pinned commit
(`--before`, default the last commit before issue 24 item 3, built once into the benchmark
cache by benchmarks/_harness.py `pinned_build`),
"after" is this checkout. After each run the daemon is stopped cleanly (the WAL is
checkpointed, the open read counts written), then: growth of ledger.db and of the audit
files, ledger records added, audit lines added, per read; and the projection for 256
polls/s around the clock. "after" writes its counts once per minute per credential, so
its projection is (bytes of the lines one window wrote) × (windows a day); a run shorter
than a window writes exactly one window's lines, which is what is measured.

Run: python benchmarks/read_disk.py [--agents 64] [--channels 4] [--rounds 4] [--before C]
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import sys
import time
import uuid
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import (check_pinned_imports, daemon_process, import_agents,  # noqa: E402
                                 make_token, pinned_build, pinned_environ, relay_process,
                                 workdir, write_config)
from daemon.state.audit import AUDIT_DIRNAME, audit_files  # noqa: E402
from daemon.state.sessions import SessionStore  # noqa: E402
from tests.adversarial._daemon import envelope, post, request_body  # noqa: E402

#: The last commit before reads stopped leaving records (issue 24 item 3).
PINNED = "75ee3f5"
POLLS_PER_SECOND = 256
WINDOW_SECONDS = 60


def sizes(state: Path) -> tuple[int, int, int, int]:
    """(ledger bytes, audit bytes, ledger records, audit lines), after a clean stop."""
    wal = state / "ledger.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0, "measure after a clean stop"
    ledger = state / "ledger.db"
    with sqlite3.connect(ledger) as conn:
        records = int(conn.execute("SELECT count(*) FROM entries").fetchone()[0])
    files = [p for _n, p in audit_files(state / AUDIT_DIRNAME)]
    lines = sum(p.read_bytes().count(b"\n") for p in files)
    return ledger.stat().st_size, sum(p.stat().st_size for p in files), records, lines


async def poll(sock: Path, creds: list[tuple[str, list[str]]], rounds: int) -> int:
    jobs = [(cred, ch) for _ in range(rounds) for cred, chans in creds for ch in chans]
    done = 0

    async def worker() -> None:
        nonlocal done
        while jobs:
            cred, channel = jobs.pop()
            body = request_body("channel.read", {"channelId": channel},
                                request_id=str(uuid.uuid4()))
            answer = envelope(await post(sock, body, cred))
            assert answer["status"] == "succeeded", answer
            done += 1

    async with trio.open_nursery() as nursery:
        for _ in range(16):
            nursery.start_soon(worker)
    return done


def run(label: str, state: Path, config: Path, tmp: Path, command: list[str] | None,
        creds: list[tuple[str, list[str]]], rounds: int,
        environ: dict[str, str] | None = None) -> None:
    with daemon_process(config, tmp, command=command, environ=environ) as daemon:
        trio.run(poll, daemon.socket, creds, 1)  # warm-up: tables, files, relay connections
    base = sizes(state)
    with daemon_process(config, tmp, command=command, environ=environ) as daemon:
        reads = trio.run(poll, daemon.socket, creds, rounds)
    after = sizes(state)
    ledger, audit, records, lines = (a - b for a, b in zip(after, base))
    per_day = POLLS_PER_SECOND * 86400
    if lines * 4 < reads:  # counted: one window's lines
        day = (ledger + audit) * 86400 / WINDOW_SECONDS if reads >= len(creds) else 0.0
        how = f"(one window's lines x {86400 // WINDOW_SECONDS} windows)"
    else:
        day = (ledger + audit) / reads * per_day
        how = f"(x {per_day:,} reads)"
    print(f"{label:7} {reads} reads: ledger {ledger / reads:8.1f} B/read ({records} records), "
          f"audit {audit / reads:7.1f} B/read ({lines} lines); "
          f"projected ledger+audit at {POLLS_PER_SECOND} polls/s: {day / 1e6:,.1f} MB/day {how}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--before", default=PINNED, help="commit to measure as 'before'")
    args = parser.parse_args()
    with workdir() as tmp:
        token = make_token(tmp / "token")
        seed = tmp / "seed"
        pubkeys = trio.run(import_agents, token, seed, args.agents)
        store = SessionStore.open(seed)
        creds = []
        try:
            for pubkey in pubkeys:
                chans = [str(uuid.uuid4()) for _ in range(args.channels)]
                _, cred = store.issue(agent=pubkey, channels=frozenset(chans),
                                      actions=frozenset({"channel.read"}), ttl_seconds=None,
                                      uid=None, now=int(time.time()))
                creds.append((cred, chans))
        finally:
            store.close()
        with relay_process("local") as (url, _proc):
            # The pinned commit's own build (cached): its code on a copy of the same state,
            # run without the caller's PYTHONPATH (which would import this checkout's
            # daemon), and checked to import its own before anything is measured.
            home, _full = pinned_build(args.before)
            pinned = pinned_environ()
            check_pinned_imports(home / "venv" / "bin" / "python", home, pinned)
            plans: list[tuple[str, list[str] | None, dict[str, str] | None]] = [
                (f"before ({args.before})", [str(home / "venv" / "bin" / "buzz-broker")], pinned),
                ("after", None, None)]
            for label, command, environ in plans:
                state = tmp / label.split()[0]
                shutil.copytree(seed, state)
                config = write_config(tmp / f"{label.split()[0]}.toml", token, state,
                                      tmp / f"{label.split()[0]}.sock", url)
                run(label, state, config, tmp, command, creds, args.rounds, environ)


if __name__ == "__main__":
    main()
