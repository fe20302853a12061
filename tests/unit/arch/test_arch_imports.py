"""Imports point one way (CONVENTIONS §2), and heavy bindings stay in the one place that needs them.

Walks every module's ``import`` statements with ``ast``; no module is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[3] / "coldstart"

# Which coldstart subpackages each subpackage may import (besides itself).
BASE = {"errors", "config"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "format": {"errors"},
    "oci": BASE | {"format", "remote"},
    "remote": BASE | {"format", "oci"},
    "cache": BASE | {"format"},
    "lazyfs": BASE | {"format", "oci", "remote", "cache", "unixsock"},
    "snapshotter": BASE | {"format", "oci", "remote", "cache", "lazyfs", "unixsock", "_proto"},
    "containerd": BASE | {"format", "oci", "remote", "lazyfs", "_proto"},
    "weights": BASE | {"remote", "oci"},
    "probe": BASE,
    "benchmark": BASE | {"format", "oci", "remote", "cache", "lazyfs", "snapshotter", "containerd",
                         "weights", "probe"},
    "unixsock": set(),
    "_proto": set(),
}
# Third-party modules only some places may import.
RESTRICTED = {
    "pyfuse3": {"lazyfs/fusefs.py", "lazyfs/server.py"},
    "torch": {"weights/", "commands/weights.py", "commands/models.py"},
}


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "_proto" not in p.relative_to(PKG).parts)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    rel = path.relative_to(PKG)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = list(("coldstart", *rel.parts[:-1]))[: len(rel.parts) - node.level + 1]
                names.append(".".join([*base, *(node.module or "").split(".")]).rstrip("."))
            elif node.module:
                names.append(node.module)
    return names


def _area(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_one_way(path: Path) -> None:
    rel = path.relative_to(PKG)
    area = _area(rel)
    if area not in ALLOWED:  # cli.py, commands/: the outer edge may import anything
        return
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] != "coldstart" or len(parts) < 2:
            continue
        target = parts[1]
        if target == area or target == "__init__":
            continue
        assert target in ALLOWED[area], f"{rel} imports coldstart.{target}: {area} may not"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_heavy_bindings_stay_in_place(path: Path) -> None:
    rel = str(path.relative_to(PKG))
    for name in _imports(path):
        allowed = RESTRICTED.get(name.split(".")[0])
        if allowed is not None:
            assert any(rel.startswith(a) for a in allowed), f"{rel} imports {name}"


def test_the_walk_sees_the_package() -> None:
    # guards the two tests above against silently walking nothing
    assert len(_modules()) >= 5
    assert "coldstart.errors" in _imports(PKG / "cli.py")
