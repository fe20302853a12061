"""Shared fixtures. Daemon fixtures live in tests/fixtures/*, one module per daemon."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import pytest
from hypothesis import settings

pytest_plugins = [
    "tests.fixtures.registry",
    "tests.fixtures.containerd",
    "tests.fixtures.redis",
    "tests.fixtures.s3",
]

# pass/fail tests assert behaviour, never elapsed time: Hypothesis's default 200 ms deadline
# per example is a stopwatch that a machine with every core busy trips (the fuzzers and the
# property tests that set their own settings keep them; this is the default for the rest)
settings.register_profile("coldstart", deadline=None)
settings.load_profile("coldstart")


@pytest.fixture(autouse=True)
def _keep_the_test_threads_priority() -> Iterator[None]:
    """The fill's threads nice themselves (Linux: per thread); a test that runs the fill in
    its own thread would leave pytest at niceness 19 for every later test and the
    processes they start, which a machine with every core busy then starves."""
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    yield
    if os.getpriority(os.PRIO_PROCESS, tid) != before:
        with contextlib.suppress(OSError):     # raising it back needs root
            os.setpriority(os.PRIO_PROCESS, tid, before)
