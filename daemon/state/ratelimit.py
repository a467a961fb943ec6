"""Per-credential rate limits (token buckets) and daily quotas, kept across restarts.

Rules (issue 10):
- A *rule* is `<count>/<window>`: `30/min`, `5/s`, `100/h` are token buckets (capacity
  `count`, refilled continuously at `count` per window, so a burst of `count` is allowed
  and the long-run rate is `count` per window); `1000/day` is a daily quota (a plain
  counter per UTC calendar day, reset at 00:00 UTC). A rule applies to a *scope*: one
  wire action name (`message.post`), or a class: `publish` (every publishing action,
  counted together), `read` (channel.read, storage.address, storage.get) or `live`
  (NIP-BA's live signals, presence.set, typing.set, observer.emit and liveness.ping:
  counted apart from `publish` so a runtime's renewals cannot use up the allowance its
  messages need). Which action is in which class is the contract's `rate_class` (`CLASSES`).
- The written form, one string per rule, is the same for the host and for a credential:
  `<scope>=<count>/<window>`, e.g. `message.post=30/min`, `publish=60/min`,
  `publish=1000/day`; `daily=<count>` is shorthand for `publish=<count>/day`.
  `parse_rate` reads it; windows are `s`, `min`, `h`, `day` (and their long spellings).
- Each scope has at most one bucket and one daily quota. A credential's overrides
  replace the host's rule of the same scope and kind (bucket or daily) and leave the
  others in force. A request is allowed only when every rule that applies to its
  action (its own scope and its class) allows it; only then is one unit taken from each.
  So a refused request costs nothing.
- A refusal is `policy.Refusal(UNAUTHORIZED, <fixed template>)` naming the limit and the
  whole seconds until it frees up (the longest wait when several limits are exhausted).
- The caller asks only for *fresh* requests: the pipeline calls `take()` after the
  ledger has said the request is not a replay, so a replayed request (same requestId and
  bytes) never costs quota. This module cannot see replays; that rule lives in the caller.
- The clock is the wall clock (`now` is handed in), and it can step: NTP setting it right,
  a VM resumed, a bad RTC corrected after boot. A bucket stamped after `now` is read as
  stamped `now`: the step refills nothing and starves nothing (the bucket refills from
  `now`, so its refusal's wait is true). That holds for a bucket loaded from limits.db
  dated ahead (a clock ahead, then a restart): the first request after the load restamps
  every such bucket. Daily counters are kept for yesterday, today and tomorrow of the
  clock's day, and for the day the clock last left (`_kept_days`). limits.db's `clock`
  row keeps those two days across a restart, written in the flush that writes the counts
  they keep (a file from a build before the row takes its newest day as the day left).
  So a step back over midnight, or out to another day and back, finds every count it
  made, also across a restart made while the clock was out: no such step hands out a
  second quota for a day, and a clock flapping over midnight gains nothing. One day left
  is remembered, not more (each would hold every credential's counters): a clock that
  wanders among three or more days far apart, out to one, on to another and back to the
  first, finds the first whole again, one day's quota per return at most. A day the
  clock left that is not next to it goes at the next change of day; what that can hand a
  client is the count made on it (a clock days ahead for a while, then set right), one
  day's quota at most. A clock a day or two ahead for a while charges its counts to that
  day when it comes, one day's quota at most. A step back of days re-lives them, each its
  quota once, at the clock's pace.

Theory of operation — the hot path and durability:
`take()` is synchronous and touches only dicts (the daemon targets >= 2,500 posts/s).
Changed counters are marked dirty; `flush()` writes them to `<state>/limits.db` (0600,
WAL) in one transaction. `flush_periodically()` (a task in the daemon's nursery) does it
every `FLUSH_INTERVAL_SECONDS` in a worker thread, and `close()` does it once more. A
clean restart therefore keeps the day's counts and the bucket levels exactly; a crash may
lose up to `FLUSH_INTERVAL_SECONDS` of counting — the trade-off we take instead of an
fsync per request. Overrides are written at once (`credential issue --rate`, usually in
another process) and read lazily, the first time this process sees a credential id;
`reload()` (SIGHUP) forgets what was read.

WARNING: `PUBLISH_ACTIONS`/`READ_ACTIONS`/`LIVE_ACTIONS` must cover exactly the wire actions
(`buzzwire.contract.ACTIONS`, split on `ActionSpec.rate_class`); `_SCHEMA` is read by `_load`
and written by `_write` (the `clock` row with the counts, in one transaction).
"""

