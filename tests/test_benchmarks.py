"""Every benchmark still runs on the current code, and prints the figures it promises.

Nothing else runs benchmarks/, so a changed API used to break them silently (audit.py's
imports, ledger.py's `Replay`, read.py's `publish` did). Each row of `BENCHMARKS` runs one
script as `make bench` would (`sys.executable benchmarks/X.py`, from the repository) with
the smallest settings that still take it through its whole path — token, daemon, relay
and same-run baseline included — and asserts it exits 0 and its output holds the lines
it promises: the baseline and the ratio to it, or the figure it is for. No figure's value
is asserted: how fast is the benchmarks' question, never a test's.

Benchmarks that make their own SoftHSM2 token (softhsm/make-token) need SoftHSM2, as the
rest of the suite does. http_transport.py's baseline is a commit `git archive`d from this
repository's history: in a clone without it the row is skipped, saying so.

Left out (commented rows in the table, each with its reason):
- bunker.py: it npm-installs NDK from the registry at every run (network, node and npm).
- read_disk.py: its "before" is a pinned commit built into its own venv by pip on first
  use (network; a minute or more), and its smallest run still starts two daemons.
- null_relay.py: a server, not a benchmark; load.py, startup.py and fleet.py start it.
fleet.py runs without its pinned baseline (the same pip build as read_disk.py) and
without the search: its own run, on the null relay, is what is checked here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: Each run is bounded by its settings to seconds; this only stops a hang.
RUN_TIMEOUT_SECONDS = 300
#: benchmarks/http_transport.py's BASELINE_REF.
HTTP_BASELINE = "fadae9c"


@dataclass(frozen=True)
class Bench:
    script: str
    #: "{tmp}" becomes the test's temporary directory.
    args: tuple[str, ...]
    #: Regular expressions (multiline) that must each match its standard output.
    promises: tuple[str, ...]
    #: A commit the run needs in this repository's history (a same-run baseline).
    needs_commit: str | None = None


BENCHMARKS = [
    Bench("audit.py", ("--seconds", "0.1", "--dir", "{tmp}"),
          (r"no-op rec/s .* added latency µs .* amortized µs$",
           r"^ +64 +[\d,]+ ",
           r"^rate limiter take\(\): [\d,]+ calls/s")),
    Bench("authenticate.py", ("--seconds", "0.05", "--credentials", "50"),
          (r"authenticate \(baseline\) .* ratio 1\.000$",
           r"\+ durable last-use write .* ratio \d",
           r"^ +flush_last_use of 50 credentials:")),
    Bench("contract.py", ("--seconds", "0.02"),
          (r"^message\.reply .* json\.loads .* ratio \d",
           r"^channel\.read .* json\.loads .* ratio \d")),
    Bench("custody.py", ("--seconds", "0.05"),
          (r"^baseline coincurve sign_schnorr",
           r"^facade sign_events, 100 per hop .*x baseline\)$",
           r"^custodian sign_events, 100 per hop .*x baseline\)$",
           r"^CPU of one 100-event sign, in this process: facade .* x facade\)$",
           r"^the daemon's read over a custodian \(tended\) .*x in process\)$")),
    Bench("e2e.py", ("--levels", "1", "--duration", "0.5"),
          (r'"run": "daemon c=1"', r'"run": "nostr-sdk c=1"',
           r"^c= +1: daemon .* \| nostr-sdk .* \| ratio daemon/sdk: throughput \d")),
    Bench("fleet.py", ("--no-baseline", "--no-search", "--relay", "null", "--procs", "1",
                       "--agents", "2", "--channels", "1", "--duration", "1", "--warmup", "0.5"),
          (r'"run": "this checkout".*"polls_per_s_achieved"',
           r"^ +this checkout: 2 agents x 1 channels .* polls/s achieved .*"
           r"achieved/scheduled [\d.]+, achieved/nominal [\d.]+\)",
           r"^ +sequential, fleet stopped: unchanged-window poll .* validation refusal")),
    Bench("http_transport.py", ("--connections", "2", "--rate", "50", "--duration", "0.3",
                                "--warmup", "0.1", "--rounds", "1"),
          (r'"median_of": "checkout"', rf'"median_of": "baseline {HTTP_BASELINE}"',
           rf'"ratio_to_baseline": "baseline {HTTP_BASELINE}", "thread_cpu_ms_per_request"'),
          needs_commit=HTTP_BASELINE),
    Bench("ledger.py", ("--requests", "20", "--concurrency", "1", "16", "--dir", "{tmp}"),
          (r"first-time/s +dict/s +ratio +commits/req \| +replays/s +dict/s +ratio$",
           r"^ +16 \| .*x .* \| .*x$")),
    Bench("load.py", ("--agents", "2", "--concurrency", "2", "--requests", "40", "--duration", "5",
                      "--floor-seconds", "0.05", "--mix", "post=4,replay=1,read=1,storage=1"),
          (r'^\{"custody_floor": \{"sign_event_per_s"',
           r'"run": "load#1".*"errors": \{\}',
           r"^ +ratio posts/s to custody floor: sign_event \d",
           # the reads' same-run baseline: the same runs with read windows off
           r'"run": "windows-off#1".*"errors": \{\}',
           r"^ +ratio reads/s windows on / off \(same run\): \d")),
    # The same load with custody in process and through the custodian, alternating.
    Bench("load.py", ("--agents", "2", "--concurrency", "2", "--requests", "40", "--duration", "3",
                      "--no-floor", "--custodian"),
          (r'"run": "in-process#1".*"errors": \{\}', r'"run": "custodian#1".*"errors": \{\}',
           r"^ +ratio posts/s custodian / in process \(same run, medians of 1\): \d")),
    # The same load under the default allocator and the units' (through the custodian).
    Bench("load.py", ("--agents", "2", "--concurrency", "2", "--requests", "40", "--duration", "3",
                      "--no-floor", "--allocator", "--custodian"),
          (r'"run": "default#1".*"errors": \{\}', r'"run": "units#1".*"errors": \{\}',
           r"^ +ratio units / default \(same run, median of 1 rounds' ratios\): posts/s \d")),
    # --requests 200: CPU time moves in 10 ms ticks, and a cached poll costs ~0.5 ms.
    Bench("poll.py", ("--events", "20", "--requests", "200"),
          (r"^ +cached poll +[\d.]+ ms daemon CPU per request$",
           r"^ +refused +[\d.]+ ms daemon CPU per request$",
           r"^cached poll / refused at validation: [\d.]+ .*cold read / cached poll: [\d.]+")),
    # Over a crowded second (150 events in one) and more than one page, as its default does.
    Bench("read.py", ("--events", "250", "--crowd", "150", "--rounds", "1"),
          (r"^operation: .* pages/s", r"^raw query: .* pages/s",
           r"^ratio operation/raw time per page: \d",
           r"^of which id\+signature checks \(custody\.verify_event\)")),
    Bench("relay_connections.py", ("--agents", "2", "--events", "2"),
          (r'"bench": "raw_event_ok"', r'"bench": "publish_cold_vs_warm".*"warm_vs_raw"',
           r'"bench": "per_agent_connections".*"p50_vs_raw"',
           r'"bench": "cold_burst".*"wall_p50_vs_cold_publish"',
           r'"bench": "gate_open_passage"', r'"bench": "two_auths_on_one_connection"',
           r'"bench": "query_one_event".*"quickack": false',
           r'"bench": "query_one_event".*"quickack": true')),
    Bench("seals.py", ("--seconds", "0.05"),
          (r"^gcm seal .*x baseline\)$", r"^etm unseal .*x baseline\)$",
           r"cache on .*x as fast as cache off")),
    Bench("startup.py", ("--sizes", "10,50", "--repeat", "1"),
          (r'^\{"agents": 10, ', r'^\{"agents": 50, ',
           r"^50 agents: READY=1 median .* \(x[\d.]+ of 10 agents\), RSS .* \(x[\d.]+\)$")),
    # seals.py inside tests/tokens/with-token: the wrapper is what this one adds.
    Bench("tokens.py", ("--kinds", "softhsm", "--seconds", "0.05"),
          (r"^== softhsm token$", r"^etm seal .*x baseline\)$",
           r"cache on .*x as fast as cache off")),
    # Bench("bunker.py", ...): npm-installs NDK from the registry at every run.
    # Bench("read_disk.py", ...): pip-builds a pinned commit into a venv on first use.
    # Bench("null_relay.py", ...): a server; load.py, startup.py and fleet.py start it.
]


def test_a_pinned_build_runs_without_the_callers_import_path(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """fleet.py's and read_disk.py's baseline: with PYTHONPATH naming this checkout (as a
    shell or a test runner may set it), a pinned build's daemon imported the checkout's
    `daemon`, and its "ratio to baseline" was the code against itself."""
    from benchmarks import _harness as H
    from benchmarks import fleet

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("PYTHONHOME", str(tmp_path))
    monkeypatch.setenv("PYTHONUSERBASE", str(tmp_path))
    monkeypatch.setenv("SOFTHSM2_CONF", str(tmp_path / "softhsm2.conf"))
    env = H.pinned_environ()
    assert not set(H.IMPORT_REDIRECTS) & set(env), env.keys()
    assert env["PYTHONNOUSERSITE"] == "1"
    assert env["SOFTHSM2_CONF"] == str(tmp_path / "softhsm2.conf")  # the token stays
    # fleet.py's baseline build (its pip build replaced by a directory: no network here)
    # gives its setup and its daemon that environment; this checkout keeps the caller's.
    monkeypatch.setattr(H, "pinned_build", lambda commit: (tmp_path, "0" * 40))
    baseline = fleet.baseline_build("HEAD")
    assert baseline.environ() == env
    assert fleet.this_build().environ() is None


def test_a_pinned_build_that_imports_the_checkouts_daemon_is_refused(tmp_path: Path) -> None:
    """The check fleet.py and read_disk.py run before measuring a pinned build."""
    from benchmarks import _harness as H

    home = tmp_path / "home"
    (home / "lib" / "daemon").mkdir(parents=True)
    (home / "lib" / "daemon" / "__init__.py").write_text("")
    # This venv's python finds the checkout's daemon: not the tree at `home`.
    with pytest.raises(SystemExit, match="not its own tree"):
        H.check_pinned_imports(sys.executable, home, {**H.pinned_environ(),
                                                      "PYTHONPATH": str(REPO)})
    # A daemon that lies under `home` passes (PYTHONPATH here only stands in for a venv).
    found = H.check_pinned_imports(sys.executable, home, {**H.pinned_environ(),
                                                          "PYTHONPATH": str(home / "lib")})
    assert found == (home / "lib" / "daemon" / "__init__.py").resolve()


def _in_history(commit: str) -> bool:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                           f"{commit}^{{commit}}"], capture_output=True).returncode == 0


def _environment() -> dict[str, str]:
    """This process's environment without the test session's token or daemon: each
    benchmark makes its own, as it does when run from a shell. The repository is on
    PYTHONPATH, as a clone's runs put it: a script must still import the `custody`
    package, not benchmarks/custody.py beside it (authenticate.py once did not)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SOFTHSM2_CONF", "BUZZ_BROKER_CONFIG", "NOTIFY_SOCKET")
           and not k.startswith("BUZZ_TEST_TOKEN_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env


def test_every_benchmark_has_a_row_or_a_reason() -> None:
    rows = {b.script for b in BENCHMARKS}
    text = Path(__file__).read_text(encoding="utf-8")
    left_out = set(re.findall(r'^ +# Bench\("([a-z_]+\.py)"', text, flags=re.MULTILINE))
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts == rows | left_out, sorted(scripts ^ (rows | left_out))


@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda b: b.script)
def test_the_benchmark_runs_and_prints_its_figures(bench: Bench, tmp_path: Path) -> None:
    if bench.needs_commit is not None and not _in_history(bench.needs_commit):
        pytest.skip(f"its baseline, commit {bench.needs_commit}, is not in this clone's history")
    args = [a.replace("{tmp}", str(tmp_path)) for a in bench.args]
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / bench.script), *args],
                          cwd=REPO, env=_environment(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    shown = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, shown
    missing = [p for p in bench.promises if not re.search(p, done.stdout, flags=re.MULTILINE)]
    assert not missing, f"not printed: {missing}\n{shown}"
