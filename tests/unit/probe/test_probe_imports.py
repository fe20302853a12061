"""coldstart.probe imports only what CONVENTIONS §2 allows, and the app side stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import coldstart.probe

ALLOWED_THIRD_PARTY = {"redis", "httpx", "grpc"}
ALLOWED_COLDSTART = {"coldstart.errors", "coldstart.config", "coldstart.probe"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_probe_depends_only_on_errors_config_stdlib_and_its_clients() -> None:
    package = Path(coldstart.probe.__file__).parent
    stdlib = set(sys.stdlib_module_names)
    wrong = []
    for path in sorted(package.rglob("*.py")):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top == "coldstart":
                if not any(name == a or name.startswith(a + ".") for a in ALLOWED_COLDSTART):
                    wrong.append(f"{path.name}: {name}")
            elif top not in stdlib and top not in ALLOWED_THIRD_PARTY and top != "__future__":
                wrong.append(f"{path.name}: {name}")
    assert not wrong, wrong


def test_the_notify_helper_does_not_import_clients() -> None:
    code = ("import sys; from coldstart.probe import notify; "
            "print(sorted(m for m in ('redis', 'httpx', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
