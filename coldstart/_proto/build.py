"""Compile every ``protos/**/*.proto`` into Python modules under ``coldstart/_proto/``.

Run after ``pip install -e .`` or in a fresh clone::

    python -m coldstart._proto.build

``protoc`` writes absolute imports named after the proto packages (``from containerd.types import
mount_pb2``); they are rewritten to ``coldstart._proto.containerd.types`` so nothing outside our
package is put on ``sys.path``. Generated directories stay namespace packages (no
``__init__.py``), so another engineer's protos under a new directory need no extra file. Each
file is written to a temporary name and renamed into place, so concurrent builds (several test
processes) never see half a module. This module imports only the standard library and, when it
runs, ``grpc_tools``; ``setup.py`` loads it by path.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

__all__ = ["PROTO_ROOT", "build", "expected_outputs", "main"]

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "protos"
PREFIX = "coldstart._proto"


def _protos(proto_root: Path) -> list[Path]:
    return sorted(p for p in proto_root.rglob("*.proto") if p.is_file())


def expected_outputs(proto_root: Path = PROTO_ROOT, out_dir: Path = HERE) -> list[Path]:
    """The ``*_pb2.py`` / ``*_pb2_grpc.py`` files a build writes (the latter for services only)."""
    outs = []
    for proto in _protos(proto_root):
        rel = proto.relative_to(proto_root).with_suffix("")
        outs.append(out_dir / rel.parent / f"{rel.name}_pb2.py")
        if re.search(r"^\s*service\s", proto.read_text(), re.M):
            outs.append(out_dir / rel.parent / f"{rel.name}_pb2_grpc.py")
    return outs


def _rewrite(text: str, packages: set[str]) -> str:
    names = "|".join(re.escape(p) for p in sorted(packages))
    text = re.sub(rf"^(\s*)from ({names})([. ])", rf"\1from {PREFIX}.\2\3", text, flags=re.M)
    return re.sub(rf"^(\s*)import ({names})\.", rf"\1import {PREFIX}.\2.", text, flags=re.M)


def build(proto_root: Path = PROTO_ROOT, out_dir: Path = HERE) -> list[Path]:
    """Compile all protos under ``proto_root`` into ``out_dir``; return the files written."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("grpcio-tools is needed to compile protos (pip install "
                           "grpcio-tools)") from exc
    protos = _protos(proto_root)
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}")
    bundled = Path(grpc_tools.__file__).resolve().parent / "_proto"
    top = {p.relative_to(proto_root).parts[0] for p in protos if len(p.relative_to(proto_root)
                                                                    .parts) > 1}
    written: list[Path] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".protoc-", dir=out_dir) as tmp:
        args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{bundled}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *[str(p) for p in protos]]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit status {rc}: {' '.join(args[1:])}")
        for src in sorted(Path(tmp).rglob("*")):
            if not src.is_file():
                continue
            dst = out_dir / src.relative_to(tmp)
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.write_text(_rewrite(src.read_text(), top))
            os.replace(src, dst)
            written.append(dst)
    return written


def main() -> int:
    for path in build():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
