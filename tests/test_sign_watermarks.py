"""The double-sign guard's store (issue 22 L4): durable, per (agent, kind, d), forward only."""

from __future__ import annotations

from pathlib import Path

from daemon.state.sign_watermarks import SignWatermarks, Watermark

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