from __future__ import annotations

import enum
import json
import logging
import math
import re
import sqlite3
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import trio

from daemon.state._sqlite import open_private_db, transaction
from buzzwire.contract import ACTIONS, ErrorCode, RateClass
from daemon.log import log_event
from daemon.pipeline.policy import Refusal

__all__ = [
    "Rule",
    "Window",
    "RateConfig",
    "RateLimiter",
    "parse_rate",
    "rate_config_from_table",
    "format_rate",
    "DEFAULT_RATE_CONFIG",
    "LIMITS_FILENAME",
    "FLUSH_INTERVAL_SECONDS",
    "PUBLISH_ACTIONS",
    "READ_ACTIONS",
    "LIVE_ACTIONS",
    "CLASSES",
    "LIMITS_TABLE_KEYS",
]

_log = logging.getLogger("buzz_broker.ratelimit")

#: The file under the state directory.
LIMITS_FILENAME: Final = "limits.db"

#: How often counts reach the disk. A crash loses at most this much counting; chosen so a
#: runaway agent gains at most a few seconds' allowance per crash, while the daemon pays
#: one small transaction every few seconds instead of one fsync per request.
FLUSH_INTERVAL_SECONDS: Final = 5.0

#: Largest count a rule may name: far beyond any sane limit, small enough to stay exact.
MAX_COUNT: Final = 10**9

#: Longest rule string accepted, before any parsing (bounded input, style.md #9).
MAX_RULE_CHARS: Final = 64

#: Most rules one credential may carry (NIP-BA's 15 actions + 3 classes, x 2 kinds = 36).
MAX_RULES: Final = 40

_DAY_SECONDS: Final = 86400

#: Days kept around the clock's day, as offsets: yesterday (a clock a little behind still
#: finds it), today, tomorrow (a clock stepped back over midnight finds it when it gets
#: there again: no second quota). With the day the clock last left, every other day's
#: counter is dropped (module docstring: clock steps).
_AROUND_TODAY: Final = (-1, 0, 1)

PUBLISH_ACTIONS: Final = frozenset(
    name for name, spec in ACTIONS.items() if spec.rate_class is RateClass.PUBLISH)
READ_ACTIONS: Final = frozenset(
    name for name, spec in ACTIONS.items() if spec.rate_class is RateClass.READ)
LIVE_ACTIONS: Final = frozenset(
    name for name, spec in ACTIONS.items() if spec.rate_class is RateClass.LIVE)

#: Class scope -> the actions it counts together.
CLASSES: Final[Mapping[str, frozenset[str]]] = {
    "publish": PUBLISH_ACTIONS,
    "read": READ_ACTIONS,
    "live": LIVE_ACTIONS,
}

_SCOPES: Final = frozenset(ACTIONS) | frozenset(CLASSES)


class Window(enum.Enum):
    """The window of a rule; the value is (seconds, canonical spelling)."""

    #: token bucket refilled `count` per second
    SECOND = (1, "s")
    #: token bucket refilled `count` per minute
    MINUTE = (60, "min")
    #: token bucket refilled `count` per hour
    HOUR = (3600, "h")
    #: a quota: `count` per UTC calendar day, reset at 00:00 UTC
    DAY = (_DAY_SECONDS, "day")

    @property
    def seconds(self) -> int:
        return self.value[0]

    @property
    def spelling(self) -> str:
        return self.value[1]


