"""An image converted by ``coldstart convert`` runs under plain containerd (overlayfs), and its
unpacked rootfs is file-by-file identical to the unconverted image's.

The test image is built here: busybox as /bin/sh, files of every kind (setuid, owners, xattrs,
hardlinks, absolute/relative/dangling symlinks, a FIFO, long and non-ASCII names, a chunked big
file, a sparse-ish zero file) and a second layer with a whiteout and an opaque directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart.oci.manifest import ImageConfig
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from tests.fixtures.containerd import Containerd, start_containerd
from tests.fixtures.registry import Registry
from tests.integration.oci.oci_testimages import (
    base_layer,
    build_image,
    have_busybox,
    push_image,
    upper_layer,
)

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

# eStargz keeps its TOC and landmark as ordinary tar entries (that is how the format stays a
# valid gzip tar), so a plain unpack leaves these files at the root; nothing else may differ.
ESTARGZ_EXTRA = {"/stargz.index.json", "/.no.prefetch.landmark", "/.prefetch.landmark"}


@pytest.fixture(scope="module")
def ctrd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    """containerd with only its built-in snapshotters (overlayfs), in a temp dir."""
    with start_containerd(tmp_path_factory.mktemp("cvt")) as c:
        yield c


def _tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything an unpacked rootfs means: type, mode, owner, content, link, xattrs, links."""
    out: dict[str, tuple[object, ...]] = {}
    inodes: dict[tuple[int, int], list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            rel = "/" + str(p.relative_to(root))
            st = p.lstat()
            kind = stat.S_IFMT(st.st_mode)
            content = ""
            if stat.S_ISREG(kind):
                content = hashlib.sha256(p.read_bytes()).hexdigest()
                inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
            elif stat.S_ISLNK(kind):
                content = os.readlink(p)
            elif stat.S_ISCHR(kind) or stat.S_ISBLK(kind):
                content = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            xattrs = {}
            if not stat.S_ISLNK(kind):
                for key in sorted(os.listxattr(p, follow_symlinks=False)):
                    xattrs[key] = os.getxattr(p, key, follow_symlinks=False)
            size = st.st_size if not stat.S_ISDIR(kind) else 0
            out[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, size, content,
                        tuple(sorted(xattrs.items())), st.st_nlink if stat.S_ISREG(kind) else 0)
    links = {tuple(sorted(paths)) for paths in inodes.values() if len(paths) > 1}
    out["<hardlink groups>"] = tuple(sorted(links))
    return out


def _mounted_tree(ctrd: Containerd, ref: str, target: Path) -> dict[str, tuple[object, ...]]:
    target.mkdir(parents=True, exist_ok=True)
    ctrd.ctr("images", "mount", "--rw=false", ref, str(target))
    try:
        return _tree(target)
    finally:
        ctrd.ctr("images", "unmount", "--rm", str(target), check=False)
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


def _chain_ids(diff_ids: tuple[str, ...]) -> list[str]:
    chain = [diff_ids[0]]
    for d in diff_ids[1:]:
        chain.append("sha256:" + hashlib.sha256(f"{chain[-1]} {d}".encode()).hexdigest())
    return chain


def _layer_trees(ctrd: Containerd, client: RegistryClient, ref: str,
                 key: str) -> list[dict[str, tuple[object, ...]]]:
    """Each layer's own unpacked directory (whiteouts as 0:0 devices, opaque xattrs)."""
    resolved = client.resolve(Reference.parse(ref))
    config = ImageConfig.parse(client.get_blob(resolved.ref, resolved.manifest.config.digest))
    top = _chain_ids(config.diff_ids)[-1]
    # one call: a view without a lease may be garbage-collected right after it is made
    # (the committed layer snapshots it points at are held by the image)
    out = ctrd.ctr("snapshots", "view", "--mounts", key, top).stdout
    try:
        mounts = json.loads(out)
        options = [o for m in mounts for o in (m.get("Options") or m.get("options") or [])]
        lower = [o.removeprefix("lowerdir=") for o in options if o.startswith("lowerdir=")]
        assert len(lower) == 1, out
        dirs = [Path(d) for d in lower[0].split(":")]
        assert len(dirs) == len(config.diff_ids) and all(d.is_dir() for d in dirs), out
        return [_tree(d) for d in dirs]
    finally:
        ctrd.ctr("snapshots", "rm", key, check=False)


def test_converted_images_run_and_match(registry: Registry, ctrd: Containerd,
                                        tmp_path: Path) -> None:
    assert have_busybox(), "busybox-static is not installed (scripts/install.sh installs it)"
    image = build_image([base_layer(), upper_layer()],
                        cmd=("/bin/sh", "-c", "cat /etc/hostname"))
    plain = f"{registry.host}/e2e/convert:plain"
    with RegistryClient() as client:
        push_image(client, Reference.parse(plain), image)

    refs = {"plain": plain}
    for fmt in ("zstd-chunked", "estargz"):
        dst = f"{registry.host}/e2e/convert:{fmt}"
        out = subprocess.run([sys.executable, "-m", "coldstart.cli", "convert", plain, dst,
                              "--format", fmt, "--chunk-size", "64K"],
                             capture_output=True, text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stderr
        refs[fmt] = dst

    trees = {}
    layers: dict[str, list[dict[str, tuple[object, ...]]]] = {}
    for name, ref in refs.items():
        ctrd.ctr("images", "pull", "--plain-http", ref, timeout=300)
        run = ctrd.ctr("run", "--rm", ref, f"cvt-{name}", "/bin/sh", "-c",
                       "cat /etc/hostname; ls /keep; echo --; ls /keep/old; "
                       "sha256sum /data/big.bin /data/big-link.bin | cut -c1-16; "
                       "stat -c '%a %u:%g %n' /data/setuid /private/secret",
                       timeout=120)
        big = hashlib.sha256(_big()).hexdigest()[:16]
        assert run.stdout.split() == [
            "converted",                 # changed in layer 2
            "old", "--", "c",            # the whiteout and the opaque directory applied
            big, big,
            "4755", "0:0", "/data/setuid", "600", "1000:1000", "/private/secret",
        ], run.stdout
        trees[name] = _mounted_tree(ctrd, ref, tmp_path / f"mnt-{name}")
        with RegistryClient() as client:
            layers[name] = _layer_trees(ctrd, client, ref, f"layers-{name}")

    base = trees["plain"]
    assert "/bin/busybox" in base and "/keep/gone.txt" not in base
    assert ("/data/big-link.bin", "/data/big.bin") in base["<hardlink groups>"]
    assert base["/data/xattr"][6] == (("user.coldstart", b"yes"),)
    assert trees["zstd-chunked"] == base
    estargz = trees["estargz"]
    assert set(estargz) - set(base) <= ESTARGZ_EXTRA
    assert {k: v for k, v in estargz.items() if k not in ESTARGZ_EXTRA} == base

    # layer by layer too: the whiteout is a 0:0 character device, the opaque directory
    # carries trusted.overlay.opaque, exactly as containerd unpacks the unconverted layer
    upper, lower = layers["plain"]
    assert "/bin/busybox" in lower and "/keep/gone.txt" in lower
    assert upper["/keep/gone.txt"][0] == stat.S_IFCHR and upper["/keep/gone.txt"][5] == "0:0"
    opaque = upper["/keep/old"][6]
    assert isinstance(opaque, tuple) and ("trusted.overlay.opaque", b"y") in opaque
    assert layers["zstd-chunked"] == layers["plain"]
    for got, want in zip(layers["estargz"], layers["plain"], strict=True):
        assert set(got) - set(want) <= ESTARGZ_EXTRA
        assert {k: v for k, v in got.items() if k not in ESTARGZ_EXTRA} == want


def _big() -> bytes:
    return hashlib.shake_256(b"coldstart").digest(300_000)
