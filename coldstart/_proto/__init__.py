"""Generated protobuf / gRPC modules (containerd's APIs), compiled from ``protos/``.

The modules are generated, not committed: ``pip install`` compiles them (``setup.py``), and so
does ``python -m coldstart._proto.build``. In a source checkout where they are missing, importing
this package compiles them on the fly when ``grpc_tools`` is importable, so a fresh clone works.

Example::

    from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2
"""

from __future__ import annotations


def _ensure_built() -> None:
    # loaded by path under a private name, so ``python -m coldstart._proto.build`` does not find
    # its own module already imported
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_coldstart_proto_build", Path(__file__).with_name("build.py"))
    if spec is None or spec.loader is None:  # pragma: no cover
        return
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    if not build.PROTO_ROOT.is_dir():  # installed package: built at install time
        return
    outputs = build.expected_outputs()
    if outputs and all(p.exists() for p in outputs):
        return
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        return
    build.build()


_ensure_built()
