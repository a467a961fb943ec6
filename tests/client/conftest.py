"""Client tests run on both event loops the client supports: asyncio and trio.

The suite runs in pytest-trio's trio mode, which claims every coroutine test. A test module
marked `any_loop` opts out of it: its coroutine tests are parametrized over `loop_backend`
("asyncio", "trio") and run here under `anyio.run` on that backend. A `ScriptedHost`
argument is served on the same loop for the length of the test (its socket in a fresh
directory); an argument named `task_group` receives the test's own anyio task group.
Fixtures stay synchronous, so pytest-trio never sees them.
"""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from tests.client.scripted_host import ScriptedHost, socket_dir

BACKENDS = ("asyncio", "trio")


class _TaskGroupSlot:
    """Stands for the test's task group until the test runs (see the module docstring)."""


@pytest.fixture
def host() -> Iterator[ScriptedHost]:
    directory = socket_dir()
    yield ScriptedHost(path=f"{directory}/broker.sock")
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def task_group() -> _TaskGroupSlot:
    return _TaskGroupSlot()


def _any_loop(item: pytest.Item) -> bool:
    return isinstance(item, pytest.Function) and item.get_closest_marker("any_loop") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # After pytest-trio's automark: take its marker off the tests this file runs itself.
    for item in items:
        if _any_loop(item):
            item.own_markers[:] = [m for m in item.own_markers if m.name != "trio"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("any_loop") and inspect.iscoroutinefunction(
        metafunc.function
    ):
        metafunc.fixturenames.append("loop_backend")
        metafunc.parametrize("loop_backend", BACKENDS)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not _any_loop(pyfuncitem) or not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs: dict[str, Any] = {name: pyfuncitem.funcargs[name] for name in names}
    backend = pyfuncitem.callspec.params["loop_backend"]

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for name, value in kwargs.items():
                if isinstance(value, ScriptedHost):
                    await tg.start(value.serve)
                elif isinstance(value, _TaskGroupSlot):
                    kwargs[name] = tg
            await pyfuncitem.obj(**kwargs)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main, backend=backend)
    except BaseExceptionGroup as group:
        # The task group wraps the test's own failure: report that failure, not the wrapper.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return True
