"""The layer table: which layers the FUSE file system serves and which mountpoints show them.

stargz's ``fs/fs.go`` (``Mount``/``Check``/``Unmount``). A layer is served once, as one directory
``<fuse_dir>/<key>`` of :class:`~coldstart.lazyfs.fusefs.FuseFS` (``<plain_dir>/<key>`` when
served on the connection without extended attributes), however many mountpoints show it:
mounting binds that directory onto the mountpoint (read-only), unmounting detaches the bind
lazily (open files keep working until closed), and the last unmount of a layer drops it from the
file system. A second spec for a layer served already must vouch for the same TOC.

Every mount is persisted in :class:`~coldstart.lazyfs.mountstate.MountState` after its bind, and
its record removed after its unbind; :meth:`LayerTable.restore` mounts the records a previous
server left. Operations on one mountpoint are serialized (a lock each); mount syscalls and the
resolver run in worker threads, since binding makes the kernel ask this process's own FUSE loop.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from coldstart.cache import ChunkCache
from coldstart.errors import AlreadyExists, ColdstartError, FailedPrecondition, NotFound
from coldstart.format.gzindex import INDEX_FORMAT
from coldstart.format.toc import TOC
from coldstart.lazyfs.fetcher import lower_priority
from coldstart.lazyfs.fusefs import FuseFS
from coldstart.lazyfs.memory import give_back_freed_memory
from coldstart.lazyfs.mountstate import MountRecord, MountState
from coldstart.lazyfs.mountsys import bind_mount, is_mountpoint, lazy_unmount
from coldstart.lazyfs.pagecache import PageCacheWarmer
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.reclaim import reclaim_layer
from coldstart.lazyfs.resolver import LayerResolver
from coldstart.lazyfs.spec import LayerSpec
from coldstart.lazyfs.tree import LayerTree, build_tree
from coldstart.prefetch.recorder import AccessRecorder

__all__ = ["LayerTable"]

log = logging.getLogger(__name__)


def _not_recording(reader: LayerReader) -> bool:
    return reader.recorder is None


def _sizes(reader: LayerReader) -> Callable[[str], int | None]:
    entries = reader.layer.toc.entries

    def size(name: str) -> int | None:
        e = entries.get(name)
        return None if e is None else e.size
    return size


#: seconds after a mount (its neighbour index built) before its TOC is compacted; then the
#: prefetch must have ended and the reads paused, each wait at most COMPACT_WAIT seconds
COMPACT_AFTER = 2.0
COMPACT_WAIT = 10.0


def _index_then_trim(reader: LayerReader, *, at_once: bool = False) -> None:
    """After a mount: the layer's neighbour index (its first reads want it); then, once the
    start-up has had its turn (:meth:`~coldstart.lazyfs.reader.LayerReader.wait_start_up`;
    ``at_once``: a layer restored after a restart, no start-up waits on it), niced (for the
    node's memory, not for this start-up), the TOC in its compact form and the parsing's
    garbage given back (a 200,000-file layer: about 1.5 s, 330 MB -> 80 MB). Compacting is
    pure Python that holds the GIL: run at once, it held up the mounts of the image's next
    layers and the FUSE loop (the torch image's pull, held back 20 s in a probe: 0.40 s
    against 0.52 s)."""
    reader.windows.warm_index()
    if not at_once and not reader.wait_start_up(COMPACT_AFTER, COMPACT_WAIT):
        return          # unmounted meanwhile: its TOC goes with it
    lower_priority()
    reader.layer.toc.compact()
    give_back_freed_memory()


@dataclass
class _Layer:
    key: str
    tree: LayerTree
    mountpoints: set[str] = field(default_factory=set)


@dataclass
class _Mount:
    mountpoint: str
    spec: LayerSpec
    layer: _Layer


class LayerTable:
    """The served layers of one FUSE file system mounted at ``fuse_dir`` and, as the connection
    that answers no extended attributes, at ``plain_dir`` (None: every layer is bound from
    ``fuse_dir``); ``split``: new layers that show no attribute go to ``plain_dir``.
    Trio-side methods."""

    def __init__(self, fs: FuseFS, fuse_dir: Path, resolver: LayerResolver,
                 state: MountState, *, plain_dir: Path | None = None, split: bool = True,
                 record: bool = False, page_cache: bool = True) -> None:
        self.fs = fs
        self.fuse_dir = fuse_dir
        self.plain_dir = plain_dir
        self._split = split and plain_dir is not None
        self.resolver = resolver
        self.state = state
        self.mounts: dict[str, _Mount] = {}
        self.layers: dict[str, _Layer] = {}        # layer digest -> shared tree
        self._locks: dict[str, trio.Lock] = {}
        self._generation = 0
        self._stopping = False
        self._record_new = record     # layers mounted from now on record their accesses
        self._page_cache = page_cache  # prefetched chunks go to the kernel's page cache
        self._stopped: dict[str, AccessRecorder] = {}   # layer key -> a stopped recording

    def shown_as(self, digest: str) -> tuple[str, str] | None:
        """How layer ``digest`` shows in a mount table: the ``major:minor`` device of the
        FUSE connection it is served on and its directory there (``/<key>``, the root of its
        binds); None when it is not served. Safe from any thread."""
        layer = self.layers.get(digest)
        if layer is None:
            return None
        try:
            dev = os.stat(self.dir_of(layer.tree).parent).st_dev
        except OSError:
            return None
        return f"{os.major(dev)}:{os.minor(dev)}", "/" + layer.key

    def _lock(self, mountpoint: str) -> trio.Lock:
        lock = self._locks.get(mountpoint)
        if lock is None:
            lock = self._locks[mountpoint] = trio.Lock()
        return lock

    def _note_generation(self, key: str) -> None:
        """New layer names come after ``key``'s generation (``<digest>-<generation>``)."""
        gen = key.rpartition("-")[2]
        if gen.isdigit():
            self._generation = max(self._generation, int(gen))

    def dir_of(self, tree: LayerTree) -> Path:
        """The directory the layer's binds are made from (its connection's mount)."""
        return self.plain_dir / tree.key if tree.plain and self.plain_dir else \
            self.fuse_dir / tree.key

    async def mount(self, mountpoint: str, spec: LayerSpec, *, restoring: bool = False,
                    key: str | None = None, base: int | None = None,
                    plain: bool = False) -> None:
        """Serve ``spec``'s layer at ``mountpoint`` (idempotent for the same layer).

        ``key`` and ``base``: the layer's name in the FUSE mount and first inode number, as a
        predecessor whose connection we took over served it; the bind at ``mountpoint`` is
        then that predecessor's and still good (kept), and ``plain`` says which connection
        it is from. A new layer goes to the plain connection when it shows no extended
        attribute (:meth:`~coldstart.lazyfs.tree.LayerTree.shows_xattrs`)."""
        if self._stopping:
            raise FailedPrecondition("the FUSE server is shutting down")
        taken_over = restoring and key is not None and base is not None
        async with self._lock(mountpoint):
            cur = self.mounts.get(mountpoint)
            if cur is not None:
                if cur.spec.digest == spec.digest:
                    return
                raise AlreadyExists(f"{mountpoint} already serves layer {cur.spec.digest}")
            later = [d for d in spec.image_layers if d != spec.digest and d not in self.layers]
            if later and not restoring:
                # the image's later layers get their footers and TOCs while this one mounts
                # (containerd asks for each only once the one below it is mounted)
                threading.Thread(target=self.resolver.open_ahead, args=(spec, later),
                                 daemon=True, name="open-ahead").start()
            layer = self.layers.get(spec.digest)
            created = False
            if layer is not None:
                # the layer is served already: this spec must vouch for the same TOC
                served = layer.tree.reader.layer
                await trio.to_thread.run_sync(functools.partial(
                    self.resolver.check_same_toc, spec, served.toc_digest,
                    indexed=served.format == INDEX_FORMAT,
                    claims=getattr(served, "toc_claims", None)))
            else:
                reader = await trio.to_thread.run_sync(self.resolver.open, spec)
                if key is None or base is None:
                    self._generation += 1
                    key = f"{spec.digest.rpartition(':')[2][:16]}-{self._generation}"
                    base = None
                else:
                    self._note_generation(key)
                base = self.fs.allocate(len(reader.layer.toc.entries) + 1, base)
                tree = await trio.to_thread.run_sync(build_tree, key, base, reader)
                if taken_over:
                    tree.plain = plain and self.plain_dir is not None
                elif self._split:
                    tree.plain = not await trio.to_thread.run_sync(tree.shows_xattrs)
                layer = _Layer(key, tree)
                if self._record_new:
                    reader.recorder = AccessRecorder()
                if self._page_cache and not taken_over:
                    # the prefetch and a big file's stream hand their chunks to the page
                    # cache (the warmer starts its thread on the first chunk; not while the
                    # connection we take over is not ours yet: nothing may write to it)
                    reader.page_cache = PageCacheWarmer(
                        self.dir_of(tree), _sizes(reader), self.fs.store_pages,
                        stats=reader.stats,
                        enabled=functools.partial(_not_recording, reader))
                self.layers[spec.digest] = layer
                self.fs.add(tree)
                created = True
            try:
                bound = await trio.to_thread.run_sync(is_mountpoint, mountpoint)
                if bound and not taken_over:
                    # not ours (we checked): a dead bind left by a crashed predecessor
                    log.warning("%s: lazily unmounting a stale mount first", mountpoint)
                    await trio.to_thread.run_sync(lazy_unmount, mountpoint)
                if not (bound and taken_over):
                    await trio.to_thread.run_sync(bind_mount, str(self.dir_of(layer.tree)),
                                                  mountpoint)
            except BaseException:
                if created and not layer.mountpoints:
                    self._drop_layer(spec.digest)
                raise
            layer.mountpoints.add(mountpoint)
            self.mounts[mountpoint] = _Mount(mountpoint, spec, layer)
            await trio.to_thread.run_sync(functools.partial(
                self.state.save, mountpoint, spec, key=layer.key, base=layer.tree.base,
                end=layer.tree.end, plain=layer.tree.plain))
            reader = layer.tree.reader
            if created:
                # the layer's tables live as long as it does: keep the collector off them
                gc.freeze()
                threading.Thread(target=_index_then_trim, args=(reader,),
                                 kwargs={"at_once": restoring}, daemon=True,
                                 name=f"index-{layer.key}").start()
            if created and (reader.prefetcher.wanted or reader.fill.rate > 0):
                threading.Thread(target=reader.prefetch_then_rest, daemon=True,
                                 name=f"prefetch-{layer.key}").start()
            log.info("mounted layer %s (%s) at %s%s", spec.digest, spec.reference, mountpoint,
                     " (restored)" if restoring else "")

    def _drop_layer(self, digest: str, *, reclaim: bool = False) -> None:
        """Forget a layer no mountpoint serves (its reader stops: prefetch, fill, stream);
        ``reclaim``: then remove the chunks only it had from the cache, in a thread."""
        layer = self.layers.pop(digest, None)
        if layer is not None:
            self._stopped.pop(layer.key, None)
            self.fs.remove(layer.key)
            cache = layer.tree.reader.cache
            if reclaim and isinstance(cache, ChunkCache):
                threading.Thread(target=reclaim_layer,
                                 args=(cache, layer.tree.toc, self._mounted_tocs),
                                 kwargs={"what": f"layer {digest} (unmounted)"}, daemon=True,
                                 name=f"reclaim-{layer.key}").start()

    def _mounted_tocs(self) -> list[TOC]:
        """The TOCs of the layers served now (any thread)."""
        return [layer.tree.toc for layer in list(self.layers.values())]

    async def unmount(self, mountpoint: str) -> None:
        """Undo :meth:`mount` (lazily: open files keep working until closed)."""
        async with self._lock(mountpoint):
            cur = self.mounts.get(mountpoint)
            if cur is None:
                await trio.to_thread.run_sync(self.state.remove, mountpoint)
                raise NotFound(f"nothing is mounted at {mountpoint}")
            await trio.to_thread.run_sync(lazy_unmount, mountpoint)
            del self.mounts[mountpoint]
            cur.layer.mountpoints.discard(mountpoint)
            if not cur.layer.mountpoints:
                # its last snapshot is gone (containerd removed the image): its chunks too
                self._drop_layer(cur.spec.digest, reclaim=True)
            await trio.to_thread.run_sync(self.state.remove, mountpoint)
            log.info("unmounted %s", mountpoint)

    async def check(self, mountpoint: str) -> None:
        """NotFound unless ``mountpoint`` is served; FailedPrecondition if its bind is gone."""
        cur = self.mounts.get(mountpoint)
        if cur is None:
            raise NotFound(f"nothing is mounted at {mountpoint}")
        if not await trio.to_thread.run_sync(is_mountpoint, mountpoint):
            raise FailedPrecondition(f"{mountpoint} is no longer mounted")

    def status(self) -> list[dict[str, Any]]:
        """One dict per mountpoint: layer, reference, fetched bytes, errors, last error."""
        out: list[dict[str, Any]] = []
        for mp, m in sorted(self.mounts.items()):
            tree = m.layer.tree
            out.append({"mountpoint": mp, "digest": m.spec.digest,
                        "reference": m.spec.reference, "key": m.layer.key,
                        "format": tree.reader.layer.format, "files": len(tree.entries),
                        "plain": tree.plain,
                        "recording": tree.reader.recorder is not None,
                        **tree.reader.stats.as_dict()})
        return out

    def record(self, on: bool, mountpoint: str | None) -> int:
        """Start (a fresh recording) or stop recording ``mountpoint``'s layer, or every layer
        and those mounted later (``None``); the number of layers changed."""
        if mountpoint is None:
            self._record_new = on
            layers = list(self.layers.values())
        else:
            cur = self.mounts.get(mountpoint)
            if cur is None:
                raise NotFound(f"nothing is mounted at {mountpoint}")
            layers = [cur.layer]
        changed = 0
        for layer in layers:
            reader = layer.tree.reader
            if on and reader.recorder is None:
                reader.recorder = AccessRecorder()
                changed += 1
            elif not on and reader.recorder is not None:
                # kept (for ``profile``) until recording starts again or the layer goes
                self._stopped[layer.key] = reader.recorder
                reader.recorder = None
                changed += 1
            if on:
                self._stopped.pop(layer.key, None)
        return changed

    def profile(self) -> list[dict[str, Any]]:
        """Per layer recording (or recorded until stopped): digest, mountpoints, files read
        (first-access order)."""
        out: list[dict[str, Any]] = []
        for digest, layer in sorted(self.layers.items()):
            rec = layer.tree.reader.recorder or self._stopped.get(layer.key)
            if rec is None:
                continue
            out.append({"digest": digest, "mountpoints": sorted(layer.mountpoints),
                        "files": [a.as_dict() for a in rec.accesses()]})
        return out

    async def restore(self, records: list[MountRecord], *, takeover: bool = False) -> None:
        """Mount what a previous server recorded; a failure keeps its record for the next try.
        ``takeover``: we serve the predecessor's FUSE connection: each layer under the name
        and inodes it had, its binds kept."""
        for rec in records:
            # a layer restored afresh gets a name no record had: the kernel may still hold a
            # recorded one's entry (a connection taken over) for an inode no longer served
            if rec.key is not None:
                self._note_generation(rec.key)
        for rec in records:
            # (taking over: a bind of ours is never stat'ed, nobody serves it yet)
            if not (takeover and await trio.to_thread.run_sync(is_mountpoint, rec.mountpoint)
                    ) and not await trio.to_thread.run_sync(os.path.isdir, rec.mountpoint):
                # the snapshot was removed while we were down: nothing to restore
                log.warning("restore %s: the mountpoint is gone; record dropped", rec.mountpoint)
                await trio.to_thread.run_sync(self.state.remove, rec.mountpoint)
                continue
            try:
                await self.mount(rec.mountpoint, rec.spec, restoring=True,
                                 key=rec.key if takeover else None,
                                 base=rec.base if takeover else None,
                                 plain=takeover and rec.plain)
                log.info("restored %s (%s)", rec.mountpoint, rec.spec.digest)
            except Exception as exc:
                # keep the record: the next start (or a mount call) tries again
                log.error("restore %s (%s) failed: %s: %s", rec.mountpoint, rec.spec.digest,
                          type(exc).__name__, exc)

    async def stop(self, *, unmount: bool = True) -> None:
        """Refuse further mounts; stop every layer's prefetch and page cache warming (no
        store may reach the FUSE session once it closes); lazily unmount every bind (the
        records stay, for a restore), unless ``unmount`` is off (a successor takes over)."""
        self._stopping = True
        for layer in self.layers.values():
            layer.tree.reader.close()
        for layer in self.layers.values():
            warmer = layer.tree.reader.page_cache
            if warmer is not None:
                await trio.to_thread.run_sync(warmer.join, 5.0)
        for mp in list(self.mounts) if unmount else []:
            try:
                await trio.to_thread.run_sync(lazy_unmount, mp)
            except (ColdstartError, OSError) as exc:
                log.error("unmount %s: %s", mp, exc)
