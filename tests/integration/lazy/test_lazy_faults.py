"""Lazy reads through a registry that fails in every way a network does (issue 15, item 2).

A real FUSE server whose registry client retries (``registry.retries`` 3, each attempt cut off
after ``registry.timeout`` 1 s) reads through :class:`~tests.integration.lazy.lazy_proxy.Proxy`,
which answers blob range GETs with 5xx, resets the connection, stalls, truncates bodies or
flips a byte, each at its own rate. Under every mix:

- no read returns a wrong byte;
- a read returns the right bytes or fails with EIO, nothing else, and no ``pread`` takes
  longer than the kernel's two tries of a FUSE read (a failed read-ahead is read once more)
  each within the read deadline;
- the faults really were injected (so none of this passes vacuously), retries made nearly
  every read succeed, and the server's log says what it retried;
- every chunk in the node's chunk cache holds its source bytes.

And one fault exactly where it counts, per kind: the read still returns the right bytes, at
the cost of one more request (a stall: cut off at ``registry.timeout``). A flipped byte is
the one fault the registry client cannot see (a good HTTP answer): the fetcher fetches the
chunk once more (``fetcher.REFETCHES``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart.errors import FormatError, IntegrityError
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.lazyfs.spec import LayerSpec
from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_faults import (
    CacheCheck,
    ServerTimes,
    check_cache,
    fault_server,
    fault_tree,
    read_file,
    read_tree,
)
from tests.integration.lazy.lazy_helpers import Server, convert, push_layer, tar_of
from tests.integration.lazy.lazy_proxy import FaultMix, Proxy, proxy_for

pytestmark = pytest.mark.integration

TIMES = ServerTimes(retries=3, registry_timeout=1.0, request_timeout=5.0, read_deadline=6.0)
#: a stalled request is held this long: past the 1 s per attempt, short of the 5 s per request
STALL = 2.5
#: the kernel reads a page once more after a failed read-ahead: two FUSE reads, each bounded
SLOWEST_PREAD = 2 * TIMES.read_deadline + 1.0

MIXES = {
    "5xx": "5xx=0.3",
    "reset": "reset=0.3",
    "stall": "stall=0.1",
    "truncate": "truncate=0.3",
    "corrupt": "corrupt=0.3",
    "all": "all=0.05",
}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory, proxy: Proxy) -> Iterator[Server]:
    """A FUSE server that retries, reading through the module's proxy."""
    tmp = tmp_path_factory.mktemp("faults")
    with fault_server(tmp, registry_host=proxy.host, times=TIMES) as (proc, client, _root):
        yield proc, client, tmp


@pytest.fixture(autouse=True)
def healthy_after(proxy: Proxy) -> Iterator[None]:
    yield
    proxy.heal()


def _mount(server: Server, proxy: Proxy, files: dict[str, bytes], fmt: str,
           name: str) -> tuple[Path, LayerSpec, bytes]:
    """Push ``files`` as a ``fmt`` layer and mount it through the (still healthy) proxy."""
    _, client, tmp = server
    blob, res = convert(tar_of(files), fmt)
    spec = push_layer(proxy.upstream_host, f"faults/{name}", blob, res, pull_host=proxy.host)
    mp = tmp / name
    mp.mkdir()
    client.mount(str(mp), spec)
    return mp, spec, blob


def _settled_cache(cache_dir: Path, blob: bytes, spec: LayerSpec,
                   files: dict[str, bytes]) -> CacheCheck:
    """:func:`check_cache` once every chunk is on disk (or a wrong one is), 30 s at most."""
    give_up = time.monotonic() + 30
    while True:
        got = check_cache(cache_dir, blob, spec.annotations, files)
        if got.cached == got.chunks or got.bad or time.monotonic() > give_up:
            return got
        time.sleep(0.2)


def _status(server: Server, spec: LayerSpec) -> dict[str, object]:
    return next(s for s in server[1].status() if s["digest"] == spec.digest)