_WINDOW_NAMES: Final[Mapping[str, Window]] = {
    "s": Window.SECOND, "sec": Window.SECOND, "second": Window.SECOND,
    "m": Window.MINUTE, "min": Window.MINUTE, "minute": Window.MINUTE,
    "h": Window.HOUR, "hour": Window.HOUR,
    "d": Window.DAY, "day": Window.DAY,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """`count` per `window`: a token bucket, or a daily quota when the window is DAY."""

    count: int
    window: Window

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int):
            raise TypeError("Rule.count must be an int")
        if not 1 <= self.count <= MAX_COUNT:
            raise ValueError(f"Rule.count must be in 1..{MAX_COUNT}")
        if not isinstance(self.window, Window):
            raise TypeError("Rule.window must be a Window")

    @property
    def daily(self) -> bool:
        return self.window is Window.DAY

    def __str__(self) -> str:
        return f"{self.count}/{self.window.spelling}"


_RULE_RE: Final = re.compile(r"([a-z]+(?:\.[a-z]+)?)=([0-9]{1,10})(?:/([a-z]+))?")

_RATE_FORM: Final = (
    "expected <scope>=<count>/<window> (window s, min, h or day; scope an action name, "
    "publish, read or live), or daily=<count>"
)


def parse_rate(text: str) -> tuple[str, Rule]:
    """Read one rule: `message.post=30/min` -> ("message.post", Rule(30, MINUTE)).

    `daily=N` is shorthand for `publish=N/day`. Surrounding spaces are ignored; case is not
    (action names are lowercase on the wire).

    Raises:
        ValueError: a one-line message naming the accepted form (safe to show an operator;
            it quotes nothing back but the scope when the scope is the fault).
    """
    if not isinstance(text, str):
        raise TypeError("parse_rate takes a string")
    if len(text) > MAX_RULE_CHARS:
        raise ValueError(f"rate rule too long; {_RATE_FORM}")
    match = _RULE_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"bad rate rule; {_RATE_FORM}")
    scope, count_text, unit = match.groups()
    if scope == "daily":
        if unit is not None:
            raise ValueError("daily=<count> takes a bare count (it means publish=<count>/day)")
        scope, window = "publish", Window.DAY
    else:
        if unit is None or unit not in _WINDOW_NAMES:
            raise ValueError(f"bad rate window; {_RATE_FORM}")
        window = _WINDOW_NAMES[unit]
    if scope not in _SCOPES:
        raise ValueError(
            f"unknown rate scope {scope!r}; expected an action name, publish, read or live"
        )
    count = int(count_text)
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"rate count must be in 1..{MAX_COUNT}")
    return scope, Rule(count=count, window=window)


def format_rate(scope: str, rule: Rule) -> str:
    """The canonical written form `parse_rate` reads back: `publish=60/min`."""
    return f"{scope}={rule}"


def _identity(scope: str, rule: Rule) -> tuple[str, bool]:
    # A scope holds one bucket and one daily quota; a later rule of the same kind replaces.
    return scope, rule.daily


def _merge(*layers: Iterable[tuple[str, Rule]]) -> tuple[tuple[str, Rule], ...]:
    merged: dict[tuple[str, bool], tuple[str, Rule]] = {}
    for layer in layers:
        for scope, rule in layer:
            merged[_identity(scope, rule)] = (scope, rule)
    return tuple(sorted(merged.values(), key=lambda sr: (sr[0], sr[1].daily)))


@dataclass(frozen=True, slots=True, kw_only=True)
class RateConfig:
    """The host's limits (config `[limits]`). `rules` hold one bucket and one quota per scope."""

    enabled: bool
    rules: tuple[tuple[str, Rule], ...]

    def __post_init__(self) -> None:
        for scope, rule in self.rules:
            if scope not in _SCOPES or not isinstance(rule, Rule):
                raise ValueError(f"RateConfig: bad rule for scope {scope!r}")
        if len({_identity(s, r) for s, r in self.rules}) != len(self.rules):
            raise ValueError("RateConfig: two rules of one kind for one scope")


