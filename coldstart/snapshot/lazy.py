"""Lazy restore (``snapshot.pages = "lazy"``): the process runs before its memory is here.

The bundle is mounted through the node's FUSE server like an image layer (the TOC checked
against the artifact's annotation, each chunk fetched on demand, verified and cached); CRIU
restores with ``--lazy-pages`` from its ``criu/`` directory, which registers the private
anonymous memory with userfaultfd instead of copying it; a ``criu lazy-pages`` daemon then
serves each first touch from the mount, and copies the rest in the background. So READY waits
for what the restored process touches, not for all of its memory.

The pager (``python -m coldstart.snapshot.lazy``) outlives the wrapper: it runs the daemon
until every page is in, then unmounts the bundle and removes the work directory. If the daemon
fails (a chunk that fails its digest, the registry gone), the pages it could not serve would
read as zeros once the userfaultfd is gone: the pager kills the restored processes instead, so
a container never computes on memory that is not its own (the container fails, visibly, and
its restart is a normal start or another restore).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["mount_bundle", "start_pager"]


def mount_bundle(fuse_socket: str, ref: str, layer: dict[str, Any], mountpoint: Path) -> Path:
    """Mount the snapshot's bundle (its layer descriptor ``layer``) at ``mountpoint`` through
    the FUSE server at ``fuse_socket``; CRIU's image directory in it."""
    from coldstart.lazyfs.client import FuseServerClient
    from coldstart.lazyfs.spec import LayerSpec

    mountpoint.mkdir(parents=True, exist_ok=True)
    ann = layer.get("annotations")
    spec = LayerSpec(reference=ref, digest=str(layer["digest"]), size=int(layer["size"]),
                     media_type=str(layer.get("mediaType", "")),
                     annotations={str(k): str(v) for k, v in (ann or {}).items()})
    FuseServerClient(fuse_socket, timeout=60).mount(str(mountpoint), spec)
    return mountpoint / "criu"


def unmount_bundle(fuse_socket: str, mountpoint: Path) -> None:
    from coldstart.lazyfs.client import FuseServerClient

    with contextlib.suppress(Exception):
        FuseServerClient(fuse_socket, timeout=30).unmount(str(mountpoint))


def start_pager(criu: str, images: Path, work: Path, *, mountpoint: Path, fuse_socket: str,
                pid_file: str, state_dir: Path, cid: str, cgroup: str,
                log: Path) -> subprocess.Popen[bytes]:
    """Start the pager (detached: it outlives the wrapper) before ``runc restore
    --lazy-pages``; its ``criu lazy-pages`` listens in ``work``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "coldstart.snapshot.lazy", "--criu", criu, "--images",
             str(images), "--work", str(work), "--mountpoint", str(mountpoint),
             "--fuse-socket", fuse_socket, "--pid-file", pid_file, "--state-dir",
             str(state_dir), "--container", cid, "--cgroup", cgroup],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True)


def _kill_tree(pid: int, cgroup: str, cid: str) -> None:
    """SIGKILL ``pid``'s tree, if ``pid`` is still the container's: a cgroup of it ends in
    the container's cgroup name (``cgroupsPath``'s last part, the id, or systemd's
    ``cri-containerd-<id>.scope``). The pid file may name a process that ended, and a pid
    taken since by another."""
    from coldstart.snapshot.procs import kill_tree

    names = {cid, f"cri-containerd-{cid}.scope"}
    if cgroup:
        names.add(cgroup.replace(":", "/").rstrip("/").rsplit("/", 1)[-1])
    names.discard("")
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    if not names or not any(ln.rstrip("/").rsplit("/", 1)[-1] in names for ln in lines):
        return
    kill_tree(pid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    for name in ("--criu", "--images", "--work", "--mountpoint", "--fuse-socket", "--pid-file",
                 "--state-dir", "--container", "--cgroup"):
        ap.add_argument(name, required=True)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    daemon = subprocess.run([a.criu, "lazy-pages", "--images-dir", a.images, "--work-dir",
                             a.work, "--log-file", "lazy-pages.log", "-v4"],
                            stdin=subprocess.DEVNULL, check=False)
    seconds = time.monotonic() - t0
    pid = None
    with contextlib.suppress(OSError, ValueError):
        pid = int(Path(a.pid_file).read_text().strip())
    tail = ""
    if daemon.returncode != 0:
        with contextlib.suppress(OSError):
            lines = (Path(a.work) / "lazy-pages.log").read_text(errors="replace").splitlines()
            tail = " | ".join(ln for ln in lines if "rror" in ln)[-600:]
        if pid:
            _kill_tree(pid, a.cgroup, a.container)   # never run on pages not the snapshot's
    from coldstart.snapshot.state import NodeState

    with contextlib.suppress(Exception):
        NodeState(Path(a.state_dir)).record({
            "outcome": "pages-in" if daemon.returncode == 0 else "pages-failed",
            "kind": "lazy-pages", "container": a.container, "seconds": round(seconds, 3),
            "exit": daemon.returncode, "reason": tail, "killed": daemon.returncode != 0})
    unmount_bundle(a.fuse_socket, Path(a.mountpoint))
    shutil.rmtree(Path(a.work).parent, ignore_errors=True)
    return 0 if daemon.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
