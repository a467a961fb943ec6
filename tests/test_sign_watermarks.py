"""The double-sign guard's store (issue 22 L4): durable, per (agent, kind, d), forward only,
bounded by what the host holds (only the kinds an operation checks, a cap per author)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sqlite3
from pathlib import Path

from buzzwire import kinds
from daemon import operations
from daemon.state.sign_watermarks import (
    GUARDED_KINDS,
    MAX_ROWS_PER_AGENT,
    WATERMARKS_DB,
    SignWatermarks,
    Watermark,
    signers,
)
from custody import KeyRecord

AGENT = "a" * 64


def test_a_watermark_survives_a_restart_and_only_moves_forward(tmp_path: Path) -> None:
    store = SignWatermarks.open(tmp_path)
    store.record(AGENT, 30177, "b" * 64, 200, "1" * 64)
    store.record(AGENT, 30177, "b" * 64, 100, "2" * 64)  # older: kept as was
    store.record(AGENT, 0, "", 50, "3" * 64)
    store.close()
    store = SignWatermarks.open(tmp_path)
    assert store.get(AGENT, 30177, "b" * 64) == Watermark(200, "1" * 64)
    assert store.get(AGENT, 0, "") == Watermark(50, "3" * 64)
    assert store.get(AGENT, 30177, "c" * 64) is None, "each d has its own watermark"
    store.record(AGENT, 30177, "b" * 64, 201, "4" * 64)
    assert store.get(AGENT, 30177, "b" * 64) == Watermark(201, "4" * 64)
    store.close()


def _rows(path: Path) -> list[tuple[str, int, str, int]]:
    db = sqlite3.connect(path / WATERMARKS_DB)
    try:
        return db.execute("SELECT agent, kind, d, created_at FROM watermarks "
                          "ORDER BY agent, kind, d").fetchall()
    finally:
        db.close()


def test_a_client_chosen_d_adds_no_row_and_rows_left_by_older_versions_go(
    tmp_path: Path
) -> None:
    # storage.put's kind 30174 carries the client's slug as `d`: at about 400 bytes a row
    # kept for good, a client could grow watermarks.db without end. Nothing reads its
    # watermark, so nothing keeps it.
    store = SignWatermarks.open(tmp_path)
    for i in range(2000):
        store.record(AGENT, kinds.MEMORY, f"slug-{i}", 1_800_000_000 + i, f"{i:064x}")
    assert _rows(tmp_path) == []
    store.close()
    # A store written before this bound: its rows of other kinds are deleted at open.
    db = sqlite3.connect(tmp_path / WATERMARKS_DB, isolation_level=None)
    db.executemany("INSERT INTO watermarks VALUES (?, ?, ?, ?, ?)",
                   [(AGENT, kinds.MEMORY, f"slug-{i}", 1, "e" * 64) for i in range(50)]
                   + [(AGENT, 0, "", 7, "f" * 64)])
    db.close()
    store = SignWatermarks.open(tmp_path)
    assert _rows(tmp_path) == [(AGENT, 0, "", 7)]
    assert store.get(AGENT, 0, "") == Watermark(7, "f" * 64)
    store.close()


def test_an_authors_rows_are_capped_and_the_oldest_published_go_first(tmp_path: Path) -> None:
    other = "b" * 64
    store = SignWatermarks.open(tmp_path, max_rows_per_agent=3)
    store.record(other, 0, "", 1, "0" * 64)
    store.record(AGENT, 0, "", 300, "1" * 64)
    for i, created_at in enumerate((100, 400, 200, 500)):
        store.record(AGENT, 30177, f"{i:064x}", created_at, f"{i + 2:064x}")
    # The author's three latest-published versions stay; another author's rows are its own.
    assert _rows(tmp_path) == [
        (AGENT, 0, "", 300), (AGENT, 30177, f"{1:064x}", 400), (AGENT, 30177, f"{3:064x}", 500),
        (other, 0, "", 1)]
    # An evicted record is as one never recorded: its next version is kept again.
    store.record(AGENT, 30177, f"{0:064x}", 600, "9" * 64)
    assert store.get(AGENT, 30177, f"{0:064x}") == Watermark(600, "9" * 64)
    assert store.get(AGENT, 0, "") is None, "the oldest-published went"
    assert len(_rows(tmp_path)) == 4
    store.close()


def test_the_default_cap_bounds_an_author_whatever_its_distinct_d_tags(tmp_path: Path) -> None:
    store = SignWatermarks.open(tmp_path)
    # An author already at the cap (written directly, in one commit: only the count matters).
    store._db.execute("BEGIN")
    store._db.executemany("INSERT INTO watermarks VALUES (?, 30177, ?, ?, ?)", [
        (AGENT, f"{i:064x}", 1_800_000_000 + i, f"{i:064x}") for i in range(MAX_ROWS_PER_AGENT)])
    store._db.execute("COMMIT")
    for i in range(MAX_ROWS_PER_AGENT, MAX_ROWS_PER_AGENT + 5):
        store.record(AGENT, 30177, f"{i:064x}", 1_800_000_000 + i, f"{i:064x}")
    assert len(_rows(tmp_path)) == MAX_ROWS_PER_AGENT
    assert store.get(AGENT, 30177, f"{MAX_ROWS_PER_AGENT + 4:064x}") is not None
    assert [store.get(AGENT, 30177, f"{i:064x}") for i in range(5)] == [None] * 5
    assert store.get(AGENT, 30177, f"{5:064x}") is not None
    store.close()


def test_prune_drops_the_rows_of_keys_not_kept_by_author_and_by_the_managed_agent(
        tmp_path: Path) -> None:
    owner, kept, gone = "a" * 64, "b" * 64, "c" * 64
    store = SignWatermarks.open(tmp_path)
    for agent in (owner, kept, gone):
        store.record(agent, kinds.METADATA, "", 1, agent)
    store.record(owner, kinds.MANAGED_AGENT, kept, 2, "1" * 64)
    store.record(owner, kinds.MANAGED_AGENT, gone, 3, "2" * 64)  # the owner's, about `gone`
    locked: list[bool] = []

    def kept_keys() -> set[str]:
        # Asked inside the prune's write transaction: no row can be recorded meanwhile.
        other = sqlite3.connect(tmp_path / WATERMARKS_DB, timeout=0)
        try:
            other.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            locked.append("locked" in str(exc))
        finally:
            other.close()
        return {owner, kept}

    assert store.prune(kept_keys) == 2 and locked == [True]
    assert _rows(tmp_path) == [(owner, 0, "", 1), (owner, kinds.MANAGED_AGENT, kept, 2),
                               (kept, 0, "", 1)]
    assert store.prune(lambda: {kept}) == 2  # the owner gone: its rows, both kinds
    assert store.prune(set) == 1 and _rows(tmp_path) == []
    store.close()


def _key(pubkey: str, *, destroyed: bool) -> KeyRecord:
    return KeyRecord(pubkey=pubkey, owner="f" * 64, auth_tag=None, created_at=1,
                     deleted_at=2 if destroyed else None)


def test_a_destroyed_key_is_kept_only_where_a_custodian_may_recover_it() -> None:
    records = [_key("a" * 64, destroyed=False), _key("b" * 64, destroyed=True)]
    assert signers(records, custodian=False) == {"a" * 64}
    assert signers(records, custodian=True) == {"a" * 64, "b" * 64}


def test_every_kind_an_operation_guards_is_kept() -> None:
    # A kind whose watermark an operation reads but `record` drops would leave the guard
    # with nothing to check: the operations' `check_builds_on_latest` kinds must all be kept.
    pattern = re.compile(r"check_builds_on_latest\(\s*ctx,\s*\w+,\s*(\w+)")
    guarded = {}
    for info in pkgutil.iter_modules(operations.__path__):
        module = importlib.import_module(f"{operations.__name__}.{info.name}")
        for name in pattern.findall(inspect.getsource(module)):
            guarded[f"{info.name}:{name}"] = getattr(module, name)
    assert set(guarded) == {"profile_set:KIND_METADATA", "agents_update:KIND_MANAGED_AGENT"}, \
        guarded
    assert set(guarded.values()) == GUARDED_KINDS
