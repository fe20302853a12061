"""Importing a light part of the package does not drag in heavy clients (behaviour, not AST).

Moved here from tests/unit/weights/test_weights_imports.py and tests/unit/probe/
test_probe_imports.py when the AST rules became one table (test_arch_rules.py); unchanged.
"""

from __future__ import annotations

import subprocess
import sys


def test_importing_weights_does_not_import_torch_eagerly() -> None:
    import subprocess

    code = "import sys, coldstart.weights; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_the_notify_helper_does_not_import_clients() -> None:
    code = ("import sys; from coldstart.probe import notify; "
            "print(sorted(m for m in ('redis', 'httpx', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_weights_does_not_import_network_clients() -> None:
    # local loads must not pay for httpx or boto3; HttpSource/S3Source load them on first use
    code = ("import sys, coldstart.weights; "
            "print(sorted(m for m in ('httpx', 'boto3', 'botocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
