"""Shared fixtures live in tests/fixtures/, one module per real part they stand up."""

pytest_plugins = [
    "tests.fixtures.token",  # a SoftHSM2 token made by softhsm/ in a temporary directory
    "tests.fixtures.relay",  # nostr-sdk's LocalRelay in a subprocess, and a scripted relay for faults
    "tests.fixtures.broker",  # the whole daemon in-process on a real socket, token and relay
    "tests.fixtures.custodian",  # the custodian as its own process (custodian/)
]
