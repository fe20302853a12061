"""coldstart.format stays pure (CONVENTIONS §1): stdlib, zstandard, coldstart.errors, itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import coldstart.format

ALLOWED = {"zstandard", "coldstart.errors"}


def test_format_imports_only_stdlib_zstandard_and_errors() -> None:
    pkg = Path(coldstart.format.__file__).parent
    bad = []
    for path in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                if (top in sys.stdlib_module_names or name in ALLOWED
                        or name.startswith("coldstart.format")):
                    continue
                bad.append(f"{path.name}: {name}")
    assert not bad, bad
