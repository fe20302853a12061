"""The router's Lua library is loaded once per store and never replaced (``FUNCTION LOAD``
without ``REPLACE``), so its version must change whenever its code does."""

from __future__ import annotations

import hashlib
import re

from coldstart.probe.router import LIBRARY, LIBRARY_NAME, function

# the code of each released version; a new version gets a new line, an old one never changes
DIGESTS = {"coldstart_v2": "b8b61a62247d33f1"}


def test_the_library_version_changes_with_its_code() -> None:
    digest = hashlib.sha256(LIBRARY.encode()).hexdigest()[:16]
    assert DIGESTS.get(LIBRARY_NAME) == digest, (
        f"the Lua of coldstart.probe.router changed, but stores that loaded {LIBRARY_NAME} keep "
        f"its old code: give it a new version (LIBRARY_NAME, the function names) and record "
        f"{digest} for it in DIGESTS")


def test_the_names_carry_the_version() -> None:
    assert LIBRARY.startswith(f"#!lua name={LIBRARY_NAME}\n")
    registered = re.findall(r"function_name='(\w+)'|register_function\('(\w+)'", LIBRARY)
    names = {a or b for a, b in registered}
    assert names == {function(n) for n in (
        "update", "heartbeat", "pick", "release", "quarantine", "forget", "list")}
