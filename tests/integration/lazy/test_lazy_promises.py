"""Promises of the lazy data path, kept through the real FUSE server (``coldstart fuse-server``),
a real registry and a loopback proxy that counts, orders and holds range requests:

- a full disk (ENOSPC) under the chunk cache: reads are still served (from the registry),
  nothing partial or corrupt is left in the cache, the failures are logged and counted;
- the cache's size limit (``cache.max_bytes``) holds while a container reads more than it;
- the background fetch (``fetch.background_rate``) makes a whole layer local (it reads with the
  registry gone) and yields to on-demand reads;
- a cached chunk that rots on disk is not served after a restart (``cache.verify`` default).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import itertools
import os
import re
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from coldstart.cache.chunks import CORRUPT, WRITE_ERROR
from coldstart.format.layer import SeekableLayer, open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.format.toc import Chunk
from coldstart.lazyfs.client import FuseServerClient
from coldstart.lazyfs.fill import BACKGROUND_REQUEST
from coldstart.lazyfs.metrics import CACHE_HITS, ERRORS
from coldstart.lazyfs.spec import LayerSpec
from tests.fixtures.procs import free_port, wait_for
from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_helpers import (
    SourceTree,
    convert,
    fuse_server,
    metadata_tar,
    push_layer,
)

pytestmark = pytest.mark.integration

_RANGE = re.compile(r"bytes=(\d+)-(\d+)")
#: a pack record's header (coldstart/cache/packfile.py): magic, raw sha256, u32 length
_PACK_HDR = struct.Struct("<4s32sI")


# -- a proxy that logs and holds range requests ------------------------------------------------

@dataclass
class Held:
    start: int
    end: int
    go: threading.Event = field(default_factory=threading.Event)


class GateProxy:
    """A real HTTP proxy on loopback in front of the registry. Every blob range request is
    logged in arrival order (``("arrive"|"done"|"release", seq, start, end)``); one that a rule
    in ``hold_rules`` matches waits, before it is forwarded, until :meth:`release`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream                    # host:port of the registry
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.hold_rules: list[Callable[[int, int], bool]] = []
        self.held: list[Held] = []
        self.log: list[tuple[str, int, int, int]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                m = _RANGE.match(self.headers.get("Range", ""))
                blob = "/blobs/" in self.path and self.command == "GET" and m is not None
                start, end = (int(m.group(1)), int(m.group(2)) + 1) if m else (0, 0)
                if blob:
                    gate._note("arrive", start, end)
                    held = None
                    with gate._lock:
                        if any(rule(start, end) for rule in gate.hold_rules):
                            held = Held(start, end)
                            gate.held.append(held)
                    if held is not None:
                        while not held.go.wait(0.05):
                            if gate._stopping.is_set():
                                self.close_connection = True
                                return
                conn = http.client.HTTPConnection(gate.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() in ("content-length", "connection", "transfer-encoding"):
                        continue
                    if k.lower() == "location":
                        v = v.replace(gate.upstream, gate.host)
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                    self.wfile.flush()
                if blob:
                    gate._note("done", start, end)

            do_GET = do_HEAD = _forward

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass    # a FUSE server that gave up on a held request hangs up

        self.server = Server(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def _note(self, what: str, start: int, end: int) -> None:
        with self._lock:
            self.log.append((what, next(self._seq), start, end))

    def events(self, what: str) -> list[tuple[int, int, int]]:
        with self._lock:
            return [(seq, s, e) for w, seq, s, e in self.log if w == what]

    def waiting(self) -> list[Held]:
        with self._lock:
            return [h for h in self.held if not h.go.is_set()]

    def release(self, pred: Callable[[Held], bool] = lambda h: True) -> None:
        with self._lock:
            for h in self.held:
                if not h.go.is_set() and pred(h):
                    self.log.append(("release", next(self._seq), h.start, h.end))
                    h.go.set()

    def open(self) -> None:
        """Hold nothing any more: drop the rules, release what waits."""
        with self._lock:
            self.hold_rules.clear()
        self.release()

    def stop(self) -> None:
        """Stop answering: later requests get "connection refused" (a dead registry)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@contextlib.contextmanager
def gate_for(registry: Registry) -> Iterator[GateProxy]:
    g = GateProxy(registry.host)
    try:
        yield g
    finally:
        g.stop()


# -- helpers -----------------------------------------------------------------------------------

def _metric(port: int, name: str, labels: str = "") -> float:
    """A sample of the FUSE server's metrics (0 when the labelled series does not exist)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def _errors(port: int, kind: str) -> float:
    return _metric(port, ERRORS + "_total", f'kind="{kind}"')


def _status(client: FuseServerClient, spec: LayerSpec) -> dict[str, Any]:
    return next(s for s in client.status() if s["digest"] == spec.digest)


def _mount(client: FuseServerClient, mp: Path, spec: LayerSpec) -> Path:
    mp.mkdir(exist_ok=True)
    client.mount(str(mp), spec)
    return mp


def _read_all(mp: Path, tree: SourceTree) -> None:
    for name, data in tree.files.items():
        assert (mp / name).read_bytes() == data, name


def _pread(path: Path, offset: int, length: int) -> bytes:
    """One read through FUSE without kernel read-ahead (only the chunk holding it is needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _cache_files(cache_dir: Path) -> list[Path]:
    return [p for sub in ("sha256", "packs", "wip") if (cache_dir / sub).exists()
            for p in (cache_dir / sub).rglob("*") if p.is_file()]


def _cache_bytes(cache_dir: Path) -> int:
    total = 0
    for p in _cache_files(cache_dir):
        with contextlib.suppress(FileNotFoundError):    # evicted while we walk
            total += p.stat().st_size
    return total


def _check_cache_on_disk(cache_dir: Path, *, crashed: bool = False) -> set[str]:
    """Independently of the cache's code: every chunk file hashes to its name, every pack is
    whole records whose data hash to their digest (nothing partial at the end), no temp file
    is left. Returns the digests found.

    ``crashed``: the cache's writer was killed: a temp file in ``wip/`` and a record cut short
    at a pack's end are allowed (neither is an entry: the index never takes them)."""
    found: set[str] = set()
    if not crashed:
        assert [p.name for p in (cache_dir / "wip").iterdir()] == []
    for p in (cache_dir / "sha256").rglob("*"):
        if p.is_file():
            assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name, p
            found.add("sha256:" + p.name)
    for p in (cache_dir / "packs").iterdir():
        data = p.read_bytes()
        assert data or crashed, f"{p}: an empty pack left behind"
        off = 0
        while off < len(data):
            if crashed and off + _PACK_HDR.size > len(data):
                break                                   # the header being written
            assert off + _PACK_HDR.size <= len(data), f"{p}: partial header at {off}"
            magic, raw, n = _PACK_HDR.unpack_from(data, off)
            body = data[off + _PACK_HDR.size: off + _PACK_HDR.size + n]
            if crashed and len(body) < n:
                break                                   # the record being written: cut short
            assert magic == b"CSK1", f"{p}: no record at {off}"
            assert len(body) == n, f"{p}: partial record at {off}"
            assert hashlib.sha256(body).digest() == raw, f"{p}: corrupt record at {off}"
            found.add("sha256:" + raw.hex())
            off += _PACK_HDR.size + n
    return found


def _layer(blob: bytes, spec: LayerSpec) -> SeekableLayer:
    return open_layer(BytesReadAt(blob), annotations=spec.annotations)


def _data_chunks(layer: SeekableLayer) -> list[Chunk]:
    return sorted((c for e in layer.toc.entries.values() if e.type == "reg"
                   for c in e.chunks if not c.zeros), key=lambda c: c.offset)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                    str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# -- a full disk under the cache ---------------------------------------------------------------

def test_full_disk_under_the_cache_serves_reads_caches_nothing_partial_and_counts(
        tmp_path: Path, registry: Registry) -> None:
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root")
    # 512 KiB chunks: big.so's are loose files, the small files' go to packs; 1 MiB of disk
    # holds a few of them, then every write fails with ENOSPC (some halfway through)
    tree = metadata_tar(big_size=3 << 20, seed=171)
    blob, res = convert(tree.tar, "zstd:chunked", chunk_size=512 << 10)
    spec = push_layer(registry.host, "promises/enospc", blob, res)
    srv = tmp_path / "srv"
    srv.mkdir()
    port = free_port()
    with _tmpfs(tmp_path / "disk", "1m") as disk:
        cache_dir = disk / "cache"
        with fuse_server(srv, registry_host=registry.host, cache_dir=cache_dir,
                         extra_args=("--metrics-address", f"127.0.0.1:{port}")
                         ) as (_, client, _root):
            mp = _mount(client, srv / "mnt", spec)
            _read_all(mp, tree)
            wait_for(lambda: _errors(port, WRITE_ERROR) > 0, timeout=60,
                     what="a failed cache write counted")
            assert _status(client, spec)["errors"] == 0       # no read failed
            # a second container reads everything again (new mount: nothing in page cache)
            client.unmount(str(mp))
            _read_all(_mount(client, srv / "mnt2", spec), tree)
        log = (srv / "fuse-server.log").read_text()
        assert "No space left on device" in log and "not cached" in log
        # the server stopped (its writer flushed): what is on the disk is whole and valid
        cached = _check_cache_on_disk(cache_dir)
        layer = _layer(blob, spec)
        chunks = {c.digest for c in _data_chunks(layer)}
        assert cached and cached <= chunks
        assert len(cached) < len(chunks)                      # the disk really was full
        # a restarted server serves what is cached (verified on first read) and fetches the rest
        port2 = free_port()
        with fuse_server(srv, registry_host=registry.host, cache_dir=cache_dir,
                         log_name="fuse-server-2.log",
                         extra_args=("--metrics-address", f"127.0.0.1:{port2}")
                         ) as (_, client2, _):
            client2.check(str(srv / "mnt2"))
            _read_all(srv / "mnt2", tree)
            assert _metric(port2, CACHE_HITS + "_total") > 0
            assert _errors(port2, CORRUPT) == 0


def test_kill_9_while_the_cache_writes_leaves_no_corrupt_entry(tmp_path: Path,
                                                              registry: Registry) -> None:
    """The FUSE server is killed (SIGKILL) as soon as its cache writer has begun to store the
    24 MiB of chunks a read left it (loose files and packs), three times over: every entry on
    disk holds its digest's bytes, and the next server starts on that cache, counts nothing
    corrupt and serves every file right."""
    tree = metadata_tar(big_size=24 << 20, seed=174)
    blob, res = convert(tree.tar, "zstd:chunked", chunk_size=512 << 10)
    spec = push_layer(registry.host, "promises/crash", blob, res)
    wanted = {c.digest for c in _data_chunks(_layer(blob, spec))}
    cache_dir = tmp_path / "cache"

    def loose() -> int:
        return sum(1 for p in (cache_dir / "sha256").rglob("*") if p.is_file())

    cut = 0
    for i in range(3):
        srv = tmp_path / f"srv{i}"
        srv.mkdir()
        with fuse_server(srv, registry_host=registry.host, cache_dir=cache_dir,
                         log_name=f"fuse-server-{i}.log") as (proc, client, _):
            before = loose()
            _read_all(_mount(client, srv / "mnt", spec), tree)
            give_up = time.monotonic() + 20
            while loose() <= before and time.monotonic() < give_up:
                time.sleep(0.001)                   # until the writer has stored a chunk
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        found = _check_cache_on_disk(cache_dir, crashed=True)
        assert found <= wanted
        cut += found != wanted
    assert cut, "every kill came after the writes were done: the test proved nothing"
    port = free_port()
    srv = tmp_path / "after"
    srv.mkdir()
    with fuse_server(srv, registry_host=registry.host, cache_dir=cache_dir,
                     extra_args=("--metrics-address", f"127.0.0.1:{port}")) as (_, client, _):
        _read_all(_mount(client, srv / "mnt", spec), tree)
        assert _errors(port, CORRUPT) == 0
        assert _metric(port, CACHE_HITS + "_total") > 0        # the killed writers' entries
    assert _check_cache_on_disk(cache_dir, crashed=True) == wanted


# -- the size limit ----------------------------------------------------------------------------

def test_cache_stays_within_its_limit_through_the_server(tmp_path: Path,
                                                         registry: Registry) -> None:
    limit = 2 << 20
    pack_bytes = limit // 16            # chunks.py: a pack rolls at min(64 MiB, max_bytes/16)
    chunk_size = 384 << 10              # big.so's chunks are loose files, the rest packed
    tree = metadata_tar(big_size=6 << 20, seed=172)
    blob, res = convert(tree.tar, "zstd:chunked", chunk_size=chunk_size)
    cache_dir = tmp_path / "root" / "cache"
    peak = 0
    with gate_for(registry) as gate, \
            fuse_server(tmp_path, registry_host=gate.host, cache_max=limit) as (_, client, _):
        spec = push_layer(registry.host, "promises/lru", blob, res, pull_host=gate.host)
        layer = _layer(blob, spec)
        assert sum(c.chunk_size for c in _data_chunks(layer)) > 3 * limit
        for i in range(2):          # the second pass needs what the first one evicted
            mp = _mount(client, tmp_path / f"mnt{i}", spec)
            for name, data in tree.files.items():
                assert (mp / name).read_bytes() == data, name
                # while running: one pack over the limit, plus the chunk being written
                peak = max(peak, _cache_bytes(cache_dir))
                assert peak <= limit + pack_bytes + chunk_size, (name, peak)
            if i == 0:      # (the last mount's chunks stay: an unmount would reclaim them)
                client.unmount(str(mp))
        first = _data_chunks(layer)[0]
        fetched_twice = [s for _, s, e in gate.events("done") if s <= first.offset < e]
        assert len(fetched_twice) == 2                          # evicted, fetched again
    # stopped: the writer flushed everything; the design's bound is one pack over the limit
    assert _cache_bytes(cache_dir) <= limit + pack_bytes
    assert peak > limit // 2                                    # it was used, not bypassed
    assert _check_cache_on_disk(cache_dir)


def test_cache_stays_within_its_limit_with_several_layers_read_at_once(
        tmp_path: Path, registry: Registry) -> None:
    """Three layers of two images, read by three threads at once, write 9x the limit: the
    cache on disk never holds more than the design's bound (one pack and one chunk per writer
    over the limit), every read is right, and what is left verifies."""
    limit = 4 << 20
    pack_bytes = limit // 16
    chunk_size = 384 << 10
    cache_dir = tmp_path / "root" / "cache"
    trees = [metadata_tar(big_size=12 << 20, seed=180 + i) for i in range(3)]
    with fuse_server(tmp_path, registry_host=registry.host, cache_max=limit) as (_, client, _):
        mps = []
        for i, tree in enumerate(trees):
            blob, res = convert(tree.tar, "zstd:chunked", chunk_size=chunk_size)
            spec = push_layer(registry.host, f"promises/many-{i % 2}-{i}", blob, res)
            mps.append(_mount(client, tmp_path / f"mnt{i}", spec))
        stop = threading.Event()
        peak = 0
        errors: list[BaseException] = []

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, _cache_bytes(cache_dir))
                time.sleep(0.005)

        def read(i: int) -> None:
            try:
                for _ in range(2):
                    _read_all(mps[i], trees[i])
            except BaseException as exc:
                errors.append(exc)

        sampler = threading.Thread(target=sample)
        sampler.start()
        readers = [threading.Thread(target=read, args=(i,)) for i in range(3)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        stop.set()
        sampler.join()
        assert not errors, errors
        written = sum(len(t.tar) for t in trees)
        assert written > 9 * limit
        assert peak <= limit + pack_bytes + 3 * chunk_size, peak
        assert peak > limit // 2                                # used, not bypassed
    assert _cache_bytes(cache_dir) <= limit + pack_bytes
    assert _check_cache_on_disk(cache_dir)


# -- background fetch --------------------------------------------------------------------------

def test_background_fetch_makes_the_layer_local_and_yields_to_reads(
        tmp_path: Path, registry: Registry) -> None:
    tree = metadata_tar(big_size=24 << 20, seed=173)
    blob, res = convert(tree.tar, "zstd:chunked")
    with gate_for(registry) as gate:
        spec = push_layer(registry.host, "promises/background", blob, res,
                          pull_host=gate.host)
        layer = _layer(blob, spec)
        chunks = _data_chunks(layer)
        first = chunks[0]
        big = layer.resolve("usr/lib/big.so")
        # two reads far past the fill's first two requests (BACKGROUND_REQUEST each): their
        # chunks are in no request of the fill yet while its first request is held
        far = first.offset + 2 * BACKGROUND_REQUEST + (1 << 20)
        late = [c for c in big.chunks if c.offset > far and not c.zeros]
        assert len(late) > 20, "the layer is too small for this test"
        c1, c2 = late[0], late[10]
        # the fill's first request (it starts at the layer's first chunk) is held
        gate.hold_rules.append(lambda s, e: s <= first.offset)
        # held requests must not time out: the deadlines are far beyond the holds
        with fuse_server(tmp_path, registry_host=gate.host, background_rate=1 << 30,
                         read_deadline=120.0, request_timeout=120.0,
                         registry_timeout=120.0) as (_, client, _):
            mp = _mount(client, tmp_path / "mnt", spec)
            wait_for(lambda: len(gate.waiting()) == 1, timeout=60,
                     what="the background fetch's first request")
            # 1. an on-demand read is served while the fill is stuck in its first request
            want1 = tree.files["usr/lib/big.so"][c1.chunk_offset:c1.chunk_offset + 4096]
            assert _pread(mp / "usr/lib/big.so", c1.chunk_offset, 4096) == want1
            assert len(gate.waiting()) == 1 and not _status(client, spec)["background_done"]
            assert any(s <= c1.offset < e for _, s, e in gate.events("done"))
            # 2. the fill sends nothing while an on-demand fetch is in flight
            gate.hold_rules.append(lambda s, e: s <= c2.offset < e)
            got2: list[bytes] = []
            reader = threading.Thread(target=lambda: got2.append(
                _pread(mp / "usr/lib/big.so", c2.chunk_offset, 4096)))
            reader.start()
            try:
                wait_for(lambda: len(gate.waiting()) == 2, timeout=60,
                         what="the on-demand request at the proxy")
                on_demand_seq = gate.events("arrive")[-1][0]
                gate.release(lambda h: h.start <= first.offset)
                wait_for(lambda: any(s <= first.offset for _, s, _ in gate.events("done")),
                         timeout=60, what="the fill's first request answered")
                # give a fill that does not yield every chance to send its next request
                time.sleep(2.0)
                arrived = [a for a in gate.events("arrive") if a[0] > on_demand_seq]
                assert arrived == [], "the background fetch did not wait for the read"
            finally:
                gate.open()
                reader.join(120)
            assert got2 == [tree.files["usr/lib/big.so"][c2.chunk_offset:
                                                         c2.chunk_offset + 4096]]
            released = max(seq for seq, _, _ in gate.events("release"))
            assert all(seq > released for seq, _, _ in gate.events("arrive")
                       if seq > on_demand_seq)
            # 3. the fill finishes; the whole layer is local: it reads with the registry gone
            wait_for(lambda: _status(client, spec)["background_done"], timeout=300,
                     what="the background fetch done")
            assert _status(client, spec)["errors"] == 0
            fetched = {c.digest for c in chunks if any(
                s <= c.offset and c.end_offset <= e for _, s, e in gate.events("done"))}
            assert fetched == {c.digest for c in chunks}
            gate.stop()
            _read_all(mp, tree)
            assert _status(client, spec)["errors"] == 0


# -- a chunk that rots on disk -----------------------------------------------------------------

def test_rotted_cached_chunk_is_refetched_after_a_restart(tmp_path: Path,
                                                          registry: Registry) -> None:
    tree = metadata_tar(big_size=3 << 20, seed=174)
    blob, res = convert(tree.tar, "zstd:chunked", chunk_size=512 << 10)   # loose chunk files
    with gate_for(registry) as gate:
        spec = push_layer(registry.host, "promises/rot", blob, res, pull_host=gate.host)
        layer = _layer(blob, spec)
        victim = layer.resolve("usr/lib/big.so").chunks[2]
        hexd = victim.digest.split(":")[1]
        path = tmp_path / "root" / "cache" / "sha256" / hexd[:2] / hexd
        mp = tmp_path / "mnt"
        with fuse_server(tmp_path, registry_host=gate.host) as (_, client, _):
            _mount(client, mp, spec)
            _read_all(mp, tree)
            wait_for(path.exists, timeout=60, what="the chunk's file in the cache")
        # the server is stopped (its mount recorded); the file rots: same size, other bytes
        data = bytearray(path.read_bytes())
        for i in range(1000, 1100):
            data[i] ^= 0x5A
        path.write_bytes(bytes(data))
        before = len(gate.events("done"))
        port = free_port()
        with fuse_server(tmp_path, registry_host=gate.host, log_name="fuse-server-2.log",
                         extra_args=("--metrics-address", f"127.0.0.1:{port}")
                         ) as (_, client2, _):
            client2.check(str(mp))                          # restored from its record
            assert (mp / "usr/lib/big.so").read_bytes() == tree.files["usr/lib/big.so"]
            assert _errors(port, CORRUPT) == 1
            assert _metric(port, CACHE_HITS + "_total") > 0     # the other chunks: cached
            # what the restarted server fetched, past the TOC (a tail read at the mount)
            chunk_gets = [(s, e) for _, s, e in gate.events("done")[before:]
                          if e <= layer.toc_offset]
            assert chunk_gets == [(victim.offset, victim.end_offset)]
            assert _status(client2, spec)["fetched_bytes"] == victim.compressed_size
            wait_for(lambda: path.exists() and
                     hashlib.sha256(path.read_bytes()).hexdigest() == hexd,
                     timeout=60, what="the chunk cached again, whole")
        log = (tmp_path / "fuse-server-2.log").read_text()
        assert any(victim.digest in line and "corrupt" in line for line in log.splitlines())
