"""The unsealed-key cache (custody/_cache.py): off by default, bounded, time-limited from
the unseal, locked, wiped on expiry, eviction, destroy and close, and never a way round a
defence or a destroy."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import custody._cache as cache_module
import custody._facade as facade_module
from custody import CachePolicy, Custody, UnknownAgent, UnsealFailed, init_kek
from custody._secret import Secret
from custody._worker import in_token_worker
from tests.custody._sealing import HUMAN, blob_of, event, put_blob
from tests.custody._secrets import SECRET_1, SECRET_2, SECRET_X
from tests.fixtures.token import SoftHsmToken


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def unseals(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every real unseal (a token call) the facade makes, by agent."""
    calls: list[str] = []
    original = facade_module.unseal

    def counted(token: Any, blob: bytes, agent: str) -> Secret:
        calls.append(agent)
        return original(token, blob, agent)

    monkeypatch.setattr(facade_module, "unseal", counted)
    return calls


async def _open(token: SoftHsmToken, state: Path, policy: CachePolicy) -> tuple[Custody, list[str]]:
    config = token.config()
    await init_kek(config)
    opened = await Custody.open(config, state, policy)
    agents = []
    for secret in (SECRET_1, SECRET_2, SECRET_X):
        record = await opened.import_agent(bytearray(secret.encode()), owner=HUMAN)
        agents.append(record.pubkey)
    return opened, agents


@pytest.fixture
async def cached(softhsm_token: SoftHsmToken, tmp_path: Path
                 ) -> AsyncIterator[tuple[Custody, list[str], _Clock]]:
    opened, agents = await _open(softhsm_token, tmp_path / "state", CachePolicy(2, 30.0))
    clock = _Clock()
    opened._cache._clock = clock
    try:
        yield opened, agents, clock
    finally:
        await opened.aclose()


def _held_bytes(opened: Custody) -> list[bytes]:
    """The cache's slots, as bytes: what a memory dump of its buffer would show."""
    cache = opened._cache
    size = cache_module.MAX_CACHE_ENTRIES if cache._buffer is None else len(cache._buffer)
    raw = bytes(cache._buffer[0:size]) if cache._buffer is not None else b""
    return [raw[i:i + 32] for i in range(0, len(raw), 32)]


def _nonzero(opened: Custody) -> int:
    return sum(1 for slot in _held_bytes(opened) if any(slot))


async def test_off_by_default_every_signature_unseals(
    softhsm_token: SoftHsmToken, tmp_path: Path, unseals: list[str]
) -> None:
    opened, agents = await _open(softhsm_token, tmp_path / "state", CachePolicy())
    try:
        assert opened._cache is None  # off: no cache object at all (_cache is not imported)
        unseals.clear()
        for _ in range(3):
            await opened.sign_event(agents[0], event(agents[0]))
        assert unseals == [agents[0]] * 3
    finally:
        await opened.aclose()


async def test_on_a_key_is_unsealed_once_and_again_only_after_its_time(
    cached: tuple[Custody, list[str], _Clock], unseals: list[str]
) -> None:
    opened, agents, clock = cached
    unseals.clear()
    for _ in range(3):
        await opened.sign_event(agents[0], event(agents[0]))
    assert unseals == [agents[0]]
    clock.now += 29.0  # used all along: the limit counts from the unseal, not the last use
    await opened.sign_event(agents[0], event(agents[0]))
    assert unseals == [agents[0]]
    clock.now += 1.0
    assert _nonzero(opened) == 1
    await opened.sign_event(agents[1], event(agents[1]))  # any access sweeps: agent 0 wiped
    assert _nonzero(opened) == 1 and len(opened._cache) == 1
    await opened.sign_event(agents[0], event(agents[0]))
    assert unseals == [agents[0], agents[1], agents[0]]


async def test_bounded_the_least_recently_used_key_is_wiped_for_a_new_one(
    cached: tuple[Custody, list[str], _Clock], unseals: list[str]
) -> None:
    opened, agents, _ = cached
    for agent in agents:  # three agents, two places
        await opened.sign_event(agent, event(agent))
    assert len(opened._cache) == 2 and _nonzero(opened) == 2
    unseals.clear()
    await opened.sign_event(agents[0], event(agents[0]))  # was evicted
    await opened.sign_event(agents[2], event(agents[2]))  # still held
    assert unseals == [agents[0]]


