"""Shared fixtures. Daemon fixtures live in tests/fixtures/*, one module per daemon."""

pytest_plugins = [
    "tests.fixtures.registry",
    "tests.fixtures.containerd",
    "tests.fixtures.redis",
    "tests.fixtures.s3",
]
