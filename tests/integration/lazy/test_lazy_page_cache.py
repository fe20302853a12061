"""The prefetch hands its verified chunks to the kernel's page cache (``fuse.page_cache``),
through a real FUSE mount: the start-up's files are resident before anything reads them, and
their reads then never reach the server. Residency is the kernel's own word (``mincore``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coldstart.lazyfs.client import FuseServerClient
from coldstart.lazyfs.spec import LayerSpec
from tests.fixtures.pages import resident_pages
from tests.fixtures.procs import wait_for
from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_helpers import (
    SourceTree,
    convert,
    fuse_server,
    metadata_tar,
    push_layer,
    tar_of,
)

pytestmark = pytest.mark.integration

START_UP = ["usr/lib/big.so", "etc/os-release", "usr/bin/sudo"]
LATER = "usr/share/doc/f007.txt"        # not in the start-up set

def _status(client: FuseServerClient, spec: LayerSpec) -> dict[str, Any]:
    return next(s for s in client.status() if s["digest"] == spec.digest)


def _layer(registry: Registry, repo: str, plain: bool = False) -> tuple[Any, LayerSpec]:
    tree = metadata_tar(big_size=3 << 20, seed=41)
    if plain:       # the same files, without attributes or whiteouts
        files = {n: tree.files[n] for n in (*START_UP, LATER)}
        tree = SourceTree(tar_of(files), files)
    blob, res = convert(tree.tar, "zstd:chunked", prefetch=START_UP)
    return tree, push_layer(registry.host, repo, blob, res)


@pytest.mark.parametrize("plain", [False, True], ids=["xattrs", "plain"])
def test_prefetched_files_are_in_the_page_cache_before_any_read(tmp_path: Path,
                                                               registry: Registry,
                                                               plain: bool) -> None:
    """Either FUSE connection: a layer with no attribute is served on the one that answers
    no getxattr, and its pages must be stored through that one."""
    tree, spec = _layer(registry, f"pagecache/on-{'plain' if plain else 'xattrs'}", plain)
    with fuse_server(tmp_path, registry_host=registry.host) as (_, client, _):
        mp = tmp_path / "mnt"
        mp.mkdir()
        client.mount(str(mp), spec)
        assert _status(client, spec)["plain"] is plain
        want = sum(len(tree.files[n]) for n in START_UP)
        wait_for(lambda: _status(client, spec)["prefetch_done"]
                 and _status(client, spec)["page_cache_bytes"] >= want,
                 timeout=60, what="the prefetch handed to the page cache")
        st = _status(client, spec)
        assert st["page_cache_bytes"] == want       # whole files: the last page ends the file
        assert st["on_demand_bytes"] == 0
        for name in START_UP:
            resident, total = resident_pages(mp / name)
            assert resident == total, f"{name}: {resident} of {total} pages resident"
        # a file outside the start-up set was not pushed
        resident, total = resident_pages(mp / LATER)
        assert resident == 0
        # reading the start-up files sends the server no FUSE read and gives the right bytes
        reads = st["fuse_reads"]
        for name in START_UP:
            assert (mp / name).read_bytes() == tree.files[name]
        st = _status(client, spec)
        assert st["fuse_reads"] == reads and st["on_demand_bytes"] == 0
        assert (mp / LATER).read_bytes() == tree.files[LATER]      # this one does
        st = _status(client, spec)
        assert st["fuse_reads"] > reads and st["errors"] == 0


def test_page_cache_off_leaves_the_files_to_be_read_through_fuse(tmp_path: Path,
                                                                registry: Registry) -> None:
    tree, spec = _layer(registry, "pagecache/off")
    with fuse_server(tmp_path, registry_host=registry.host, page_cache=False) as (_, client, _):
        mp = tmp_path / "mnt"
        mp.mkdir()
        client.mount(str(mp), spec)
        wait_for(lambda: _status(client, spec)["prefetch_done"], timeout=60,
                 what="the prefetch")
        assert _status(client, spec)["page_cache_bytes"] == 0
        resident, _ = resident_pages(mp / "usr/lib/big.so")
        assert resident == 0
        for name in START_UP:
            assert (mp / name).read_bytes() == tree.files[name]
        assert _status(client, spec)["fuse_reads"] > 0
