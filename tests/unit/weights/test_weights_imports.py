"""coldstart.weights stands beside the image stack: it imports only what CONVENTIONS §2 allows."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import coldstart.weights

ALLOWED_COLDSTART = ("coldstart.errors", "coldstart.config", "coldstart.remote", "coldstart.oci",
                     "coldstart.weights")
ALLOWED_THIRD_PARTY = {"torch", "boto3", "botocore", "httpx", "numpy", "yaml"}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_weights_imports_point_one_way() -> None:
    package = Path(coldstart.weights.__file__).parent
    files = sorted(package.glob("*.py"))
    assert len(files) >= 5
    bad: list[str] = []
    for f in files:
        for name in _imports(f):
            top = name.split(".")[0]
            if top == "coldstart":
                if not name.startswith(ALLOWED_COLDSTART):
                    bad.append(f"{f.name}: {name}")
            elif top not in sys.stdlib_module_names and top not in ALLOWED_THIRD_PARTY \
                    and top != "__future__":
                bad.append(f"{f.name}: {name}")
    assert bad == []


def test_importing_weights_does_not_import_torch_eagerly() -> None:
    import subprocess

    code = "import sys, coldstart.weights; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
