"""The built-in demo: build a small image, serve it from a local registry, convert it to a
seekable format, and show what a lazy start-up fetches compared with a full pull.

Everything runs on this machine in a temporary directory (the daemons are
:mod:`coldstart.stack`'s): Debian's ``docker-registry`` on 127.0.0.1, the image built from
Python-written tar layers (``/bin/busybox`` from Debian's ``busybox-static`` plus a synthetic
application: a large shared library, weights and a few thousand small modules), converted with
:func:`coldstart.oci.convert.convert_image`. The "start-up" reads what a Python server typically
touches: the shell, its start script, a tenth of the modules and the first MiB of the big
library.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import random
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coldstart.errors import FailedPrecondition, Unavailable
from coldstart.format.layer import open_layer
from coldstart.format.readat import CountingReadAt
from coldstart.oci.convert import convert_image
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, build_manifest
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack.registry import push_layout, start_registry

if TYPE_CHECKING:
    from coldstart.stack.snapshotter import LocalStack

Echo = Callable[[str], None]
MiB = 1 << 20
BUSYBOX = Path("/bin/busybox")


@dataclass(frozen=True)
class DemoFile:
    name: str
    data: bytes
    mode: int = 0o644


def _semi_random(rng: random.Random, size: int) -> bytes:
    """Bytes that compress about 2:1, like machine code and weights in real images."""
    out = bytearray()
    while len(out) < size:
        out += rng.randbytes(4096)
        out += bytes(4096)
    return bytes(out[:size])


def demo_files(scale: float = 1.0) -> tuple[list[DemoFile], list[DemoFile]]:
    """(base layer, application layer) files of the demo image."""
    rng = random.Random(20261130)
    if not BUSYBOX.exists():
        raise FailedPrecondition(f"{BUSYBOX} is missing (apt-get install busybox-static)")
    base = [DemoFile("bin/busybox", BUSYBOX.read_bytes(), 0o755),
            DemoFile("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"),
            DemoFile("etc/group", b"root:x:0:\n")]
    app = [DemoFile("app/lib/libbig.so", _semi_random(rng, int(48 * MiB * scale)), 0o755),
           DemoFile("app/model/weights.bin", rng.randbytes(int(24 * MiB * scale)))]
    for i in range(int(2000 * scale)):
        body = (f"# module {i}\n" + f"def f(x):\n    return x * {i}\n" * 20).encode()
        app.append(DemoFile(f"app/site-packages/pkg{i // 100}/mod_{i}.py", body))
    # the start script reads what startup_reads() lists, like an interpreter importing modules
    modules = [f"/{f.name}" for f in app if f.name.endswith(".py")][::10]
    script = ("#!/bin/sh\ncat " + " ".join(modules) + " > /dev/null\n"
              "dd if=/app/lib/libbig.so of=/dev/null bs=1M count=1 2>/dev/null\n"
              "echo ready\n")
    app.insert(0, DemoFile("app/start.sh", script.encode(), 0o755))
    return base, app


def startup_reads(app: list[DemoFile]) -> list[tuple[str, int, int]]:
    """What the demo 'start-up' reads: (file, offset, length or -1 for all of it)."""
    reads = [("bin/busybox", 0, -1), ("app/start.sh", 0, -1), ("app/lib/libbig.so", 0, MiB)]
    modules = [f.name for f in app if f.name.endswith(".py")]
    reads += [(m, 0, -1) for m in modules[::10]]
    return reads


def _tar_gz(files: list[DemoFile]) -> tuple[bytes, str]:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for f in files:
            parts = f.name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
                    tar.addfile(info)
            info = tarfile.TarInfo(f.name)
            info.size, info.mode, info.mtime = len(f.data), f.mode, 1_700_000_000
            tar.addfile(info, io.BytesIO(f.data))
        if any(f.name == "bin/busybox" for f in files):
            for tool in ("sh", "cat", "ls", "echo"):
                info = tarfile.TarInfo(f"bin/{tool}")
                info.type, info.linkname, info.mtime = tarfile.SYMTYPE, "busybox", 1_700_000_000
                tar.addfile(info)
    tar_bytes = raw.getvalue()
    diff_id = "sha256:" + hashlib.sha256(tar_bytes).hexdigest()
    return gzip.compress(tar_bytes, compresslevel=6, mtime=0), diff_id


def build_image(layout_dir: Path, layers: list[list[DemoFile]]) -> OciLayout:
    """Write the demo image as an OCI layout (gzip layers, like any ordinary build)."""
    layout = OciLayout.create(layout_dir)
    descs, diff_ids = [], []
    for files in layers:
        blob, diff_id = _tar_gz(files)
        descs.append(layout.put_blob(blob, OCI_LAYER_GZIP))
        diff_ids.append(diff_id)
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Cmd": ["/app/start.sh"], "Env": ["PATH=/bin"]},
              "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    cdesc = layout.put_blob(json.dumps(config).encode(), OCI_CONFIG)
    manifest = build_manifest(cdesc, descs, media_type=OCI_MANIFEST)
    mdesc = layout.put_blob(manifest.to_bytes(), OCI_MANIFEST)
    layout.add_manifest(mdesc, "latest")
    return layout


def _mb(n: int) -> str:
    return f"{n / 1e6:8.1f} MB"


def run_demo(echo: Echo, *, workdir: Path | None = None, scale: float = 1.0) -> dict[str, object]:
    """Run the demo, narrating with ``echo``; returns the figures it printed."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            tmp = tempfile.TemporaryDirectory(prefix="coldstart-demo-")
            workdir = Path(stack.enter_context(tmp))
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        base, app = demo_files(scale)
        layout_dir = workdir / "image"
        build_image(layout_dir, [base, app])
        raw_size = sum(len(f.data) for f in base + app)
        echo(f"1. built a {raw_size / 1e6:.0f} MB image (2 gzip layers, {len(base + app)} files) "
             f"in {time.monotonic() - t0:.1f} s: {layout_dir}")
        # the registry: quiet (no access log), its data under workdir/registry
        host = stack.enter_context(start_registry(workdir / "registry", log_level="error",
                                                  access_log=False)).host
        echo(f"2. started a local registry at {host}")
        client = stack.enter_context(RegistryClient(insecure_hosts=[host]))
        src = f"{host}/demo/app:gzip"
        push_layout(layout_dir, "latest", src, client)
        echo(f"3. pushed it as {src}")
        results: dict[str, object] = {"uncompressed_bytes": raw_size}
        reads = startup_reads(app)
        for step, fmt in ((4, "zstd:chunked"), (6, "estargz")):
            dst = f"{host}/demo/app:{fmt.replace(':', '-')}"
            t1 = time.monotonic()
            summary = convert_image(src, dst, format=fmt, client=client)
            secs = time.monotonic() - t1
            echo(f"{step}. converted to {fmt} in {secs:.1f} s "
                 f"({raw_size / 1e6 / max(secs, 1e-9):.0f} MB/s): {dst}")
            image = summary.images[0]
            fetched = 0
            for layer in image.layers:
                echo(f"     layer {layer.source.digest[:19]}  gzip {_mb(layer.size_before)}"
                     f"  -> {fmt} {_mb(layer.size_after)}")
                fetched += _lazy_startup_bytes(client, Reference.parse(dst), layer.output, reads)
            full = image.size_after
            echo(f"{step + 1}. a lazy start-up that reads {len(reads)} files fetches "
                 f"{_mb(fetched).strip()}"
                 f" of {_mb(full).strip()} ({100 * fetched / full:.1f}% of the image; a full pull"
                 f" downloads and unpacks all of it)")
            results[fmt] = {"convert_seconds": secs, "size_before": image.size_before,
                            "size_after": full, "startup_fetched_bytes": fetched}
        results["containerd"] = _containerd_step(echo, workdir, client, src,
                                                 f"{host}/demo/app:zstd-chunked")
        echo(f"done in {time.monotonic() - t0:.1f} s")
        return results


