"""Rate limits and daily quotas: real credentials, a real limits.db, an injected clock; the
rule that a replay costs nothing belongs to the pipeline, so its test drives the whole
daemon in process (the `broker` fixture: real token, relay and ledger)."""

from __future__ import annotations

import math
import os
import re
import sqlite3
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import trio

from buzzwire.contract import ACTIONS, ErrorCode
from daemon.state.ratelimit import (
    CLASSES,
    DEFAULT_RATE_CONFIG,
    FLUSH_INTERVAL_SECONDS,
    LIMITS_FILENAME,
    LIVE_ACTIONS,
    PUBLISH_ACTIONS,
    READ_ACTIONS,
    RateConfig,
    RateLimiter,
    Rule,
    Window,
    format_rate,
    parse_rate,
    rate_config_from_table,
)
from daemon.state.sessions import Principal, SessionStore
from tests.fixtures.broker import BrokerHarness

CHANNEL = "123e4567-e89b-12d3-a456-426614174000"
#: 2026-11-30 12:00:00 UTC: noon, so the UTC day has 43,200 s left.
NOON = 1796040000.0
_REFUSED = re.compile(r"(rate limit|daily quota) (\S+) (\d+/\w+) reached; retry in (\d+) s")


@pytest.fixture
def principals(tmp_path: Path) -> Iterator[tuple[Principal, Principal]]:
    """Two real principals for two credentials of two agents."""
    store = SessionStore.open(tmp_path)
    out = []
    for agent in ("aa" * 32, "bb" * 32):
        _cid, token = store.issue(agent=agent, channels=frozenset({CHANNEL}),
                                  actions=frozenset({"message.post"}), ttl_seconds=None,
                                  uid=None, now=int(NOON))
        p = store.authenticate(f"Bearer {token}", None, int(NOON))
        assert p is not None
        out.append(p)
    yield out[0], out[1]


def refused(result: object) -> tuple[str, str, str, int]:
    """(kind, scope, rule, seconds) of a rate refusal; asserts it is one."""
    assert result is not None
    assert result.code is ErrorCode.UNAUTHORIZED  # type: ignore[attr-defined]
    match = _REFUSED.fullmatch(result.message)  # type: ignore[attr-defined]
    assert match is not None, result
    return match.group(1), match.group(2), match.group(3), int(match.group(4))


