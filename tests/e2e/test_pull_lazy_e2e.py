"""Issue 3 end to end: ``coldstart pull`` + ``ctr run --snapshotter coldstart``.

One image (busybox + a tree that exercises modes, owners, links, xattrs, whiteouts and an opaque
dir) is pushed as plain gzip, then converted by ``coldstart convert`` (zstd:chunked, eStargz) and
by ``ctr-remote image convert`` (eStargz, zstd:chunked). Each converted image is pulled lazily
and run; the registry's access log shows the layer blobs were not downloaded: per layer, the bytes
served stay within footer + TOC (read by the reader's fixed tail probe) + each chunk of the files
the workload opens, once (+ the small tar-header gaps between such chunks that the fetcher takes
along in one request). The gzip image runs through the fallback (download + unpack). Finally each
image's root file system, seen through the coldstart snapshotter's mounts, is compared file by
file with what containerd's own overlayfs unpack of the unconverted image holds.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from coldstart.containerd import Containerd
from coldstart.containerd.pull import chain_ids
from coldstart.format import BytesReadAt, open_layer
from coldstart.format.layer import TAIL_READ
from coldstart.lazyfs.coalesce import MAX_GAP
from coldstart.oci.manifest import Descriptor
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from tests.fixtures.registry import Registry
from tests.integration.pull.pull_env import (
    UNREAD,
    WORKLOAD,
    AccessLog,
    Entry,
    LazyStack,
    PushedImage,
    assert_same_tree,
    coldstart_cli,
    lazy_stack,
    mounted_view,
    push_image,
    rich_layers,
    walk_tree,
    workload_expected,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

VARIANTS = ("coldstart-zstd", "coldstart-estargz", "ctr-remote-estargz", "ctr-remote-zstd")


@dataclass(frozen=True)
class Converted:
    ref: str
    layers: tuple[Descriptor, ...]
    bound: dict[str, int]            # layer digest -> most bytes a lazy run may fetch


@pytest.fixture(scope="module")
def stack(registry: Registry) -> Iterator[LazyStack]:
    with lazy_stack() as st:
        yield st


@pytest.fixture(scope="module")
def base(registry: Registry) -> PushedImage:
    with RegistryClient() as reg:
        return push_image(reg, f"{registry.host}/e2e-pull/app:gzip", rich_layers())


def _ctr_remote(stack: LazyStack, *args: str) -> None:
    proc = subprocess.run(["ctr-remote", "--address", stack.ctd.address, "--namespace",
                           "ctr-remote-convert", *args], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, f"ctr-remote {' '.join(args)}: {proc.stdout}\n{proc.stderr}"


def _fetch_bound(reg: RegistryClient, ref: str, layer: Descriptor) -> int:
    """Bytes of ``layer`` a lazy run may fetch: footer + TOC (read with one fixed-size tail
    probe, plus the rest of a TOC bigger than that probe) + each chunk of every regular file
    the workload may open, once, + the tar-header bytes between two such chunks that the fetcher
    takes along in one request (gaps up to ``MAX_GAP``)."""
    blob = reg.get_blob(Reference.parse(ref), layer.digest, max_size=64 << 20)
    opened = open_layer(BytesReadAt(blob), annotations=layer.annotations)
    tail = min(TAIL_READ, len(blob))
    bound = tail + max(0, len(blob) - opened.toc_offset - tail)
    ranges = sorted((c.offset, c.end_offset) for e in opened.toc.entries.values()
                    if e.type == "reg" and e.name not in UNREAD for c in e.chunks if not c.zeros)
    end = None
    for lo, hi in ranges:
        bound += hi - lo
        if end is not None and 0 < lo - end <= MAX_GAP:
            bound += lo - end
        end = hi if end is None else max(end, hi)
    return bound


@pytest.fixture(scope="module")
def converted(registry: Registry, stack: LazyStack, base: PushedImage) -> dict[str, Converted]:
    refs = {v: f"{registry.host}/e2e-pull/app:{v}" for v in VARIANTS}
    for fmt in ("zstd", "estargz"):
        proc = coldstart_cli("convert", base.ref, refs[f"coldstart-{fmt}"], "--format",
                             {"zstd": "zstd-chunked", "estargz": "estargz"}[fmt])
        assert proc.returncode == 0, proc.stderr
    _ctr_remote(stack, "image", "pull", "--plain-http", base.ref)
    for fmt, flag in (("estargz", "--estargz"), ("zstd", "--zstdchunked")):
        dst = refs[f"ctr-remote-{fmt}"]
        _ctr_remote(stack, "image", "convert", "--oci", flag, base.ref, dst)
        _ctr_remote(stack, "image", "push", "--plain-http", dst)
    out: dict[str, Converted] = {}
    with RegistryClient() as reg:
        for variant, ref in refs.items():
            manifest = reg.resolve(Reference.parse(ref)).manifest
            bound = {la.digest: _fetch_bound(reg, ref, la) for la in manifest.layers}
            out[variant] = Converted(ref=ref, layers=manifest.layers, bound=bound)
    return out


def _pull(stack: LazyStack, ref: str, namespace: str) -> subprocess.CompletedProcess[str]:
    proc = coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", namespace, ref)
    assert proc.returncode == 0, f"{proc.stderr}\n--- snapshotter log:\n" \
        f"{stack.snapshotter.log.read_text()[-3000:]}"
    return proc


def _run(stack: LazyStack, ref: str, namespace: str, name: str) -> str:
    run = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", ref, name, "/bin/sh", "-c",
                        WORKLOAD, namespace=namespace)
    return run.stdout


@pytest.mark.parametrize("variant", VARIANTS)
def test_lazy_pull_runs_without_downloading_the_layers(
        variant: str, stack: LazyStack, registry: Registry,
        converted: dict[str, Converted]) -> None:
    image = converted[variant]
    log = AccessLog(registry.access_log)
    proc = _pull(stack, image.ref, variant)
    assert "3 layers: 3 lazy, 0 downloaded" in proc.stderr, proc.stderr
    # a synchronous GC first: the labels the pull wrote must keep the remote snapshots alive
    stack.ctd.ctr("leases", "create", "--id", "gc", namespace=variant)
    stack.ctd.ctr("leases", "delete", "--sync", "gc", namespace=variant)
    assert _run(stack, image.ref, variant, f"run-{variant}") == workload_expected(rich_layers())
    for layer in image.layers:
        served = log.blob_bytes(layer.digest)
        assert served <= image.bound[layer.digest], (layer.digest, served, image.bound)
    # the top layer holds a 3 MiB file nobody reads: most of that blob stayed in the registry
    top = image.layers[-1]
    assert log.blob_bytes(top.digest) < top.size - (2 << 20)


def test_gzip_image_runs_through_the_fallback(stack: LazyStack, registry: Registry) -> None:
    # layers of their own (a marker file in each), so that no lazily mounted snapshot
    # with the same chain ID (a conversion may keep a layer's diff ID) can stand in for them
    layers = [[*layer, Entry(f"etc/fallback-{i}", data=b"fallback\n")]
              for i, layer in enumerate(rich_layers())]
    with RegistryClient() as reg:
        image = push_image(reg, f"{registry.host}/e2e-pull/fallback:gzip", layers)
    log = AccessLog(registry.access_log)
    proc = _pull(stack, image.ref, "gzip")
    assert "3 layers: 0 lazy, 3 downloaded" in proc.stderr, proc.stderr
    assert _run(stack, image.ref, "gzip", "run-gzip") == workload_expected(layers)
    for digest, size in zip(image.layer_digests, image.layer_sizes, strict=True):
        assert log.blob_bytes(digest) == size


@pytest.fixture(scope="module")
def reference_tree(stack: LazyStack, base: PushedImage) -> dict[str, object]:
    """The unconverted image as containerd itself unpacks it (ctr image pull, overlayfs)."""
    stack.ctd.ctr("images", "pull", "--plain-http", base.ref, namespace="reference",
                  timeout=180)
    with Containerd(stack.ctd.address, "reference") as client, \
            mounted_view(client, "overlayfs", chain_ids(base.diff_ids)[-1]) as root:
        tree: dict[str, object] = dict(walk_tree(root))
    assert "data/link-to-b" in tree and "etc/gone.txt" not in tree
    return tree


@pytest.mark.parametrize("variant", (*VARIANTS, "gzip"))
def test_rootfs_is_what_containerd_unpacks(
        variant: str, stack: LazyStack, base: PushedImage, converted: dict[str, Converted],
        reference_tree: dict[str, object]) -> None:
    ref = base.ref if variant == "gzip" else converted[variant].ref
    namespace = f"tree-{variant}"
    proc = _pull(stack, ref, namespace)
    with Containerd(stack.ctd.address, namespace) as client:
        image = client.get_image(ref)
        config_digest = client.content_info(image.target.digest).labels[
            "containerd.io/gc.ref.content.config"]
        top = client.content_info(config_digest).labels["containerd.io/gc.ref.snapshot.coldstart"]
        with mounted_view(client, "coldstart", top) as root:
            tree = dict(walk_tree(root))
    if variant != "gzip":
        assert "3 lazy" in proc.stderr
    assert_same_tree(tree, reference_tree)