def _containerd_step(echo: Echo, workdir: Path, client: RegistryClient, gzip_ref: str,
                     lazy_ref: str) -> dict[str, object] | None:
    """Step 8: run the image in a private containerd, pulled lazily, and pulled in full."""
    from coldstart.stack.snapshotter import local_stack, missing_tools

    missing = missing_tools()
    if missing:
        echo(f"8. (skipped the containerd step: missing {', '.join(missing)})")
        return None
    from coldstart.containerd import Containerd, pull_image
    from coldstart.lazyfs.client import FuseServerClient

    with local_stack(workdir / "stack") as st:
        echo("8. started a private containerd with the coldstart snapshotter")
        t1 = time.monotonic()
        result = pull_image(Containerd(st.address, "default"), client, lazy_ref)
        lazy_pull = time.monotonic() - t1
        lazy_run = _timed_run(st, "coldstart", lazy_ref, "demo-lazy", "lazily pulled")
        fetched = sum(int(m.get("fetched_bytes", 0))
                      for m in FuseServerClient(st.fuse_socket).status())
        echo(f"   coldstart pull + run: {lazy_pull:.2f} s + {lazy_run:.2f} s "
             f"({result.lazy_layers} of {len(result.layers)} layers lazy), "
             f"fetched {_mb(fetched).strip()} of the layers' data")
        t1 = time.monotonic()
        pulled = st.ctr("image", "pull", "--plain-http", gzip_ref)
        full_pull = time.monotonic() - t1
        if pulled.returncode != 0:
            raise Unavailable(f"ctr image pull failed: {pulled.stderr.strip()}")
        full_run = _timed_run(st, "overlayfs", gzip_ref, "demo-full", "fully pulled")
        echo(f"   ctr image pull + run (overlayfs, full pull): {full_pull:.2f} s + "
             f"{full_run:.2f} s")
    return {"lazy_pull_s": lazy_pull, "lazy_run_s": lazy_run, "lazy_fetched_bytes": fetched,
            "full_pull_s": full_pull, "full_run_s": full_run}


def _lazy_startup_bytes(client: RegistryClient, ref: Reference, desc: object,
                        reads: list[tuple[str, int, int]]) -> int:
    """Bytes fetched from the registry to open one layer and read what the start-up reads."""
    from coldstart.oci.manifest import Descriptor
    from coldstart.remote.registry_blob import open_blob

    assert isinstance(desc, Descriptor)
    blob = CountingReadAt(open_blob(client, ref, desc.digest, desc.size))
    layer = open_layer(blob, annotations=desc.annotations)
    for name, offset, length in reads:
        if name in layer.toc.entries:
            layer.read_file(name, offset, None if length < 0 else length)
    return blob.bytes_read


def _timed_run(st: LocalStack, snapshotter: str, ref: str, name: str, what: str) -> float:
    """Seconds ``ctr run`` of the demo image takes until it exits, having printed "ready"."""
    t0 = time.monotonic()
    run = st.ctr("run", "--rm", "--snapshotter", snapshotter, ref, name, "/app/start.sh")
    took = time.monotonic() - t0
    if run.returncode != 0 or "ready" not in run.stdout:
        raise Unavailable(f"the {what} container failed: {run.stderr.strip()}")
    return took
