"""Fixtures for the client tests: a scripted host on a fresh Unix socket per test."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator

import pytest
import trio

from tests.client.scripted_host import ScriptedHost, socket_dir


@pytest.fixture
async def host(nursery: trio.Nursery) -> AsyncIterator[ScriptedHost]:
    directory = socket_dir()
    scripted = ScriptedHost(path=f"{directory}/broker.sock")
    await nursery.start(scripted.serve)
    yield scripted
    shutil.rmtree(directory, ignore_errors=True)
