"""Helpers for the lazy data plane tests: build layers, push them, run the FUSE server."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from coldstart.format.writer import LayerResult, convert_layer
from coldstart.lazyfs.client import FuseServerClient
from coldstart.lazyfs.mountsys import lazy_unmount, mounted_paths
from coldstart.lazyfs.spec import LayerSpec
from coldstart.oci.manifest import OCI_CONFIG, Descriptor, build_manifest
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from tests.fixtures.procs import daemon, unix_open

REPO_ROOT = Path(__file__).resolve().parents[3]
MTIME = 1_700_000_000


def realistic_bytes(n: int, seed: int) -> bytes:
    """Compressible but not trivial: random bytes mixed with text."""
    rng = random.Random(seed)
    words = [b"torch", b"cuda", b"import", b"def ", b"return", b"self", b"\n", b"    ",
             b"tensor", b"0x7f", b"lib", b".so", b"python3"]
    out = bytearray()
    while len(out) < n:
        if rng.random() < 0.3:
            out += rng.randbytes(rng.randint(16, 256))
        else:
            out += b" ".join(rng.choice(words) for _ in range(rng.randint(4, 40)))
    return bytes(out[:n])


def _info(name: str, type_: bytes, mode: int, *, uid: int = 0, gid: int = 0,
          size: int = 0, linkname: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = type_
    ti.mode = mode
    ti.uid, ti.gid = uid, gid
    ti.uname, ti.gname = ("user" if uid else "root"), ("group" if gid else "root")
    ti.mtime = MTIME
    ti.size = size
    ti.linkname = linkname
    return ti


@dataclass
class SourceTree:
    tar: bytes
    files: dict[str, bytes]      # regular files' content by path


def metadata_tar(big_size: int = 5 << 20, seed: int = 0) -> SourceTree:
    """A layer with every entry type, odd modes and owners, xattrs, whiteouts, a big file.

    Different ``seed``s share no chunk (the cache dedups identical chunks across layers)."""
    files: dict[str, bytes] = {}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        def add(ti: tarfile.TarInfo, data: bytes | None = None,
                xattrs: dict[str, str] | None = None) -> None:
            if xattrs:
                ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
            if data is not None:
                ti.size = len(data)
                files[ti.name] = data
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
        add(_info("etc", tarfile.DIRTYPE, 0o755))
        add(_info("etc/os-release", tarfile.REGTYPE, 0o644), b"NAME=coldstart %d\n" % seed)
        add(_info("etc/shadow", tarfile.REGTYPE, 0o640, gid=42), b"root:*:%d:0:::::\n" % seed)
        add(_info("usr", tarfile.DIRTYPE, 0o755))
        add(_info("usr/bin", tarfile.DIRTYPE, 0o755))
        add(_info("usr/bin/sudo", tarfile.REGTYPE, 0o4755),
            realistic_bytes(70_000, 1 + 1000 * seed))
        add(_info("usr/bin/tool", tarfile.REGTYPE, 0o755, uid=1000, gid=1001),
            realistic_bytes(3000, 2 + 1000 * seed), xattrs={"user.origin": "test",
                                              "security.capability": "caps"})
        add(_info("usr/bin/tool-link", tarfile.LNKTYPE, 0o755, uid=1000, gid=1001,
                  linkname="usr/bin/tool"))
        add(_info("usr/bin/python", tarfile.SYMTYPE, 0o777, linkname="python3.11"))
        add(_info("usr/lib", tarfile.DIRTYPE, 0o755))
        add(_info("usr/lib/big.so", tarfile.REGTYPE, 0o644),
            realistic_bytes(big_size, 3 + 1000 * seed))
        add(_info("usr/lib/empty", tarfile.REGTYPE, 0o644), b"")
        add(_info("usr/lib/zeros", tarfile.REGTYPE, 0o644), bytes(300_000))
        add(_info("dev", tarfile.DIRTYPE, 0o755))
        ti = _info("dev/null", tarfile.CHRTYPE, 0o666)
        ti.devmajor, ti.devminor = 1, 3
        add(ti)
        ti = _info("dev/sda", tarfile.BLKTYPE, 0o660, gid=6)
        ti.devmajor, ti.devminor = 8, 0
        add(ti)
        add(_info("dev/pipe", tarfile.FIFOTYPE, 0o600))
        add(_info("tmp", tarfile.DIRTYPE, 0o1777))
        add(_info("var", tarfile.DIRTYPE, 0o755))
        add(_info("var/cache", tarfile.DIRTYPE, 0o755))
        add(_info("var/cache/.wh..wh..opq", tarfile.REGTYPE, 0o644), b"")
        add(_info("var/cache/fresh", tarfile.REGTYPE, 0o644), b"fresh %d\n" % seed)
        add(_info("var/.wh.old", tarfile.REGTYPE, 0o644), b"")
        for i in range(30):
            add(_info(f"usr/share/doc/f{i:03d}.txt", tarfile.REGTYPE, 0o644),
                realistic_bytes(100 + 997 * i, 100 + i + 1000 * seed))
    files.pop("var/cache/.wh..wh..opq")
    files.pop("var/.wh.old")
    return SourceTree(buf.getvalue(), files)


def convert(tar: bytes, fmt: str, chunk_size: int = 64 << 10,
            prefetch: list[str] | None = None) -> tuple[bytes, LayerResult]:
    out = io.BytesIO()
    result = convert_layer(io.BytesIO(tar), out, format=fmt, chunk_size=chunk_size,
                           prefetch=prefetch)
    return out.getvalue(), result


def push_layer(host: str, repo: str, blob: bytes, result: LayerResult, *,
               with_annotations: bool = True, pull_host: str | None = None) -> LayerSpec:
    """Push ``blob`` and a manifest naming it; a spec (annotations optional: the server then
    finds them in the manifest)."""
    ref = Reference.parse(f"{host}/{repo}:v1")
    with RegistryClient(insecure_hosts=[host]) as client:
        client.push_blob(ref, blob, result.digest)
        config = json.dumps({"architecture": "amd64", "os": "linux",
                             "rootfs": {"type": "layers", "diff_ids": [result.diff_id]}}).encode()
        cdigest = client.push_blob(ref, config)
        manifest = build_manifest(
            Descriptor(media_type=OCI_CONFIG, digest=cdigest, size=len(config)),
            [Descriptor(media_type=result.media_type, digest=result.digest, size=result.size,
                        annotations=dict(result.annotations))])
        mdigest = client.push_manifest(ref, manifest.to_bytes(), manifest.media_type)
    return LayerSpec(reference=f"{pull_host or host}/{repo}:v1", digest=result.digest,
                     size=result.size, media_type=result.media_type, manifest_digest=mdigest,
                     annotations=dict(result.annotations) if with_annotations else {})


def write_config(path: Path, root: Path, *, registry_host: str, read_deadline: float = 10.0,
                 request_timeout: float = 5.0, cache_max: int = 1 << 30,
                 max_coalesce: int = 16 << 20) -> Path:
    path.write_text(
        f'root = "{root}"\n'
        "[registry]\n"
        f'insecure_hosts = ["{registry_host}"]\n'
        f'hosts_dir = "{root}/certs.d"\n'
        f'docker_config = "{root}/docker-config.json"\n'
        "timeout = 5.0\nretries = 0\n"
        "[fetch]\n"
        f"read_deadline = {read_deadline}\nrequest_timeout = {request_timeout}\n"
        f"max_coalesce_bytes = {max_coalesce}\nconcurrency = 4\n"
        "[cache]\n"
        f"max_bytes = {cache_max}\n"
        "[fuse]\n"
        f'socket = "{root}/fuse.sock"\n'
    )
    return path


@contextlib.contextmanager
def fuse_server(tmp: Path, *, registry_host: str, log_name: str = "fuse-server.log",
                extra_args: tuple[str, ...] = (), **config: float | int
                ) -> Iterator[tuple[subprocess.Popen[bytes], FuseServerClient, Path]]:
    """Start ``coldstart fuse-server`` for a test; stop it and unmount everything after."""
    root = tmp / "root"
    root.mkdir(exist_ok=True)
    cfg = write_config(tmp / "config.toml", root, registry_host=registry_host,
                       **config)  # type: ignore[arg-type]
    sock = root / "fuse.sock"
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    try:
        with daemon([sys.executable, "-m", "coldstart.cli", "fuse-server", "--config", str(cfg),
                     *extra_args],
                    log=tmp / log_name, ready=unix_open(sock), what="fuse-server",
                    env=env, cwd=REPO_ROOT) as proc:
            yield proc, FuseServerClient(str(sock), timeout=30.0), root
    finally:
        unmount_under(tmp)


def unmount_under(path: Path) -> None:
    """Lazily unmount every mount at or below ``path`` (deepest first)."""
    prefix = os.path.realpath(path)
    mps = [p for p, _ in mounted_paths() if p == prefix or p.startswith(prefix + "/")]
    for mp in sorted(mps, key=len, reverse=True):
        with contextlib.suppress(Exception):
            lazy_unmount(mp)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