def test_parse_rate_forms() -> None:
    table = {
        "message.post=30/min": ("message.post", Rule(count=30, window=Window.MINUTE)),
        " publish=60/min ": ("publish", Rule(count=60, window=Window.MINUTE)),
        "publish=1000/day": ("publish", Rule(count=1000, window=Window.DAY)),
        "daily=1000": ("publish", Rule(count=1000, window=Window.DAY)),
        "read=5/s": ("read", Rule(count=5, window=Window.SECOND)),
        "channel.read=100/hour": ("channel.read", Rule(count=100, window=Window.HOUR)),
    }
    for text, expected in table.items():
        assert parse_rate(text) == expected
        assert parse_rate(format_rate(*expected)) == expected
    for bad in ("", "message.post", "message.post=30", "message.post=0/min", "sign=1/min",
                "message.post=30/fortnight", "daily=5/day", "publish=-1/min", "x" * 65,
                "message.post=30/min;drop", "PUBLISH=1/min", "publish=99999999999/min"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_limits_table() -> None:
    assert rate_config_from_table({}) == DEFAULT_RATE_CONFIG
    rules = dict(((s, r.daily), r) for s, r in DEFAULT_RATE_CONFIG.rules)
    assert rules[("publish", False)] == Rule(count=60, window=Window.MINUTE)
    assert rules[("publish", True)] == Rule(count=1000, window=Window.DAY)
    assert rules[("read", False)] == Rule(count=1800, window=Window.MINUTE)
    assert rules[("read", True)] == Rule(count=2_592_000, window=Window.DAY)
    assert rules[("live", False)] == Rule(count=180, window=Window.MINUTE)
    assert rules[("live", True)] == Rule(count=50_000, window=Window.DAY)
    cfg = rate_config_from_table({"publish": "10/s", "read_daily": 7,
                                  "rules": ["message.post=3/min", "read=1/h"]})
    got = dict(((s, r.daily), r) for s, r in cfg.rules)
    assert got[("publish", False)] == Rule(count=10, window=Window.SECOND)
    assert got[("read", True)] == Rule(count=7, window=Window.DAY)
    assert got[("read", False)] == Rule(count=1, window=Window.HOUR)  # rules win
    assert got[("message.post", False)] == Rule(count=3, window=Window.MINUTE)
    for table, key in (({"publish": "60/day"}, "publish"), ({"publish": 60}, "publish"),
                       ({"read_daily": 0}, "read_daily"), ({"enabled": "yes"}, "enabled"),
                       ({"rules": ["nope"]}, "rules"), ({"rules": "a=1/s"}, "rules"),
                       ({"burst": 1}, "burst"), ({"publish_daily": True}, "publish_daily")):
        with pytest.raises(ValueError, match=re.escape(f"[limits] {key}") + "|" +
                           re.escape(f"[limits] unknown key {key}")):
            rate_config_from_table(table)
    assert {"channel.read", "message.post", "message.reply", "reaction.add", "profile.set",
            "storage.address", "agents.create", "agents.update", "agents.delete"} <= (
        PUBLISH_ACTIONS | READ_ACTIONS)
    assert {"channel.read", "storage.address", "storage.get"} <= READ_ACTIONS
    assert "storage.put" in PUBLISH_ACTIONS
    assert {"presence.set", "typing.set", "observer.emit", "liveness.ping"} <= LIVE_ACTIONS
    assert not LIVE_ACTIONS & (PUBLISH_ACTIONS | READ_ACTIONS)
    assert PUBLISH_ACTIONS | READ_ACTIONS | LIVE_ACTIONS == set(ACTIONS)


def test_live_signals_count_apart_from_publish(tmp_path: Path) -> None:
    """A runtime's typing renewals spend the `live` class, never the `publish` allowance."""
    store = SessionStore.open(tmp_path)
    _cid, token = store.issue(agent="cc" * 32, channels=frozenset({CHANNEL}),
                              actions=frozenset(ACTIONS), ttl_seconds=None, uid=None,
                              now=int(NOON))
    p = store.authenticate(f"Bearer {token}", None, int(NOON))
    assert p is not None
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    # A burst of typing and presence signals, all in one second: the live bucket's 180.
    signals = [limiter.take(p, "typing.set" if i % 4 else "presence.set", NOON)
               for i in range(190)]
    assert signals[:180] == [None] * 180
    assert {refused(r)[1:3] for r in signals[180:]} == {("live", "180/min")}
    # Posts are untouched: the host's whole 60/min publish bucket is still there.
    posts = [limiter.take(p, "message.post", NOON) for _ in range(61)]
    assert posts[:60] == [None] * 60 and refused(posts[60])[1:3] == ("publish", "60/min")
    assert limiter.used_today(p.credential_id, "publish", NOON) == 60
    assert limiter.used_today(p.credential_id, "live", NOON) == 180
    # The class is configurable like the others, per host and per credential.
    cfg = rate_config_from_table({"live": "10/s", "live_daily": 7})
    assert ("live", Rule(count=10, window=Window.SECOND)) in cfg.rules
    assert ("live", Rule(count=7, window=Window.DAY)) in cfg.rules
    assert parse_rate("live=5/min") == ("live", Rule(count=5, window=Window.MINUTE))
    limiter.close()
    store.close()


#: Buzz's runtime (shared/spec/buzz-client.md): every BUZZ_BROKER_POLL_INTERVAL_MS, default
#: 1000 and minimum 100, one channel.read per configured channel, all day; a refusal is
#: logged and polling goes on, so a refused poll is a mention the agent does not hear.
#: What the shipped limits promise it (docs/operations.md, "Defaults"): (channels, interval).
_BUZZ_POLLING = {"8 channels at the default 1 s": (8, 1.0),
                 "2 channels at the 100 ms minimum": (2, 0.1)}
#: ... and, on top of the polls, what an agent reads besides: its start calls, then a
#: burst of this many reads (memory, history pages) once a minute, 5 a second on average.
_EXTRA_READS_PER_MINUTE = 300
#: The UTC day the simulations run through: 2026-12-01, 00:00 to 24:00.
_MIDNIGHT = NOON + 43200


def _read_day(limiter: RateLimiter, who: Principal, channels: int, interval: float,
              extra_per_minute: int) -> tuple[int, list[tuple[float, str]]]:
    """One UTC day of Buzz's polling (ticks of `interval`, `channels` reads each) plus
    `extra_per_minute` more reads at the top of each minute: (reads allowed, the first
    refusals as (seconds after 00:00, message))."""
    take = limiter.take
    per_minute = round(60 / interval)
    allowed = 0
    refusals: list[tuple[float, str]] = []
    actions = ["storage.address", "storage.get"]  # the runtime's start calls
    for tick in range(round(86400 / interval)):
        now = _MIDNIGHT + tick * interval
        if tick % per_minute == 0:
            actions += ["storage.get", "channel.read"] * (extra_per_minute // 2)
        actions += ["channel.read"] * channels
        for action in actions:
            result = take(who, action, now)
            if result is None:
                allowed += 1
            elif len(refusals) < 5:
                refusals.append((now - _MIDNIGHT, result.message))
        actions = []
    return allowed, refusals


@pytest.mark.slow
@pytest.mark.parametrize("pattern", sorted(_BUZZ_POLLING))
def test_a_day_of_buzz_polling_is_never_refused_by_the_shipped_limits(
    tmp_path: Path, principals: tuple[Principal, Principal], pattern: str
) -> None:
    """The shipped [limits] (LIMITS_TABLE_KEYS, every read rule in it) against a whole UTC
    day of Buzz's documented polling plus 5 other reads a second: nothing is refused. The
    defaults were 600/min and 50,000 a day: one channel at 1 s was deaf from 13.9 h UTC."""
    channels, interval = _BUZZ_POLLING[pattern]
    config = rate_config_from_table({})
    read_rules = {(s, r.daily) for s, r in config.rules if s == "read"}
    assert read_rules == {("read", False), ("read", True)}  # both kinds are in the run
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, config)
    allowed, refusals = _read_day(limiter, a, channels, interval, _EXTRA_READS_PER_MINUTE)
    assert refusals == []
    expected = 2 + round(86400 / interval) * channels + 1440 * _EXTRA_READS_PER_MINUTE
    assert allowed == expected
    assert limiter.used_today(a.credential_id, "read", _MIDNIGHT) == expected
    limiter.close()


def test_the_daily_read_quota_is_the_read_bucket_all_day() -> None:
    """A daily cap below what the bucket lets through in a day would refuse a client that
    never exceeds the bucket (a steady poller): the shipped read day holds the bucket's
    sustained rate for 24 hours, so the bucket is what bounds a reader."""
    rules = {(s, r.daily): r for s, r in DEFAULT_RATE_CONFIG.rules}
    bucket, day = rules[("read", False)], rules[("read", True)]
    assert day.count >= bucket.count * 86400 // bucket.window.seconds


def test_a_client_polling_far_above_buzz_is_still_refused(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A runaway reader (ten channels at the 100 ms minimum, 100 reads a second, five
    times what the defaults promise Buzz) is refused by the read bucket within its first
    minute and held to the bucket's rate after; another credential is untouched."""
    a, b = principals
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    bucket = dict(((s, r.daily), r) for s, r in DEFAULT_RATE_CONFIG.rules)[("read", False)]
    per_second = bucket.count / bucket.window.seconds
    allowed, first_refused = 0, None
    for tick in range(6000):  # ten minutes of ticks every 100 ms
        now = NOON + tick / 10
        for _ in range(10):
            result = limiter.take(a, "channel.read", now)
            if result is None:
                allowed += 1
                continue
            if first_refused is None:
                first_refused = now - NOON
            assert refused(result)[:3] == ("rate limit", "read", str(bucket))
    assert first_refused is not None and first_refused < 60
    # At most a full bucket and its refill over the ten minutes: a third of what was asked.
    assert allowed <= bucket.count + per_second * 600 + 1
    assert allowed < 60000 / 2
    assert limiter.take(b, "channel.read", NOON + 600) is None
    limiter.close()


def _turns(channels: int, until: float) -> list[tuple[float, str]]:
    """Buzz's live signals while it answers without pause in `channels` channels at once
    (docs/operations.md, "Live signals"): presence.set at start and stop; back-to-back 30 s
    turns, each opening with an observer.emit (tests/fleet/buzz_agent.py) and a typing.set
    renewed every 2 s through the turn, in step in every channel (the bucket's worst case).
    liveness.ping is left out: it is refused `unsupported` before the limits."""
    signals = [(_MIDNIGHT, "presence.set")]
    for turn in range(int(until // 30)):
        start = _MIDNIGHT + turn * 30
        for _ in range(channels):
            signals.append((start, "observer.emit"))
        for renewal in range(15):
            signals += [(start + renewal * 2, "typing.set")] * channels
    signals.append((_MIDNIGHT + until - 1, "presence.set"))
    return signals


def test_a_day_of_buzz_typing_in_one_channel_is_never_refused_by_the_shipped_limits(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A runtime answering in one channel all day long, without a pause, stays inside the
    shipped `live` limits: 46,082 signals of the 50,000 a day."""
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, rate_config_from_table({}))
    signals = _turns(1, 86400)
    assert [r for t, act in signals if (r := limiter.take(a, act, t)) is not None] == []
    assert limiter.used_today(a.credential_id, "live", _MIDNIGHT) == len(signals) == 46082
    limiter.close()


def test_typing_in_four_channels_at_once_meets_the_live_day_not_the_bucket(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """Four channels answered at once, without a pause, fit the `live` bucket all day
    (2.13 signals a second, 2 of them renewals); they meet the day's 50,000 after about
    six and a half hours. From then on every live signal is refused `unauthorized`, naming
    the day and the wait to 00:00 UTC, and the agent's posts and polls are untouched."""
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, rate_config_from_table({}))
    first = None
    for t, action in _turns(4, 86400):
        result = limiter.take(a, action, t)
        if result is None:
            assert first is None, "allowed again after the day's quota"
            continue
        kind, scope, rule, seconds = refused(result)
        assert (kind, scope, rule) == ("daily quota", "live", "50000/day")
        assert seconds == math.ceil(_MIDNIGHT + 86400 - t)
        if first is None:
            first = t - _MIDNIGHT
            assert limiter.take(a, "message.post", t) is None
            assert limiter.take(a, "channel.read", t) is None
    assert first is not None and 6 * 3600 < first < 7 * 3600
    assert limiter.used_today(a.credential_id, "live", _MIDNIGHT) == 50000
    limiter.close()


def test_loop_of_200_posts(tmp_path: Path, principals: tuple[Principal, Principal]) -> None:
    a, b = principals
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    limiter.set_overrides(a.credential_id, [parse_rate("message.post=30/min")])
    results = [limiter.take(a, "message.post", NOON + i * 0.01) for i in range(200)]
    assert results[:30] == [None] * 30
    for result in results[30:]:
        kind, scope, rule, seconds = refused(result)
        # Empty bucket refilling 30/min: one token every 2 s.
        assert (kind, scope, rule) == ("rate limit", "message.post", "30/min")
        assert 1 <= seconds <= 2
    # Another credential is unaffected, and meets the host's 60/min publish bucket.
    others = [limiter.take(b, "message.post", NOON) for _ in range(200)]
    assert others[:60] == [None] * 60
    assert {refused(r)[1:3] for r in others[60:]} == {("publish", "60/min")}
    # Reads have their own class: the exhausted publish bucket does not touch them.
    assert limiter.take(a, "channel.read", NOON) is None
    # The bucket refills at one token per 2 s: a second later one more post goes through,
    # then the next is refused again.
    assert limiter.take(a, "message.post", NOON + 3.0) is None
    assert refused(limiter.take(a, "message.post", NOON + 3.0))[1] == "message.post"
    assert limiter.used_today(a.credential_id, "publish", NOON) == 31
    limiter.close()


def test_refusal_takes_nothing(tmp_path: Path, principals: tuple[Principal, Principal]) -> None:
    a, _ = principals
    cfg = rate_config_from_table({"publish": "5/min", "rules": ["message.post=2/min"]})
    limiter = RateLimiter.open(tmp_path, cfg)
    for _ in range(2):
        assert limiter.take(a, "message.post", NOON) is None
    for _ in range(10):
        assert refused(limiter.take(a, "message.post", NOON))[1] == "message.post"
    # The refused posts took nothing from the class: three replies remain of five.
    assert [limiter.take(a, "message.reply", NOON) for _ in range(4)][:3] == [None] * 3
    assert limiter.used_today(a.credential_id, "publish", NOON) == 5
    limiter.close()


def test_daily_quota_and_the_longest_wait(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    a, _ = principals
    cfg = rate_config_from_table({"publish": "10/s", "publish_daily": 50})
    limiter = RateLimiter.open(tmp_path, cfg)
    allowed = sum(limiter.take(a, "reaction.add", NOON + i) is None for i in range(200))
    assert allowed == 50
    kind, scope, rule, seconds = refused(limiter.take(a, "reaction.add", NOON + 300))
    assert (kind, scope, rule) == ("daily quota", "publish", "50/day")
    assert seconds == 43200 - 300  # until 00:00 UTC
    # Both exhausted: the message names the one that frees up last (the day).
    for _ in range(10):
        limiter.take(a, "reaction.add", NOON + 300)
    assert refused(limiter.take(a, "reaction.add", NOON + 300))[0] == "daily quota"
    # A new UTC day: allowed again.
    assert limiter.take(a, "reaction.add", NOON + 43200) is None
    limiter.close()


def test_restart_keeps_the_days_count(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    a, b = principals
    cfg = rate_config_from_table({"publish": "100/s", "publish_daily": 40})
    limiter = RateLimiter.open(tmp_path, cfg)
    assert sum(limiter.take(a, "message.post", NOON + i) is None for i in range(25)) == 25
    assert sum(limiter.take(b, "message.post", NOON + i) is None for i in range(3)) == 3
    limiter.close()  # a clean stop flushes
    path = tmp_path / LIMITS_FILENAME
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    limiter = RateLimiter.open(tmp_path, cfg)
    assert limiter.used_today(a.credential_id, "publish", NOON) == 25
    allowed = sum(limiter.take(a, "message.post", NOON + 100 + i) is None for i in range(200))
    assert allowed == 15  # 40 a day, 25 already used before the restart
    assert limiter.used_today(b.credential_id, "publish", NOON) == 3
    limiter.close()


def test_restart_keeps_bucket_levels(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    a, _ = principals
    cfg = rate_config_from_table({"publish": "10/min"})
    limiter = RateLimiter.open(tmp_path, cfg)
    assert sum(limiter.take(a, "message.post", NOON) is None for _ in range(20)) == 10
    limiter.close()
    limiter = RateLimiter.open(tmp_path, cfg)
    # A restart is not a fresh burst: the bucket is still empty one second later.
    assert refused(limiter.take(a, "message.post", NOON + 1))[1] == "publish"
    limiter.close()


async def test_periodic_flush_and_crash_window(
    tmp_path: Path, principals: tuple[Principal, Principal], autojump_clock: trio.abc.Clock
) -> None:
    a, _ = principals
    assert FLUSH_INTERVAL_SECONDS == 5.0  # the crash window docs/operations.md states
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(limiter.flush_periodically)  # as daemon/wiring.py starts it
        for _ in range(7):
            assert limiter.take(a, "message.post", NOON) is None
        await trio.sleep(FLUSH_INTERVAL_SECONDS - 0.5)
        # Until the first flush, another process reading the file sees nothing: the
        # window a crash may lose (docs/operations.md).
        peek = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
        assert peek.used_today(a.credential_id, "publish", NOON) == 0
        peek.close()
        # The flush runs in a thread, so virtual time races ahead while it writes: the
        # wait is bounded in real time.
        deadline = time.monotonic() + 10
        while limiter.flushes == 0:
            assert time.monotonic() < deadline, "no flush"
            await trio.sleep(1)
        assert limiter.flushes == 1  # the first one, one interval in, wrote all seven
        peek = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
        assert peek.used_today(a.credential_id, "publish", NOON) == 7
        peek.close()
        nursery.cancel_scope.cancel()
    limiter.close()


def test_overrides_durable_and_seen_across_processes(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    a, b = principals
    daemon_side = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    # `credential issue --rate` runs in another process with its own connection.
    cli_side = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    cli_side.set_overrides(a.credential_id, [parse_rate("daily=3"),
                                             parse_rate("channel.read=2/min")])
    cli_side.close()
    assert [daemon_side.take(a, "message.post", NOON + i) is None for i in range(5)] == [
        True, True, True, False, False]
    assert [daemon_side.take(a, "channel.read", NOON) is None for _ in range(3)] == [
        True, True, False]
    assert daemon_side.take(b, "message.post", NOON) is None  # b keeps the host's limits
    # Overrides replace only the rule of the same scope and kind: the bucket stays 60/min.
    assert dict(((s, r.daily), r) for s, r in daemon_side.overrides(a.credential_id)) == {
        ("publish", True): Rule(count=3, window=Window.DAY),
        ("channel.read", False): Rule(count=2, window=Window.MINUTE),
    }
    # A later change is seen after reload() (SIGHUP), and survives a restart.
    daemon_side.set_overrides(a.credential_id, [])
    daemon_side.reload()
    assert daemon_side.take(a, "message.post", NOON + 10) is None
    daemon_side.close()
    again = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    assert again.overrides(a.credential_id) == ()
    again.close()
    with pytest.raises(ValueError):
        RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG).set_overrides(
            a.credential_id, [("sign", Rule(count=1, window=Window.SECOND))])


@pytest.mark.broker_config(limits={"publish_daily": 2})
async def test_replay_never_costs_quota(broker: BrokerHarness) -> None:
    """The pipeline's rule, through the real daemon (its ledger rules out a replay before
    the limiter is asked): a request sent five times costs one unit of a quota of two."""
    channel = str(uuid.uuid4())
    credential = broker.credential(await broker.human_owned_agent(), [channel])

    async def post(content: str) -> dict[str, object]:
        return await broker.call(credential, "message.post",
                                 {"channelId": channel, "content": content},
                                 request_id=f"replay-{content}")

    first = [await post("first") for _ in range(5)]
    assert [(e["status"], e.get("replayed", False)) for e in first] == \
        [("succeeded", False)] + [("succeeded", True)] * 4
    event_id = first[0]["outcome"]["eventId"]  # type: ignore[index]
    assert all(e["outcome"] == first[0]["outcome"] for e in first)  # published once
    # The four replays took nothing: the quota's second unit is still there...
    second = await post("second")
    assert second["status"] == "succeeded", second
    # ... and then it is spent: the quota is real.
    third = await post("third")
    assert third["status"] == "failed", third
    assert "daily quota publish 2/day reached" in third["error"]["message"]  # type: ignore[index]
    # Over the limit, a replay is still answered, from the ledger.
    again = await post("first")
    assert (again["status"], again["replayed"], again["outcome"]["eventId"]) == (  # type: ignore[index]
        "succeeded", True, event_id)


def test_disabled_and_clock_steps(tmp_path: Path, principals: tuple[Principal, Principal]) -> None:
    a, _ = principals
    off = RateLimiter.open(tmp_path, RateConfig(enabled=False, rules=DEFAULT_RATE_CONFIG.rules))
    assert all(off.take(a, "message.post", NOON) is None for _ in range(500))
    off.close()
    limiter = RateLimiter.open(tmp_path / ".." / tmp_path.name, rate_config_from_table(
        {"publish": "2/min"}))
    assert limiter.take(a, "profile.set", NOON) is None
    assert limiter.take(a, "profile.set", NOON) is None
    # The clock stepped back an hour: no refill, no negative level, and a wait that is
    # true: one unit in 30 s by the clock as it now reads. (It said so before, and the
    # bucket, stamped at NOON, stayed empty for the hour the clock took to get back there.)
    seconds = refused(limiter.take(a, "profile.set", NOON - 3600))[3]
    assert seconds == 30
    assert refused(limiter.take(a, "profile.set", NOON - 3600 + seconds - 1))[3] == 1
    assert limiter.take(a, "profile.set", NOON - 3600 + seconds) is None
    with pytest.raises(ValueError):
        limiter.take(a, "sign", NOON)
    limiter.close()


def test_an_idle_bucket_banks_one_burst_and_no_more(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, rate_config_from_table({"publish": "30/min"}))
    assert limiter.take(a, "message.post", NOON) is None
    # An hour idle refills the bucket to its count, 30, not to an hour's worth of units.
    later = [limiter.take(a, "message.post", NOON + 3600) for _ in range(31)]
    assert later[:30] == [None] * 30
    assert refused(later[30])[:3] == ("rate limit", "publish", "30/min")
    limiter.close()


def test_a_clock_stepped_back_refills_nothing_twice(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A step back refills nothing, nor does a second one: the bucket keeps its level and
    is read as stamped at the time the clock now reads, from which it refills at its rate
    (::test_a_clock_stepped_back_refills_from_where_it_reads)."""
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, rate_config_from_table({"publish": "2/min"}))
    assert limiter.take(a, "message.post", NOON) is None  # one unit left
    assert limiter.take(a, "message.post", NOON - 60) is None  # the last one: no refill
    assert refused(limiter.take(a, "message.post", NOON - 120))[1:] == ("publish", "2/min", 30)
    assert refused(limiter.take(a, "message.post", NOON - 91))[3] == 1
    assert limiter.take(a, "message.post", NOON - 90) is None
    limiter.close()


def test_a_clock_stepped_back_refills_from_where_it_reads(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A bucket stamped after the clock's time is read as stamped now (the module's rule
    for clock steps): the step refills nothing, and the bucket refills from there at its
    rate. A clock stepped back and then forward again refills the time it lived twice, at
    most the bucket's count, as any idle time does. (Before: the bucket kept its later
    stamp and refilled nothing until the clock passed it again.)"""
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, rate_config_from_table({"publish": "2/min"}))
    assert limiter.take(a, "message.post", NOON) is None  # one unit left
    # The clock steps back a minute: no refill, and the last unit is taken.
    assert limiter.take(a, "message.post", NOON - 60) is None
    assert refused(limiter.take(a, "message.post", NOON - 60))[1:] == ("publish", "2/min", 30)
    # One unit per 30 s, from the time the clock now reads.
    assert limiter.take(a, "message.post", NOON - 30) is None
    assert refused(limiter.take(a, "message.post", NOON - 30))[3] == 30
    # Stepped forward an hour: a full bucket, two units, and no more.
    assert [limiter.take(a, "message.post", NOON + 3600) is None for _ in range(3)] == [
        True, True, False]
    limiter.close()


def _poll(limiter: RateLimiter, who: Principal, start: float, seconds: int,
          per_second: int = 8) -> list[float]:
    """A Buzz runtime's reads, `per_second` each second of the clock from `start`; the
    clock times of the refused ones."""
    refusals = []
    for tick in range(seconds * per_second):
        at = start + tick / per_second
        if limiter.take(who, "channel.read", at) is not None:
            refusals.append(at)
    return refusals


def test_a_steady_reader_is_not_starved_by_a_clock_stepped_back(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A runtime polling 8 reads a second (the shipped `read` bucket is 1,800/min) and NTP
    stepping the clock back an hour: not one read refused. (Before: its bucket, stamped an
    hour ahead, refilled nothing; from ~224 s after the step every read but the odd one
    was refused for the rest of the hour, each refusal saying "retry in 1 s".)"""
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    assert _poll(limiter, a, NOON, 600) == []
    assert _poll(limiter, a, NOON + 600 - 3600, 3700) == []
    limiter.close()


def test_a_bucket_dated_ahead_in_the_file_is_restamped_at_load(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A clock two days ahead for a minute (a bad time source), a restart, the clock set
    right: the buckets written under the wrong clock starve nobody, and the file keeps no
    time the clock has not reached. (Before: the loaded bucket, dated two days ahead,
    refilled nothing for two days.)"""
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    assert _poll(limiter, a, NOON + 2 * 86400, 60) == []
    limiter.close()
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    assert _poll(limiter, a, NOON + 60, 1800) == []
    limiter.flush()
    conn = sqlite3.connect(tmp_path / LIMITS_FILENAME)
    try:
        stamps = [row[0] for row in conn.execute("SELECT at FROM buckets")]
    finally:
        conn.close()
    assert stamps and max(stamps) <= NOON + 60 + 1800
    limiter.close()


def test_a_bucket_a_step_left_untouched_is_restamped_at_the_next_day(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A credential used while the clock read a day ahead and not since: its bucket is
    restamped when the clock's day changes (here, the first request after the clock is set
    right, by another credential), so the file does not keep the wrong time until the
    clock reaches it."""
    a, b = principals
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    assert limiter.take(a, "message.post", NOON + 86400) is None
    assert limiter.take(b, "message.post", NOON) is None
    limiter.close()
    conn = sqlite3.connect(tmp_path / LIMITS_FILENAME)
    try:
        assert max(row[0] for row in conn.execute("SELECT at FROM buckets")) == NOON
    finally:
        conn.close()


def test_daily_counts_across_clock_steps(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """Yesterday, today and tomorrow of the clock's day are kept, and the day the clock
    last left (the module's rule for clock steps). A step back over midnight resets
    neither day: back at tomorrow the clock finds tomorrow's count, so a clock flapping
    over midnight gains nothing. A clock three days ahead for a while and then set right
    finds today's count still spent, across a restart too (before: the step out dropped
    today's count, and the day was whole again); the count it made out there is dropped
    at the next change of day, so that far day is whole when it comes (before: it stayed
    in limits.db and refused that day)."""
    a, _ = principals
    cfg = rate_config_from_table({"publish": "100/s", "publish_daily": 5})
    limiter = RateLimiter.open(tmp_path, cfg)
    midnight = NOON + 43200
    assert [limiter.take(a, "message.post", midnight - 5 + i) is None for i in range(5)] == [
        True] * 5
    assert [limiter.take(a, "message.post", midnight + i) is None for i in range(6)] == [
        True] * 5 + [False]
    # Stepped back over midnight: yesterday is spent; back at tomorrow, so is tomorrow.
    assert refused(limiter.take(a, "message.post", midnight - 1))[0] == "daily quota"
    assert refused(limiter.take(a, "message.post", midnight + 10))[0] == "daily quota"
    # Three days ahead for a while, then set right, then a restart: today is still spent.
    away = midnight + 3 * 86400
    assert [limiter.take(a, "message.post", away + i) is None for i in range(5)] == [True] * 5
    assert refused(limiter.take(a, "message.post", midnight + 20))[0] == "daily quota"
    limiter.close()
    limiter = RateLimiter.open(tmp_path, cfg)
    assert refused(limiter.take(a, "message.post", midnight + 30))[0] == "daily quota"
    # The next midnight: the far day's count goes, from memory and from the file.
    assert limiter.take(a, "message.post", midnight + 86400) is None
    limiter.close()
    conn = sqlite3.connect(tmp_path / LIMITS_FILENAME)
    try:
        days = {row[0] for row in conn.execute("SELECT day FROM daily")}
    finally:
        conn.close()
    assert days == {int(midnight // 86400), int(midnight // 86400) + 1}
    limiter = RateLimiter.open(tmp_path, cfg)
    assert [limiter.take(a, "message.post", away + 10 + i) is None for i in range(6)] == [
        True] * 5 + [False]
    limiter.close()


def test_a_restart_while_the_clock_reads_ahead_keeps_the_days_count(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A bad time source puts the clock three days ahead, the daemon restarts while it
    still reads so, then NTP sets it right: the day's quota, spent before the step, is
    still spent. limits.db's `clock` row says which day the last run left; a CLI process
    setting overrides meanwhile leaves that row alone. (Before: the day left was taken
    as the newest day in the file, the far day itself, so the real day's count was
    dropped at the first request and its quota handed out a second time.)"""
    a, b = principals
    cfg = rate_config_from_table({"publish": "100/s", "publish_daily": 5})
    limiter = RateLimiter.open(tmp_path, cfg)
    assert sum(limiter.take(a, "message.post", NOON + i) is None for i in range(10)) == 5
    away = NOON + 3 * 86400
    assert limiter.take(a, "message.post", away) is None
    limiter.close()
    cli_side = RateLimiter.open(tmp_path, cfg)
    cli_side.set_overrides(b.credential_id, [parse_rate("daily=9")])
    cli_side.close()
    limiter = RateLimiter.open(tmp_path, cfg)
    assert limiter.take(a, "message.post", away + 1) is None
    # Set right: the same UTC day as the five granted before the step.
    assert refused(limiter.take(a, "message.post", NOON + 100))[0] == "daily quota"
    assert limiter.used_today(a.credential_id, "publish", NOON) == 5
    limiter.close()
    # And a restart made after the clock was set right still finds it spent.
    limiter = RateLimiter.open(tmp_path, cfg)
    assert refused(limiter.take(a, "message.post", NOON + 200))[0] == "daily quota"
    limiter.close()


def test_a_file_without_the_clock_row_takes_its_newest_day_as_the_day_left(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """A limits.db from a build before the `clock` row: the newest day it counted on
    stands for the day the last run left, so a clock out three days and set right before
    the restart finds today's count still spent."""
    a, _ = principals
    cfg = rate_config_from_table({"publish": "100/s", "publish_daily": 5})
    limiter = RateLimiter.open(tmp_path, cfg)
    assert sum(limiter.take(a, "message.post", NOON + i) is None for i in range(5)) == 5
    assert limiter.take(a, "message.post", NOON + 3 * 86400) is None
    limiter.close()
    conn = sqlite3.connect(tmp_path / LIMITS_FILENAME)
    try:
        conn.execute("DROP TABLE clock")
        conn.commit()
    finally:
        conn.close()
    limiter = RateLimiter.open(tmp_path, cfg)
    assert refused(limiter.take(a, "message.post", NOON + 100))[0] == "daily quota"
    limiter.close()


def test_a_clock_wandering_among_three_far_days_gains_one_days_quota_per_return(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """The limit of the promise, as docs/operations.md states it: one day left is
    remembered, so a clock out to one far day, on to another and back finds the first
    whole again; what it hands out is that day's quota once per return, no more."""
    a, _ = principals
    cfg = rate_config_from_table({"publish": "100/s", "publish_daily": 5})
    limiter = RateLimiter.open(tmp_path, cfg)
    granted = []
    for visit in range(3):
        for day in (0, 10, 20):
            at = NOON + day * 86400 + visit * 60
            granted.append(sum(limiter.take(a, "message.post", at + i) is None
                               for i in range(10)))
    assert granted == [5] * 9
    limiter.close()


@pytest.mark.broker_config(limits={"read": "6/min"})
async def test_a_clock_stepped_back_starves_no_credential_through_the_daemon(
    broker: BrokerHarness,
) -> None:
    """The whole daemon, its pipeline's wall clock stepped back an hour: a credential that
    used its read bucket is let through again after the refusal's wait, as the refusal
    says, and every 5 minutes after. (Before: refused for the hour, "retry in 10 s".)"""
    channel = str(uuid.uuid4())
    cred = broker.credential(await broker.human_owned_agent(), [channel],
                             actions=["storage.address"])
    now = [time.time()]
    broker.app._clock = lambda: now[0]  # white box: the pipeline's wall clock

    async def read() -> dict[str, object]:
        return await broker.call(cred, "storage.address", {"slug": "core"})

    assert [(await read())["status"] for _ in range(7)] == ["succeeded"] * 6 + ["failed"]
    now[0] -= 3600  # NTP steps the clock back an hour
    refusal = await read()
    assert refusal["status"] == "failed"
    error = refusal["error"]
    assert isinstance(error, dict) and error["code"] == "unauthorized", refusal
    match = _REFUSED.fullmatch(error["message"])
    assert match is not None, refusal
    seconds = int(match.group(4))
    assert seconds == 10
    now[0] += seconds
    assert (await read())["status"] == "succeeded"
    for _ in range(12):
        now[0] += 300
        assert (await read())["status"] == "succeeded"


def test_the_limits_table_names_each_classs_actions() -> None:
    """docs/configuration.md's [limits] rows name the actions each class counts, as
    ratelimit.CLASSES (from the contract's table) has them: the rows had drifted to two
    read actions and two live ones."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for scope, actions in CLASSES.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{scope}` |"))
        assert set(re.findall(r"`([a-z]+\.[a-z]+)`", row)) == actions, scope


def test_both_exhausted_names_the_limit_that_frees_up_last(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """When a bucket and the daily quota are both empty, the refusal names the day (its
    wait is the longer one), not the bucket that frees up within seconds. (The existing
    test_daily_quota_and_the_longest_wait never empties the bucket: a refused request
    takes nothing.)"""
    a, _ = principals
    cfg = rate_config_from_table({"publish": "10/min", "publish_daily": 10})
    limiter = RateLimiter.open(tmp_path, cfg)
    assert all(limiter.take(a, "message.post", NOON) is None for _ in range(10))
    kind, scope, rule, seconds = refused(limiter.take(a, "message.post", NOON))
    assert (kind, scope, rule, seconds) == ("daily quota", "publish", "10/day", 43200)
    limiter.close()


def test_yesterdays_count_survives_a_clock_stepped_back_over_midnight(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """Yesterday's counters are kept a day: a clock that steps back over 00:00 UTC finds
    the day's quota still used, and does not hand out a second one."""
    a, _ = principals
    cfg = rate_config_from_table({"publish": "100/s", "publish_daily": 5})
    limiter = RateLimiter.open(tmp_path, cfg)
    midnight = NOON + 43200
    assert sum(limiter.take(a, "message.post", midnight - 10 + i / 10) is None
               for i in range(10)) == 5
    assert limiter.take(a, "message.post", midnight + 1) is None  # a new day
    # NTP steps the clock back 3 s: it is yesterday again, whose quota is spent.
    kind, *_ = refused(limiter.take(a, "message.post", midnight - 2))
    assert kind == "daily quota"
    limiter.close()


async def test_a_failed_periodic_flush_is_written_by_the_next_one(
    tmp_path: Path, principals: tuple[Principal, Principal], autojump_clock: trio.abc.Clock,
) -> None:
    """A flush that fails (disk full, locked) keeps its counts for the next flush: they
    reach the file once the disk takes them, and are not lost to a later restart."""
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    real_write = limiter._write
    failures = [1]

    def failing_once(snap: object) -> None:
        if failures[0]:
            failures[0] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        real_write(snap)  # type: ignore[arg-type]

    limiter._write = failing_once  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(limiter.flush_periodically, 5.0)
        for _ in range(7):
            assert limiter.take(a, "message.post", NOON) is None
        # Virtual time races ahead of the flush thread: bound the wait in real time.
        deadline = time.monotonic() + 10
        while limiter.flushes == 0:
            assert time.monotonic() < deadline, "the failed flush's counts were never written"
            await trio.sleep(1)
        assert failures == [0]
        peek = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
        assert peek.used_today(a.credential_id, "publish", NOON) == 7
        peek.close()
        nursery.cancel_scope.cancel()
    limiter.close()


def test_reload_reads_a_credentials_overrides_again(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """SIGHUP (`reload`) forgets the overrides read so far: rules written by another
    process for a credential this one has already seen apply from the next request."""
    a, _ = principals
    daemon_side = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    assert daemon_side.take(a, "message.post", NOON) is None  # a's (no) overrides cached
    cli_side = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    cli_side.set_overrides(a.credential_id, [parse_rate("daily=2")])
    cli_side.close()
    daemon_side.reload()
    assert daemon_side.take(a, "message.post", NOON + 1) is None
    kind, scope, rule, _ = refused(daemon_side.take(a, "message.post", NOON + 2))
    assert (kind, scope, rule) == ("daily quota", "publish", "2/day")
    daemon_side.close()


def test_old_days_are_deleted_from_the_file(
    tmp_path: Path, principals: tuple[Principal, Principal]
) -> None:
    """limits.db keeps the counters of the days around the clock's and of the day it last
    left only: a flush deletes the others, so the file (and what a restart loads) does
    not grow with the daemon's age. (The day left is kept until the next change of day:
    a clock stepped out and back finds it; tests/guardrails/test_ratelimit.py
    ::test_daily_counts_across_clock_steps.)"""
    a, _ = principals
    limiter = RateLimiter.open(tmp_path, DEFAULT_RATE_CONFIG)
    assert limiter.take(a, "message.post", NOON) is None
    limiter.flush()
    assert limiter.take(a, "message.post", NOON + 3 * 86400) is None
    assert limiter.take(a, "message.post", NOON + 4 * 86400) is None
    limiter.flush()
    limiter.close()
    conn = sqlite3.connect(tmp_path / LIMITS_FILENAME)
    try:
        days = {row[0] for row in conn.execute("SELECT day FROM daily")}
    finally:
        conn.close()
    assert days == {int((NOON + 3 * 86400) // 86400), int((NOON + 4 * 86400) // 86400)}
