"""The real daemon, as ``buzz-broker serve`` runs it, that SIGKILLs itself at a named step.

    python -m tests.adversarial.crashing_daemon CONFIG STEP

STEP is one of `daemon.pipeline.publisher.CHECKPOINTS` (``before_pending``, ``after_pending``,
``after_verdict``) or ``none``. The first request to pass STEP kills the process with
SIGKILL - no ``finally``, no flush, no atexit: exactly what a power cut or the OOM killer
does to the daemon. ``none`` runs the daemon unchanged (the restart after a crash).

Why a wrapper and not a flag in the daemon: the kill seam (`daemon.wiring.running(checkpoint=)`)
is a test-only parameter; production's ``serve`` never passes it. This program is
`daemon.cli.serve.run` with that one argument added, so everything else - socket binding,
token login, relay pool, ledger, signals - is the production code path.

Before dying it writes one line ``crashing_daemon.kill step=STEP`` to stderr, so a test
can tell the checkpoint's kill from any other death. Faults at startup are one line on
stderr and exit status 1, as ``buzz-broker serve`` reports them.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from daemon.pipeline.publisher import CHECKPOINTS
from daemon.wiring import StartupError, running
from daemon.cli._common import CliError
from daemon.cli.serve import MemoryLock, ReloadableApplication, run_server
from daemon.config import Config, ConfigError, load_config
from daemon.log import setup_logging
from tests.fixtures.kill import kill_at

__all__ = ["main", "STEPS"]

#: Steps this program accepts: the pipeline's checkpoints, or no kill at all.
STEPS = (*CHECKPOINTS, "none")



def _no_lock() -> MemoryLock:
    # The test host's RLIMIT_MEMLOCK is small; production's lock policy is tested elsewhere.
    return MemoryLock(False, "crash-test wrapper does not lock memory")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[1] not in STEPS:
        print(f"usage: python -m tests.adversarial.crashing_daemon CONFIG {{{'|'.join(STEPS)}}}",
              file=sys.stderr)
        return 2
    config_path, step = args
    try:
        config = load_config(config_path, environ={})
    except ConfigError as exc:
        print(f"crashing_daemon: {exc}", file=sys.stderr)
        return 1
    setup_logging(config.log.level)
    checkpoint = None if step == "none" else kill_at("crashing_daemon", step)

    @asynccontextmanager
    async def factory(cfg: Config) -> AsyncIterator[ReloadableApplication]:
        try:
            async with running(cfg, checkpoint=checkpoint) as app:
                yield app
        except StartupError as exc:
            raise CliError(str(exc)) from None

    try:
        return trio.run(lambda: run_server(config, factory, memory_lock=_no_lock))
    except CliError as exc:
        print(f"crashing_daemon: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        inner: BaseException = group
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        if isinstance(inner, CliError):
            print(f"crashing_daemon: {inner}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
