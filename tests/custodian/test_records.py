"""The pipeline's copy of the custodian's records (custody/custodian/records.py): reads
answer from it, the version is asked at a bounded rate, and at once after a lifecycle
call, a fault or a reconnect.

Pure: a counting source stands in for the socket and a settable clock for time; the
socket itself is the e2e flows' (test_pipeline.py) and the SIGKILL test's (test_recovery.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from custody._keystore import KeyRecord
from custody.custodian.client import CustodianUnavailable
from custody.custodian.records import RECHECK_SECONDS, RecordCache

A, B, C = "a" * 64, "b" * 64, "c" * 64


def _record(pubkey: str, owner: str, deleted_at: int | None = None,
            mint_ref: str | None = None) -> KeyRecord:
    return KeyRecord(pubkey=pubkey, owner=owner, auth_tag=None, created_at=1,
                     deleted_at=deleted_at, mint_ref=mint_ref)


@dataclass
class Source:
    version: int = 1
    records: list[KeyRecord] = field(default_factory=list)
    connections: int = 1
    asked: list[str] = field(default_factory=list)
    down: bool = False

    def ask_version(self) -> int:
        self.asked.append("records_version")
        if self.down:
            raise CustodianUnavailable("down")
        return self.version

    def ask_records(self) -> list[KeyRecord]:
        self.asked.append("agents")
        return list(self.records)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reads_answer_from_the_snapshot_asking_the_version_at_a_bounded_rate() -> None:
    source, clock = Source(records=[_record(A, B), _record(B, C, mint_ref="m")]), Clock()
    cache = RecordCache(source, clock)
    for _ in range(1000):
        assert cache.get(A) is not None
        assert cache.version() == 1
    assert cache.chain(A) == [_record(A, B), _record(B, C, mint_ref="m")]
    assert cache.by_mint_ref("m") == _record(B, C, mint_ref="m")
    assert source.asked == ["records_version", "agents"]  # 2,000 reads, one check
    source.records.append(_record(C, A, deleted_at=5))
    source.version = 2
    clock.now += RECHECK_SECONDS / 2
    assert cache.get(C) is None  # not yet asked: another process's change is unseen
    clock.now += RECHECK_SECONDS
    assert cache.get(C) == _record(C, A, deleted_at=5)
    assert [r.pubkey for r in cache.all()] == [A, B]
    assert len(cache.all(include_deleted=True)) == 3
    assert source.asked == ["records_version", "agents", "records_version", "agents"]
    clock.now += RECHECK_SECONDS
    cache.get(A)
    assert source.asked[-1] == "records_version"  # same version: no listing


def test_expire_and_a_reconnect_ask_at_once_and_a_fault_is_raised_every_time() -> None:
    source, clock = Source(records=[_record(A, B)]), Clock()
    cache = RecordCache(source, clock)
    cache.get(A)
    source.records.append(_record(B, C))
    source.version = 2
    cache.expire()  # the pipeline's own mint, say
    assert cache.get(B) is not None
    source.records.append(_record(C, A))
    source.connections += 1  # a new custodian may count from the same number again
    cache.expire()
    assert cache.get(C) is not None and source.asked.count("agents") == 3
    source.down = True
    cache.expire()
    for _ in range(2):  # no stale answer while it is gone
        with pytest.raises(CustodianUnavailable):
            cache.get(A)
    source.down = False
    assert cache.get(A) is not None