async def test_destroy_wipes_the_cached_key_and_it_never_signs_again(
    cached: tuple[Custody, list[str], _Clock]
) -> None:
    opened, agents, _ = cached
    await opened.sign_event(agents[0], event(agents[0]))
    assert _nonzero(opened) == 1
    await opened.destroy_agent(agents[0])
    assert _nonzero(opened) == 0
    with pytest.raises(UnknownAgent):
        await opened.sign_event(agents[0], event(agents[0]))


async def test_a_changed_blob_is_never_served_from_the_cache(
    cached: tuple[Custody, list[str], _Clock], unseals: list[str], tmp_path: Path
) -> None:
    """The key was cached from one blob; the record now holds another (a swap, a
    rotation): the cache misses and the new blob faces every defence."""
    opened, agents, _ = cached
    state = tmp_path / "state"
    await opened.sign_event(agents[0], event(agents[0]))
    put_blob(state, agents[0], blob_of(state, agents[1]))  # B's blob on A's record
    unseals.clear()
    with pytest.raises(UnsealFailed):
        await opened.sign_event(agents[0], event(agents[0]))
    assert unseals == [agents[0]]
    assert agents[0] not in opened._cache._entries


async def test_a_refused_blob_never_enters_the_cache(
    cached: tuple[Custody, list[str], _Clock], tmp_path: Path
) -> None:
    opened, agents, _ = cached
    state = tmp_path / "state"
    put_blob(state, agents[0], blob_of(state, agents[1]))
    for _ in range(2):
        with pytest.raises(UnsealFailed):
            await opened.sign_event(agents[0], event(agents[0]))
    assert len(opened._cache) == 0 and _nonzero(opened) == 0


async def test_close_wipes_every_slot(softhsm_token: SoftHsmToken, tmp_path: Path) -> None:
    opened, agents = await _open(softhsm_token, tmp_path / "state", CachePolicy(4, 60.0))
    for agent in agents:
        await opened.sign_event(agent, event(agent))
    assert _nonzero(opened) == 3
    await opened.aclose()
    assert _nonzero(opened) == 0


async def test_without_locked_memory_the_cache_stays_off(
    softhsm_token: SoftHsmToken, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, unseals: list[str],
) -> None:
    refuse: Callable[[Any, int], str] = lambda buffer, size: "mlock failed (errno 12)"
    monkeypatch.setattr(cache_module, "_mlock", refuse)
    opened, agents = await _open(softhsm_token, tmp_path / "state", CachePolicy(4, 60.0))
    try:
        assert not opened._cache.enabled and "cache stays off" in caplog.text
        unseals.clear()
        for _ in range(2):
            await opened.sign_event(agents[0], event(agents[0]))
        assert unseals == [agents[0]] * 2
    finally:
        await opened.aclose()


@pytest.mark.token_independent
@pytest.mark.parametrize(("entries", "seconds"), [(-1, 1.0), (65537, 1.0), (1, 0.0), (1, 3601.0)])
def test_the_policy_is_bounded(entries: int, seconds: float) -> None:
    with pytest.raises(ValueError):
        CachePolicy(entries, seconds)


async def test_the_cache_refuses_use_outside_the_token_worker(
    cached: tuple[Custody, list[str], _Clock]
) -> None:
    opened, agents, _ = cached
    with pytest.raises(AssertionError):
        opened._cache.get(agents[0], b"", Secret())
    assert await in_token_worker(lambda: opened._cache.get(agents[0], b"", Secret())) is False


async def test_one_hop_of_one_agents_events_unseals_once(
    softhsm_token: SoftHsmToken, tmp_path: Path, unseals: list[str]
) -> None:
    # observer.emit signs up to 256 events in one hop: one unseal per run of one agent's
    # events, not one per event, with the cache off (a TPM unseals in 8-15 ms).
    opened, agents = await _open(softhsm_token, tmp_path / "state", CachePolicy())
    try:
        unseals.clear()
        signed = await opened.sign_events([(agents[0], event(agents[0]))] * 256)
        assert len(signed) == 256 and unseals == [agents[0]]
        unseals.clear()
        a, b = agents[0], agents[1]
        mixed = await opened.sign_events([(a, event(a)), (a, event(a)), (b, event(b)), (a, event(a))])
        assert [e.pubkey for e in mixed] == [a, a, b, a]
        assert unseals == [a, b, a]
    finally:
        await opened.aclose()
