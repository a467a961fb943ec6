"""Shared fixtures live in tests/fixtures/, one module per real part they stand up."""

import pytest

pytest_plugins = [
    "tests.fixtures.token",  # a SoftHSM2 token made by softhsm/ in a temporary directory
    "tests.fixtures.relay",  # nostr-sdk's LocalRelay in a subprocess, and a scripted relay for faults
    "tests.fixtures.broker",  # the whole daemon in-process on a real socket, token and relay
    "tests.fixtures.custodian",  # the custodian as its own process (custody/custodian/)
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `slow` (the nspawn guest) first, the rest in their own order.

    `make test` runs on two xdist workers, a module to a worker (`--dist loadscope
    --no-loadscope-reorder`): the longest module started first overlaps the rest of the
    suite on the other worker instead of running alone at the end.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
