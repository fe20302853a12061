"""Take a snapshot of a ready container that containerd runs, and push it.

:func:`checkpoint` asks containerd (``ctr tasks checkpoint --image-path``: runc, then CRIU,
dump the process tree into a directory, no checkpoint image in the content store), takes the
root file system's changes from the container snapshot's upper directory
(:mod:`coldstart.snapshot.rootdiff`), and computes the key from the container's OCI spec;
:func:`push` packs both (:mod:`coldstart.snapshot.bundle`) and pushes them as an artifact of
the image (:mod:`coldstart.snapshot.artifacts`).

By default the container stops with the checkpoint (``ctr tasks checkpoint --exit``), so its
files cannot change between the dump and the copy of its rootfs changes (CRIU refuses at
restore an open file whose size changed); ``leave_running`` keeps it running.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coldstart.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.snapshot.keys import SnapshotKey, compute_key

__all__ = ["Checkpoint", "Pushed", "checkpoint", "push"]

CTR = shutil.which("ctr") or "/usr/bin/ctr"


@dataclass
class Checkpoint:
    """A checkpoint on disk: CRIU's images, the rootfs changes, the key."""

    dir: Path                        # holds images/ and rootfs.tar
    key: SnapshotKey
    image: str                       # the image reference the container was created from
    rootfs_entries: int
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def images(self) -> Path:
        return self.dir / "images"

    @property
    def rootfs_tar(self) -> Path | None:
        p = self.dir / "rootfs.tar"
        return p if self.rootfs_entries else None

    @property
    def touched(self) -> Path | None:
        p = self.dir / "touched.json"
        return p if p.exists() else None


@dataclass
class Pushed:
    digest: str                     # the artifact's
    key: SnapshotKey
    bytes: int                      # uncompressed: CRIU's files and the rootfs changes
    pages_bytes: int
    rootfs_bytes: int
    blob_bytes: int                 # what the registry stores (compressed)

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "key": self.key.to_json(), "bytes": self.bytes,
                "pages_bytes": self.pages_bytes, "rootfs_bytes": self.rootfs_bytes,
                "blob_bytes": self.blob_bytes}


def _ctr(address: str, namespace: str, *args: str, timeout: float = 600.0) -> str:
    argv = [CTR, "--address", address, "--namespace", namespace, *args]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{' '.join(argv[:6])}…: {exc}") from None
    if out.returncode != 0:
        raise Unavailable(f"ctr {' '.join(args)} exited {out.returncode}: "
                          f"{(out.stderr or out.stdout).strip()[-1500:]}")
    return out.stdout


def _task_pid(address: str, namespace: str, container: str) -> int | None:
    """The pid of ``container``'s task, as ``ctr tasks ls`` says; None when it has none."""
    for line in _ctr(address, namespace, "tasks", "ls", timeout=60).splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == container and parts[1].isdigit():
            return int(parts[1])
    return None


def checkpoint(address: str, namespace: str, container: str, client: RegistryClient, dest: Path,
               *, criu_version: str, leave_running: bool = False,
               image: str | None = None) -> Checkpoint:
    """Checkpoint ``container`` (running on the containerd at ``address``) into ``dest``
    (created, must not exist), with its rootfs changes and its key. ``image``: the reference
    the snapshot is pushed for (default: the container's image as containerd names it)."""
    from coldstart.containerd.client import Containerd
    from coldstart.snapshot.rootdiff import capture, upper_dir

    if dest.exists():
        raise InvalidArgument(f"{dest} exists")
    info = json.loads(_ctr(address, namespace, "containers", "info", container, timeout=60))
    spec = info.get("Spec") or info.get("spec")
    if not isinstance(spec, dict):
        raise FailedPrecondition(f"container {container}: containerd gave no OCI spec")
    ref = image or str(info.get("Image") or "")
    if not ref:
        raise InvalidArgument(f"container {container} has no image; name one (--image)")
    resolved = client.resolve(Reference.parse(ref))
    snapshotter, skey = str(info.get("Snapshotter") or ""), str(info.get("SnapshotKey") or "")
    with Containerd(address, namespace) as ctd:
        mounts = ctd.snapshot_mounts(snapshotter, skey) if snapshotter and skey else []
        # the image the container runs, as containerd has it: a tag that moved since would
        # key the snapshot to another rootfs
        with contextlib.suppress(NotFound):
            target = ctd.get_image(str(info.get("Image") or ref)).target
            if target.digest not in (resolved.digest, resolved.index_digest):
                raise FailedPrecondition(
                    f"{ref} is {resolved.digest} in the registry now, but container "
                    f"{container} runs {target.digest}: name the image by digest (--image "
                    f"REF@{target.digest})")
    key = compute_key(resolved.digest, spec, criu_version)
    upper = upper_dir([(m.type, list(m.options)) for m in mounts])
    dest.mkdir(parents=True, mode=0o700)
    seconds: dict[str, float] = {}
    t = time.monotonic()
    # what the processes read of their mapped files, for a restore to read ahead (a hint:
    # a snapshot is taken without it when /proc says nothing)
    try:
        pid = _task_pid(address, namespace, container)
    except Unavailable:
        pid = None
    if pid:
        from coldstart.snapshot.procs import descendants
        from coldstart.snapshot.touched import record

        with contextlib.suppress(OSError):
            (dest / "touched.json").write_bytes(record(descendants(pid)))
    seconds["touched"] = time.monotonic() - t
    t = time.monotonic()
    work = dest / "criu-work"
    args = ["tasks", "checkpoint", "--image-path", str(dest / "images"), "--work-path", str(work)]
    if not leave_running:
        args.append("--exit")
    try:
        _ctr(address, namespace, *args, container)
    except Unavailable as exc:
        log = work / "dump.log"
        tail = ""
        if log.exists():
            lines = log.read_text(errors="replace").splitlines()
            tail = " | ".join(ln for ln in lines if "rror" in ln)[-800:] or " | ".join(lines[-3:])
        raise FailedPrecondition(f"checkpoint of {container} failed: {exc}"
                                 + (f"; CRIU: {tail}" if tail else "")) from None
    seconds["dump"] = time.monotonic() - t
    t = time.monotonic()
    entries = 0
    if upper is not None:
        with open(dest / "rootfs.tar", "wb") as f:
            entries = capture(upper, f)
    seconds["rootfs"] = time.monotonic() - t
    return Checkpoint(dest, key, ref, entries, seconds)


def push(client: RegistryClient, ckpt: Checkpoint, *, image: str | None = None) -> Pushed:
    """Pack ``ckpt`` and push it as a snapshot of ``image`` (default: the container's)."""
    from coldstart.snapshot import artifacts
    from coldstart.snapshot.bundle import pack

    ref = Reference.parse(image or ckpt.image)
    path = ckpt.dir / "bundle.zst"
    try:
        with open(path, "wb") as blob:
            packed = pack(ckpt.images, blob, rootfs_tar=ckpt.rootfs_tar, touched=ckpt.touched)
        digest = artifacts.push(client, ref, ckpt.key, packed, path)
    finally:
        path.unlink(missing_ok=True)
    return Pushed(digest, ckpt.key, packed.bytes, packed.pages_bytes, packed.rootfs_bytes,
                  packed.layer.size)