#: `[limits]` keys and their defaults, as written in TOML: the one table of the shipped
#: limits (`DEFAULT_RATE_CONFIG` is read from it; docs/configuration.md and docs/operations.md
#: quote it, tests/docs/test_limits_defaults.py holds them to it). The reasoning, with the
#: tests that hold each figure to Buzz's documented traffic, is docs/operations.md "Defaults":
#: - publish: a person-paced agent never meets 60/min; a loop stops for the day at 1,000.
#: - read: Buzz's runtime polls each channel every 1 s (100 ms at the least) all day, and a
#:   refused poll is a mention it does not hear. 1,800/min carries 2 channels at 100 ms (20
#:   polls a second) plus 5 other reads a second; the day is that bucket's 30 a second for
#:   24 h, so the day never refuses a steady reader the bucket lets through.
#: - live: 180/min carries typing renewals and each turn's observer.emit in four channels at
#:   once; the day stays below the bucket's on purpose: a live signal is a ledger record in
#:   its agent's share, and 50,000 a day is a runtime answering one channel all day.
LIMITS_TABLE_KEYS: Final[Mapping[str, object]] = {
    "enabled": True,
    "publish": "60/min",
    "publish_daily": 1000,
    "read": "1800/min",
    "read_daily": 2_592_000,
    "live": "180/min",
    "live_daily": 50_000,
    "rules": [],
}


def rate_config_from_table(table: Mapping[str, object]) -> RateConfig:
    """Read the `[limits]` TOML table (absent keys take `LIMITS_TABLE_KEYS` defaults).

    Keys: `enabled` (bool), `publish` / `read` / `live` (bucket, `"<count>/<s|min|h>"`),
    `publish_daily` / `read_daily` / `live_daily` (integer per UTC day), `rules` (array of
    `<scope>=<count>/<window>` strings, applied last: per-action limits live here).

    Raises:
        ValueError: one line naming the key (`[limits] publish: expected ...`); the config
            loader turns it into a ConfigError.
    """
    for key in table:
        if key not in LIMITS_TABLE_KEYS:
            raise ValueError(f"[limits] unknown key {key}")
    values = {**LIMITS_TABLE_KEYS, **table}

    enabled = values["enabled"]
    if not isinstance(enabled, bool):
        raise ValueError("[limits] enabled: expected true or false")
    rules: list[tuple[str, Rule]] = []
    for scope in CLASSES:
        bucket = values[scope]
        try:
            if not isinstance(bucket, str):
                raise ValueError
            _, rule = parse_rate(f"{scope}={bucket}")
            if rule.daily:
                raise ValueError
        except ValueError:
            raise ValueError(
                f'[limits] {scope}: expected a rate like "60/min" (window s, min or h)'
            ) from None
        rules.append((scope, rule))
        daily = values[f"{scope}_daily"]
        if isinstance(daily, bool) or not isinstance(daily, int) or not 1 <= daily <= MAX_COUNT:
            raise ValueError(f"[limits] {scope}_daily: expected an integer in 1..{MAX_COUNT}")
        rules.append((scope, Rule(count=daily, window=Window.DAY)))
    extra = values["rules"]
    if not isinstance(extra, list) or len(extra) > MAX_RULES:
        raise ValueError(f"[limits] rules: expected an array of at most {MAX_RULES} strings")
    parsed: list[tuple[str, Rule]] = []
    for item in extra:
        if not isinstance(item, str):
            raise ValueError("[limits] rules: expected strings like \"message.post=30/min\"")
        try:
            parsed.append(parse_rate(item))
        except ValueError as exc:
            raise ValueError(f"[limits] rules: {exc}") from None
    return RateConfig(enabled=enabled, rules=_merge(rules, parsed))


#: The shipped limits: `LIMITS_TABLE_KEYS` read as an empty `[limits]` table is.
DEFAULT_RATE_CONFIG: Final = rate_config_from_table({})


class _Who(Protocol):
    """What the limiter reads from a principal (`daemon.state.sessions.Principal` has it)."""

    @property
    def credential_id(self) -> str: ...


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float