@pytest.mark.parametrize(("mix_name", "fmt"), [
    *((m, "zstd:chunked") for m in MIXES),
    ("all", "estargz"),
])
def test_every_read_is_right_or_eio_under_faults(faulty: Server, proxy: Proxy, mix_name: str,
                                                 fmt: str) -> None:
    seed = 10 * list(MIXES).index(mix_name) + (fmt == "estargz")
    files = fault_tree(5000 + seed, small=240)
    mp, spec, blob = _mount(faulty, proxy, files, fmt, f"{mix_name}-{fmt[:4]}")
    mix = FaultMix.parse(MIXES[mix_name], seed=seed, stall_seconds=STALL)
    with proxy.faults(mix):
        report = read_tree(mp, files, seed=seed)
        counts = proxy.fault_counts()
    summary = f"{mix_name} ({fmt}): {counts}, {report}"
    # the faults happened: this test cannot pass without them
    assert counts["requests"] >= 200, summary
    assert all(counts[k] > 0 for k in mix.rates), summary
    # what a reader sees: right bytes or EIO, in bounded time
    assert report.wrong_reads == 0 and report.wrong_bytes == 0, summary
    assert report.other_errors == [], summary
    assert report.ok + report.eio == report.reads == len(files), summary
    assert report.slowest <= SLOWEST_PREAD, summary
    # the retries (and the refetch of a flipped chunk) are what keeps nearly every read right
    assert report.ok >= 0.95 * report.reads, summary
    # the server says what it did about them
    log = (faulty[2] / "fuse-server.log").read_text().splitlines()
    if mix.rates.get("corrupt"):
        refetched = _status(faulty, spec)["refetched_chunks"]
        assert isinstance(refetched, int) and refetched > 0, summary
        assert any("fetching it again" in line and spec.digest in line for line in log)
    if set(mix.rates) - {"corrupt"}:
        repo = f"faults/{mix_name}-{fmt[:4]}"
        assert any("retrying" in line and repo in line for line in log)
    # healthy again: what failed now reads right
    again = read_tree(mp, files, names=report.failed)
    assert again.ok == again.reads == len(report.failed), again
    # every chunk was read, so every chunk reaches the cache (written in the background),
    # and none wrong (read raw from disk, digests not trusted)
    cached = _settled_cache(faulty[2] / "root/cache", blob, spec, files)
    assert cached.cached == cached.chunks and cached.bad == [], cached
    faulty[1].unmount(str(mp))


@pytest.mark.parametrize("kind", ["5xx", "reset", "stall", "truncate", "corrupt"])
def test_one_fault_costs_one_retry_not_the_read(faulty: Server, registry: Registry,
                                                kind: str) -> None:
    """The next range request fails; the read that made it returns the right bytes, at the
    cost of one more request (a stall: cut off after ``registry.timeout``, not the request's
    whole budget nor the proxy's stall, which outlasts every budget).

    Through a proxy of its own: a registry host the server has not met, so the read goes the
    client's fast path (taken once the mount's TOC read went well), which earlier tests' faults
    may have switched off for the module's proxy."""
    files = fault_tree(6000 + ["5xx", "reset", "stall", "truncate", "corrupt"].index(kind),
                       small=4, big=1)
    with proxy_for(registry.url) as own:
        mp, spec, _ = _mount(faulty, own, files, "zstd:chunked", f"one-{kind}")
        name = "usr/lib/big0.so"
        own.stall_seconds = 3 * TIMES.request_timeout      # longer than any budget
        own.inject_next(kind)
        before = len(own.blob_gets())
        outcome, _preads, wrong, _slowest = read_file(mp / name, files[name])
        assert (outcome, wrong) == ("ok", 0)
        assert own.fault_counts()[kind] == 1
        # the failed request and one more: the same range again, or (a flipped byte, which
        # only the chunk's digest sees) the chunk that held it
        asked = own.blob_gets()[before:]
        assert len(asked) == 2, asked
        if kind != "corrupt":
            assert asked[1] == asked[0], asked
        if kind == "stall":
            # cut off at the attempt's limit and retried once: not the request's budget (5 s,
            # which would leave no time for the retry), nor the proxy's 15 s (past every
            # budget: the read would have failed)
            log = (faulty[2] / "fuse-server.log").read_text().splitlines()
            retried = [line for line in log if f"faults/one-{kind}:" in line and "retrying" in line]
            assert len(retried) == 1, retried
            assert retried[0].endswith(f"no answer within {TIMES.registry_timeout:g} s; "
                                       "retrying (attempt 2)"), retried
        st = _status(faulty, spec)
        assert st["last_error"] == "", st          # recovered: no failure to report
        if kind == "corrupt":
            assert st["refetched_chunks"] == 1, st
        faulty[1].unmount(str(mp))


@pytest.mark.parametrize("times", [1, 2])
def test_a_toc_flipped_once_is_read_again_twice_refused(faulty: Server, registry: Registry,
                                                       times: int) -> None:
    """A byte of the TOC flipped in one answer: the mount reads footer and TOC once more and
    serves the layer. In every answer (the registry's own bytes): the mount is refused."""
    files = fault_tree(7000 + times, small=4, big=0)
    _, client, tmp = faulty
    blob, res = convert(tar_of(files), "zstd:chunked")
    toc = open_layer(BytesReadAt(blob), annotations=res.annotations).toc_offset
    with proxy_for(registry.url) as own:
        spec = push_layer(own.upstream_host, f"faults/toc-{times}", blob, res,
                          pull_host=own.host)
        mp = tmp / f"toc-{times}"
        mp.mkdir()
        own.flip, own.flip_times = (toc + 20, toc + 21), (1 if times == 1 else None)
        if times == 1:
            client.mount(str(mp), spec)
            for name, data in files.items():
                assert read_file(mp / name, data)[:3:2] == ("ok", 0), name
            client.unmount(str(mp))
        else:
            with pytest.raises((IntegrityError, FormatError)):
                client.mount(str(mp), spec)
        assert len(own.blob_gets()) >= 2       # the tail read, then once more
    log = (tmp / "fuse-server.log").read_text()
    assert f"layer {spec.digest}: " in log and "reading its footer and TOC once more" in log
