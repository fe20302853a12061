"""setuptools hook: compile ``protos/**/*.proto`` into ``coldstart/_proto`` when building.

Everything else about the package is in pyproject.toml. Regular builds write the generated modules
into the build directory; editable installs (``pip install -e .``) write them into the source
tree, where ``coldstart/_proto/__init__.py`` also rebuilds them on import if they are missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _proto_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_coldstart_proto_build", HERE / "coldstart" / "_proto" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):  # type: ignore[misc]
    def run(self) -> None:
        super().run()
        proto = _proto_build()
        if getattr(self, "editable_mode", False):
            proto.build(HERE / "protos", HERE / "coldstart" / "_proto")
        else:
            proto.build(HERE / "protos", Path(self.build_lib) / "coldstart" / "_proto")


setup(cmdclass={"build_py": BuildPyWithProtos})