_BUCKET_TEMPLATE: Final = "rate limit {scope} {rule} reached; retry in {seconds} s"
_DAILY_TEMPLATE: Final = "daily quota {scope} {rule} reached; retry in {seconds} s"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS overrides (
    credential_id TEXT PRIMARY KEY,
    rules         TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS daily (
    credential_id TEXT    NOT NULL,
    scope         TEXT    NOT NULL,
    day           INTEGER NOT NULL,
    used          INTEGER NOT NULL,
    PRIMARY KEY (credential_id, scope, day)
);
CREATE TABLE IF NOT EXISTS buckets (
    credential_id TEXT NOT NULL,
    scope         TEXT NOT NULL,
    level         REAL NOT NULL,
    at            REAL NOT NULL,
    PRIMARY KEY (credential_id, scope)
);
CREATE TABLE IF NOT EXISTS clock (
    one      INTEGER PRIMARY KEY CHECK (one = 1),
    today    INTEGER NOT NULL,
    left_day INTEGER NOT NULL
)
"""

_Key = tuple[str, str]  # (credential_id, scope)
_DayKey = tuple[str, str, int]  # (credential_id, scope, UTC day number)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    buckets: tuple[tuple[str, str, float, float], ...]
    daily: tuple[tuple[str, str, int, int], ...]
    #: the days whose counters the file keeps (`_kept_days`); empty before the first
    #: request, when the clock's day is not known yet: then nothing is dropped.
    kept_days: frozenset[int]
    #: buckets stamped before this are forgotten (`_new_day`); None before the first request
    idle_before: float | None
    #: (today, the day last left) for the `clock` row, written with the counts they keep;
    #: None before the first request (a process that counted nothing, such as the CLI
    #: setting overrides, leaves the daemon's row alone)
    days: tuple[int, int] | None


class RateLimiter:
    """Buckets and quotas per credential. Create with `RateLimiter.open(state_dir, config)`."""

    def __init__(self, conn: sqlite3.Connection, config: RateConfig) -> None:
        # Private: use RateLimiter.open(). The connection is ours alone; `_db_lock` keeps
        # the flusher thread and the event loop (override reads) from interleaving on it.
        self._conn = conn
        self._db_lock = threading.Lock()
        self._config = config
        self._buckets: dict[_Key, _Bucket] = {}
        self._daily: dict[_DayKey, int] = {}
        self._dirty_buckets: set[_Key] = set()
        self._dirty_daily: set[_DayKey] = set()
        self._overrides: dict[str, tuple[tuple[str, Rule], ...]] = {}
        self._plans: dict[tuple[str, str], tuple[tuple[str, Rule], ...]] = {}
        self._today = -1
        #: the clock's day before its last change of day (-1: none)
        self._left = -1
        #: the last run's today from limits.db's `clock` row, until the first request
        #: (-1: none, or a file from a build before the row)
        self._resumed_today = -1
        #: the day changed since the last flush (the `clock` row is due)
        self._days_dirty = False
        self._closed = False
        #: how many flush transactions committed (tests and the benchmark read it).
        self.flushes = 0

    @classmethod
    def open(cls, state_dir: Path | str, config: RateConfig) -> RateLimiter:
        """Open or create `<state_dir>/limits.db` and load the saved counts.

        Raises:
            OSError / sqlite3.Error: the database cannot be opened (a startup fault).
        """
        conn = open_private_db(Path(state_dir) / LIMITS_FILENAME, _SCHEMA)
        limiter = cls(conn, config)
        limiter._load()
        return limiter

    def _load(self) -> None:
        with self._db_lock:
            for cid, scope, level, at in self._conn.execute(
                "SELECT credential_id, scope, level, at FROM buckets"
            ):
                self._buckets[(str(cid), str(scope))] = _Bucket(float(level), float(at))
            for cid, scope, day, used in self._conn.execute(
                "SELECT credential_id, scope, day, used FROM daily"
            ):
                self._daily[(str(cid), str(scope), int(day))] = int(used)
            row = self._conn.execute("SELECT today, left_day FROM clock").fetchone()
        if row is not None:
            # The last run's days, as flushed with its counts: the first request goes on
            # from them as if the process had never stopped.
            self._resumed_today, self._left = int(row[0]), int(row[1])
        else:
            # A file from a build before the `clock` row: the day the last run left is not
            # known, and the newest day it counted on stands for it (the last run's today,
            # or the day it left if further ahead). Wrong after a restart made while the
            # clock read a day ahead (that day is the newest): the reason for the row.
            self._left = max((k[2] for k in self._daily), default=-1)

    # ------------------------------------------------------------------ configuration

    def reconfigure(self, config: RateConfig) -> None:
        """New host limits (SIGHUP). Counts and levels carry over."""
        self._config = config
        self._plans.clear()

    def reload(self) -> None:
        """Forget cached overrides; they are read again on each credential's next request."""
        self._overrides.clear()
        self._plans.clear()

    def set_overrides(self, credential_id: str, rules: Sequence[tuple[str, Rule]]) -> None:
        """Store `rules` (from `parse_rate`) for one credential, durably, replacing any before.

        An empty sequence removes the overrides (the host's limits apply).

        Raises:
            ValueError: too many rules, or a scope that is not an action or class.
        """
        if len(rules) > MAX_RULES:
            raise ValueError(f"at most {MAX_RULES} rate rules per credential")
        for scope, rule in rules:
            if scope not in _SCOPES or not isinstance(rule, Rule):
                raise ValueError(f"unknown rate scope {scope!r}")
        merged = _merge(rules)
        encoded = json.dumps([format_rate(s, r) for s, r in merged])
        with self._db_lock:
            if merged:
                self._conn.execute(
                    "INSERT INTO overrides (credential_id, rules) VALUES (?, ?) "
                    "ON CONFLICT (credential_id) DO UPDATE SET rules = excluded.rules",
                    (credential_id, encoded),
                )
            else:
                self._conn.execute(
                    "DELETE FROM overrides WHERE credential_id = ?", (credential_id,)
                )
        self._overrides[credential_id] = merged
        self._plans = {k: v for k, v in self._plans.items() if k[0] != credential_id}

    def overrides(self, credential_id: str) -> tuple[tuple[str, Rule], ...]:
        """The credential's own rules (empty when the host's apply unchanged)."""
        cached = self._overrides.get(credential_id)
        if cached is not None:
            return cached
        with self._db_lock:
            row = self._conn.execute(
                "SELECT rules FROM overrides WHERE credential_id = ?", (credential_id,)
            ).fetchone()
        rules: tuple[tuple[str, Rule], ...] = ()
        if row is not None:
            try:
                rules = _merge(parse_rate(str(t)) for t in json.loads(str(row[0])))
            except (ValueError, TypeError):
                # A row we cannot read must not lift the limits: keep the host's rules and
                # tell the operator (the row is only ever written by set_overrides).
                log_event(_log, "ratelimit.override_unreadable", level=logging.ERROR,
                          credential=credential_id)
        self._overrides[credential_id] = rules
        return rules

    def _plan(self, credential_id: str, action: str) -> tuple[tuple[str, Rule], ...]:
        key = (credential_id, action)
        plan = self._plans.get(key)
        if plan is None:
            rules = _merge(self._config.rules, self.overrides(credential_id))
            cls = ACTIONS[action].rate_class.value
            plan = tuple((s, r) for s, r in rules if s == action or s == cls)
            self._plans[key] = plan
        return plan

    # ------------------------------------------------------------------ the hot path

    def take(self, principal: _Who, action: str, now: float) -> Refusal | None:
        """Take one unit from every limit on `action` for this credential, or refuse.

        Call it only for fresh requests (after the ledger ruled out a replay): a replay
        must never cost quota. A refused request takes nothing.

        Args:
            principal: the authenticated principal (its `credential_id` is the key).
            action: a wire action name.
            now: seconds since the epoch (injected; tests drive it).

        Returns:
            None when allowed (units taken), else `Refusal(UNAUTHORIZED, message)` naming the
            limit and the whole seconds until it frees up.

        Raises:
            ValueError: `action` is not a wire action name (a bug: validation came first).
        """
        if action not in ACTIONS:
            raise ValueError(f"not a wire action: {action!r}")
        if not self._config.enabled:
            return None
        cid = principal.credential_id
        day = int(now // _DAY_SECONDS)
        if day != self._today:
            self._new_day(day, now)
        plan = self._plan(cid, action)

        worst: tuple[float, str, Rule] | None = None
        fills: list[tuple[_Key, _Bucket, float]] = []
        for scope, rule in plan:
            if rule.daily:
                used = self._daily.get((cid, scope, day), 0)
                if used >= rule.count:
                    wait = (day + 1) * _DAY_SECONDS - now
                    worst = _longer(worst, wait, scope, rule)
                continue
            key = (cid, scope)
            bucket = self._buckets.get(key)
            per_second = rule.count / rule.window.seconds
            if bucket is None:
                level = float(rule.count)
                bucket = _Bucket(level, now)
            else:
                self._restamp(key, bucket, now)
                level = min(float(rule.count), bucket.level + (now - bucket.at) * per_second)
            if level < 1.0:
                worst = _longer(worst, (1.0 - level) / per_second, scope, rule)
            fills.append((key, bucket, level))
        if worst is not None:
            wait, scope, rule = worst
            template = _DAILY_TEMPLATE if rule.daily else _BUCKET_TEMPLATE
            seconds = max(1, math.ceil(wait))
            return Refusal(
                ErrorCode.UNAUTHORIZED,
                template.format(scope=scope, rule=rule, seconds=seconds),
            )
        for key, bucket, level in fills:
            bucket.level = level - 1.0
            bucket.at = now
            self._buckets[key] = bucket
            self._dirty_buckets.add(key)
        for scope, rule in plan:
            if rule.daily:
                dkey = (cid, scope, day)
                self._daily[dkey] = self._daily.get(dkey, 0) + 1
                self._dirty_daily.add(dkey)
        return None

    def used_today(self, credential_id: str, scope: str, now: float) -> int:
        """How many units of `scope`'s daily quota the credential used on `now`'s UTC day."""
        return self._daily.get((credential_id, scope, int(now // _DAY_SECONDS)), 0)

    def _restamp(self, key: _Key, bucket: _Bucket, now: float) -> None:
        # A bucket stamped after `now` was stamped by a clock since set back. Left so, it
        # would refill nothing until the clock passed that time again (a 1 h step back
        # starved a steady reader for the hour, each refusal saying "retry in 1 s"). Read
        # as stamped now it keeps its level: the step refills nothing and starves nothing.
        # (Keeping the later time, the other way, is what starved; moving the stamp back
        # lets a clock stepped back and forward again refill the gap, at most the
        # bucket's count, as any idle time does.)
        if bucket.at > now:
            bucket.at = now
            self._dirty_buckets.add(key)

    def _kept_days(self) -> frozenset[int]:
        if self._today < 0:
            return frozenset()
        around = frozenset(self._today + d for d in _AROUND_TODAY)
        return around | {self._left} if self._left >= 0 else around

    def _new_day(self, day: int, now: float) -> None:
        # The clock's day changed: by midnight, by a step, or this is the first request
        # since the load. Counters outside `_kept_days` are dropped here and from the
        # database at the next flush (module docstring: clock steps). The first request
        # after a load goes on from the last run's today (the `clock` row): a restart is
        # no change of day, and a day the clock left before it is still the day left.
        last = self._today if self._today >= 0 else self._resumed_today
        if last >= 0 and last != day:
            self._left = last
        self._today = day
        self._days_dirty = True
        kept = self._kept_days()
        for key in [k for k in self._daily if k[2] not in kept]:
            del self._daily[key]
            self._dirty_daily.discard(key)
        # Every bucket dated ahead, loaded or touched before a step, is restamped (it is
        # also done at each touch: a step within one day does not come here), so limits.db
        # keeps no time the clock has not reached.
        for bkey, bucket in self._buckets.items():
            self._restamp(bkey, bucket, now)
        # A bucket untouched for a day is full again under any window up to an hour, which
        # is what a missing bucket means: forget it (revoked credentials stop costing memory).
        idle = (day - 1) * _DAY_SECONDS
        for bkey in [k for k, b in self._buckets.items() if b.at < idle]:
            del self._buckets[bkey]
            self._dirty_buckets.discard(bkey)

    # ------------------------------------------------------------------ durability

    def _snapshot(self) -> _Snapshot:
        # On the event loop: copy what changed, so the worker thread never reads live dicts.
        buckets = tuple(
            (k[0], k[1], b.level, b.at)
            for k in self._dirty_buckets
            if (b := self._buckets.get(k)) is not None
        )
        daily = tuple(
            (k[0], k[1], k[2], self._daily[k]) for k in self._dirty_daily if k in self._daily
        )
        self._dirty_buckets.clear()
        self._dirty_daily.clear()
        self._days_dirty = False
        if self._today < 0:
            return _Snapshot(buckets, daily, frozenset(), None, None)
        idle = float((self._today - 1) * _DAY_SECONDS)
        return _Snapshot(buckets, daily, self._kept_days(), idle, (self._today, self._left))

    def _write(self, snap: _Snapshot) -> None:
        with self._db_lock:
            conn = self._conn
            with transaction(conn):
                conn.executemany(
                    "INSERT INTO buckets (credential_id, scope, level, at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (credential_id, scope) DO UPDATE SET "
                    "level = excluded.level, at = excluded.at",
                    snap.buckets,
                )
                conn.executemany(
                    "INSERT INTO daily (credential_id, scope, day, used) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (credential_id, scope, day) DO UPDATE SET used = excluded.used",
                    snap.daily,
                )
                if snap.kept_days:
                    days = sorted(snap.kept_days)
                    marks = ", ".join("?" * len(days))
                    conn.execute(f"DELETE FROM daily WHERE day NOT IN ({marks})", days)
                if snap.idle_before is not None:
                    conn.execute("DELETE FROM buckets WHERE at < ?", (snap.idle_before,))
                if snap.days is not None:
                    conn.execute(
                        "INSERT INTO clock (one, today, left_day) VALUES (1, ?, ?) "
                        "ON CONFLICT (one) DO UPDATE SET "
                        "today = excluded.today, left_day = excluded.left_day",
                        snap.days,
                    )
            self.flushes += 1

    def _requeue(self, snap: _Snapshot) -> None:
        self._dirty_buckets.update((c, s) for c, s, _, _ in snap.buckets)
        self._dirty_daily.update((c, s, d) for c, s, d, _ in snap.daily)
        if snap.days is not None:
            self._days_dirty = True

    def flush(self) -> None:
        """Write changed counts now, on this thread (close() and tests use it).

        Raises:
            sqlite3.Error: the write failed; the counts stay marked for the next flush.
        """
        snap = self._snapshot()
        try:
            self._write(snap)
        except BaseException:
            self._requeue(snap)
            raise

    async def flush_periodically(
        self,
        interval: float = FLUSH_INTERVAL_SECONDS,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run forever in the daemon's nursery: flush every `interval` seconds in a thread.

        A failed write is logged (error) and retried next time; counting goes on in memory,
        so a full disk never stops requests here (the audit log is what fails closed).
        """
        task_status.started()
        while True:
            await trio.sleep(interval)
            due = self._days_dirty
            snap = self._snapshot()
            if not snap.buckets and not snap.daily and not due:
                continue
            try:
                # Shielded: a half-abandoned write would leave the lock held by a thread.
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._write, snap)
            except sqlite3.Error as exc:
                self._requeue(snap)
                log_event(_log, "ratelimit.flush_failed", level=logging.ERROR,
                          error=type(exc).__name__, detail=str(exc))

    def close(self) -> None:
        """Flush and close (daemon shutdown; after the last request)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._conn.close()


def _longer(
    worst: tuple[float, str, Rule] | None, wait: float, scope: str, rule: Rule
) -> tuple[float, str, Rule]:
    # The request frees up only when every exhausted limit has, so name the slowest one.
    if worst is None or wait > worst[0]:
        return (wait, scope, rule)
    return worst
