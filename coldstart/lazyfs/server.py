"""The FUSE server process: wiring and lifecycle; serves every lazily mounted layer of the node.

stargz's ``service.go``. It builds the parts from the :class:`~coldstart.config.Config` (chunk
cache, fetcher, registry client, :class:`~coldstart.lazyfs.resolver.LayerResolver`,
:class:`~coldstart.lazyfs.fusefs.FuseFS`, :class:`~coldstart.lazyfs.layers.LayerTable`), mounts
the file system at ``<root>/fuse`` and, as the connection that answers no extended attributes,
at ``<root>/fuse-plain`` (each connection held and taken over on its own), and answers the
control protocol (:mod:`coldstart.lazyfs.control`) on a unix socket (``fuse.socket``), from the
same trio loop.

Start: claim the root, serve metrics (if asked), lazily unmount what a dead predecessor left
(its binds and both FUSE mounts), mount FUSE, listen, then restore every mount recorded under
``<root>/fuse-state/`` while already answering ``ping`` (other ops wait for the restore).
SIGTERM/SIGINT: stop accepting, unmount, exit 0, keep the records.

One server per root: it holds an exclusive ``flock`` on ``<root>/fuse-server.lock`` for its
lifetime (the kernel drops it when the process dies) and refuses to start, before it touches
any mount or socket, when another holds it or something already answers on its control socket
(:class:`~coldstart.errors.FailedPrecondition`: one line, exit status 5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import trio

from coldstart.cache.chunks import ChunkCache
from coldstart.config import Config
from coldstart.errors import ColdstartError, FailedPrecondition, InvalidArgument
from coldstart.files import private_dir
from coldstart.lazyfs import control, handover
from coldstart.lazyfs.control import error_payload
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.fileshare import FileShare
from coldstart.lazyfs.fusefs import FuseFS, fuse_adopt, fuse_mount
from coldstart.lazyfs.indexes import IndexFinder
from coldstart.lazyfs.layers import LayerTable
from coldstart.lazyfs.memory import keep_freed_memory
from coldstart.lazyfs.metrics import FuseMetrics
from coldstart.lazyfs.mountstate import MountRecord, MountState
from coldstart.lazyfs.mountsys import is_mountpoint, lazy_unmount, set_read_ahead
from coldstart.lazyfs.resolver import LayerResolver
from coldstart.lazyfs.spec import FUSE_DIR, PLAIN_FUSE_DIR, LayerSpec
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.remote import RegistryBlob
from coldstart.unixsock import listen_unix, socket_answers, unlink_own
from coldstart.unpack.fullpull import pull_layer, remove_stale_parts

__all__ = ["LOCK_FILE", "FuseServer", "error_payload", "parse_metrics_address", "serve_connection"]

log = logging.getLogger(__name__)

#: held (flock, exclusive) by the one FUSE server of a root, for its whole life
LOCK_FILE = "fuse-server.lock"


def parse_metrics_address(address: str) -> tuple[str, int]:
    """``host:port`` (host optional: 127.0.0.1) as ``(host, port)``; InvalidArgument otherwise.

    >>> parse_metrics_address("0.0.0.0:9101")
    ('0.0.0.0', 9101)
    """
    host, sep, port = address.rpartition(":")
    if (not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536
            or any(c.isspace() for c in address)):
        raise InvalidArgument(f"metrics address must be host:port, not {address!r}")
    return host or "127.0.0.1", int(port)


class FuseServer:
    """One FUSE server: ``FuseServer(config).run()`` blocks until SIGTERM/SIGINT.

    The constructor already claims the root (FailedPrecondition when another server has it);
    :meth:`run` releases it when it returns."""

    def __init__(self, config: Config, *, root: str | None = None,
                 socket_path: str | None = None, metrics_address: str | None = None) -> None:
        self.config = config
        self._unpack_lock = threading.Lock()
        self._unpack_locks: dict[str, threading.Lock] = {}
        self.root = Path(root or config.root)
        self.fuse_dir = self.root / FUSE_DIR
        self.plain_dir = self.root / PLAIN_FUSE_DIR
        self.socket_path = socket_path or config.fuse.socket
        self.metrics_address = (config.fuse.metrics_address if metrics_address is None
                                else metrics_address)
        if self.metrics_address:
            parse_metrics_address(self.metrics_address)
        # before anything below opens the cache or state: a refused start touches nothing
        self._root_lock: IO[str] | None = self._claim_root()
        self._socket_ino: int | None = None       # our control socket's inode, once bound
        self.state = MountState(self.root / "fuse-state")
        self.metrics = FuseMetrics()
        cache_dir = config.cache.dir or str(self.root / "cache")
        # write failures (a full disk) and corrupt chunks count in coldstart_fuse_errors
        # (kinds "cache_write", "cache_corrupt")
        self.cache = ChunkCache(cache_dir, max_bytes=config.cache.max_bytes,
                                verify=config.cache.verify, on_error=self.metrics.error)
        f = config.fetch
        self.fetcher = ChunkFetcher(self.cache, concurrency=f.concurrency,
                                    max_coalesce_bytes=f.max_coalesce_bytes,
                                    request_timeout=f.request_timeout, telemetry=self.metrics)
        # the start-up's cache writes wait until its reads pause (the data is served from
        # memory meanwhile)
        self.cache.write_gate = self.fetcher.wait_quiet
        self.fs = FuseFS(entry_timeout=config.fuse.entry_timeout,
                         attr_timeout=config.fuse.attr_timeout,
                         read_threads=max(8, 2 * f.concurrency), on_error=self.metrics.error)
        self.client = RegistryClient.from_config(
            config.registry,
            keychain_dir=config.registry.cri_keychain or self.root / "cri-credentials")
        self.resolver = LayerResolver(self.client, self.fetcher,
                                      request_timeout=f.request_timeout,
                                      read_deadline=f.read_deadline,
                                      background_rate=f.background_rate,
                                      neighbor_bytes=f.neighbor_bytes,
                                      neighbor_max_bytes=f.neighbor_max_bytes,
                                      allow_unverified=config.allow_unverified,
                                      indexes=self._index_finder(config))
        self.layers = LayerTable(self.fs, self.fuse_dir, self.resolver, self.state,
                                 plain_dir=self.plain_dir, split=config.fuse.split_xattrs,
                                 record=config.fuse.record,
                                 page_cache=config.fuse.page_cache)
        self.files = self._file_share(config)
        self._restored: trio.Event | None = None
        self._clean_stop = False        # a signal asked us to stop (not a crash)
        self._held = False              # the holder has our connection
        self._held_plain = False        # the other holder has our plain connection

    # -- process lifecycle -----------------------------------------------------------------

    def _file_share(self, config: Config) -> FileShare | None:
        """The files socket (``fuse.files_socket``; None: off)."""
        path = config.fuse.files_socket
        if path == "auto":
            path = str(Path(self.socket_path).parent / "files" / "files.sock")
        if not path:
            return None
        share = FileShare(os.path.abspath(path), self.fs.file_at,
                          shown=lambda digest: self.layers.shown_as(digest))
        self.fs.file_token = share.token
        return share

    def _serve_files(self) -> None:
        """Start the files socket; a failure costs only the loaders' fast path (logged)."""
        if self.files is None:
            return
        try:
            self.files.start()
        except FailedPrecondition as exc:
            log.warning("%s: loaders in containers read lazily mounted files through FUSE "
                        "only", exc)
            self.fs.file_token = None
            self.files = None

    def _index_finder(self, config: Config) -> IndexFinder | None:
        """Gzip indexes for plain gzip layers, as ``[index]`` trusts them (None: off)."""
        ix = config.index
        if ix.trust == "off":
            return None
        return IndexFinder(self.client, trust=ix.trust, trusted=ix.trusted,
                           trusted_file=Path(ix.trusted_file or self.root / "trusted-indexes"),
                           bad_file=self.root / "bad-indexes.json")

    def _unpack(self, directory: str, spec: LayerSpec, lowers: list[str], parent_chain: str,
                chain: str) -> dict[str, Any]:
        """Pull ``spec``'s layer in full into ``directory`` (a worker thread): a fresh, empty
        staging directory the snapshotter made and renames into place only once this
        answered, so a pull it stopped waiting for writes nowhere it uses. One pull per
        layer at a time (they share the download's part file)."""
        p = self.config.pull
        with self._unpack_lock:
            lock = self._unpack_locks.setdefault(spec.digest, threading.Lock())
        with lock:
            target = Path(directory)
            if not target.is_dir() or any(target.iterdir()):
                raise FailedPrecondition(f"{directory}: not an empty directory to unpack into")
            downloads = self.root / "downloads"
            remove_stale_parts(downloads)
            ref = Reference.parse(spec.reference)
            blob = RegistryBlob(self.client, ref, spec.digest,
                                spec.size if spec.size >= 0 else None,
                                timeout=self.config.fetch.request_timeout * 3)
            pulled = pull_layer(blob, digest=spec.digest, size=blob.size(), dest=target,
                                workdir=downloads, lowers=[Path(x) for x in lowers],
                                parent_chain=parent_chain, expect_chain=chain, jobs=p.jobs,
                                part=p.part_bytes)
        log.info("layer %s pulled in full into %s: %d bytes fetched (%d resumed) in %.2f s, "
                 "%d entries unpacked as they arrived, done in %.2f s", spec.digest, directory,
                 pulled.fetched_bytes, pulled.resumed_bytes, pulled.fetch_seconds,
                 pulled.entries, pulled.seconds)
        return dataclasses.asdict(pulled)

    def run(self) -> None:
        """Mount, restore, serve until a signal; then unmount and return."""
        keep_freed_memory()
        try:
            trio.run(self._main)
        finally:
            self._release_root()

    def _claim_root(self) -> IO[str]:
        """Lock ``<root>/fuse-server.lock``; FailedPrecondition if another server has it or
        already answers on our control socket (checked before any unmount or unlink)."""
        path = self.root / LOCK_FILE
        if not self.root.exists():                # created private; checked under the lock
            private_dir(self.root, "FUSE server root")
        try:
            f = open(path, "a+")  # noqa: SIM115 - held for the life of the process
        except OSError as exc:
            raise FailedPrecondition(f"cannot open the FUSE server lock {path}: {exc}") from exc
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            f.close()
            if isinstance(exc, BlockingIOError):
                raise FailedPrecondition(f"another coldstart fuse-server serves root "
                                         f"{self.root} (it holds {path})") from None
            raise FailedPrecondition(f"cannot lock {path}: {exc}") from exc
        if socket_answers(self.socket_path):
            f.close()
            raise FailedPrecondition(f"a FUSE server already answers on {self.socket_path}")
        try:
            private_dir(self.root, "FUSE server root")
        except FailedPrecondition:
            f.close()
            raise
        with contextlib.suppress(OSError):  # for whoever wonders who holds it
            f.truncate(0)
            f.write(f"{os.getpid()}\n")
            f.flush()
        return f

    def _release_root(self) -> None:
        if self._root_lock is not None:
            self._root_lock.close()
            self._root_lock = None

    async def _main(self) -> None:
        self._restored = trio.Event()
        held: int | None = None
        held_plain: int | None = None
        try:
            if self.metrics_address:  # first: a bad address must not leave a mount behind
                try:
                    self.metrics.serve(self.metrics_address)
                except OSError as exc:
                    raise FailedPrecondition(f"cannot serve metrics on {self.metrics_address}: "
                                             f"{exc.strerror or exc}") from exc
            records = self.state.load()
            # a predecessor's connections, kept alive by the holders: serve them, keep their
            # mounts
            held = handover.fetch(self.root) if is_mountpoint(str(self.fuse_dir)) else None
            held_plain = (handover.fetch(self.root, name=handover.PLAIN_HOLDER_SOCKET)
                          if held is not None and is_mountpoint(str(self.plain_dir)) else None)
        except BaseException:
            if held is not None:
                os.close(held)
            self._stopped(session=False, unmount=False)
            raise
        if held is not None:
            await self._take_over(held, held_plain, records)
        else:
            await self._start(records)

    async def _start(self, records: list[MountRecord]) -> None:
        """Mount the FUSE file system afresh, restore the recorded layers, serve."""
        mounted = False
        try:
            for rec in records:  # binds left by a dead predecessor point at a dead connection
                with contextlib.suppress(ColdstartError, OSError):
                    lazy_unmount(rec.mountpoint)
            _clear_mount(self.fuse_dir)
            _clear_mount(self.plain_dir)
            # a holder must only ever hold the connection mounted at its directory: one left
            # with a predecessor's (the other one died) lets it go first
            handover.release(self.root)
            handover.release(self.root, name=handover.PLAIN_HOLDER_SOCKET)
            listener = self._listen()
            self._serve_files()
            fuse_mount(self.fs, str(self.fuse_dir))
            mounted = True
            fuse_mount(self.fs, str(self.plain_dir), plain=True)
            log.info("FUSE server pid %d: %s and %s mounted, control socket %s", os.getpid(),
                     self.fuse_dir, self.plain_dir, self.socket_path)
            async with trio.open_nursery() as nursery:
                self._serve_fuse(nursery)
                nursery.start_soon(self._restore, records)
                nursery.start_soon(self._serve, listener)
                await self._serve_until_signal(nursery)
        finally:
            # unmount on a stop asked for; after a crash, a connection the holder keeps is
            # left to the next server, which takes it over
            self._stopped(session=mounted, unmount=self._clean_stop or not self._held)

    async def _take_over(self, held: int, held_plain: int | None,
                         records: list[MountRecord]) -> None:
        """Serve the connections ``held`` and ``held_plain`` that a dead predecessor left:
        every recorded layer first, under the name and inodes it had (the requests that wait
        meanwhile stay queued in the kernel), then the connections themselves. Without
        ``held_plain`` (its holder is gone, or the predecessor had no such connection), the
        plain connection is mounted afresh and its layers are restored like a fresh start's."""
        taken = False
        try:
            log.info("FUSE server pid %d: taking over the connection of %s", os.getpid(),
                     self.fuse_dir)
            listener = self._listen()
            self._serve_files()
            # the layers whose binds are still there, under the names and inodes the kernel
            # knows; nothing may touch the mount before it is served (that would wait for
            # us), so the rest are restored afresh once it is
            ends = [rec.end for rec in records if rec.end is not None]
            self.fs.reserve(max(ends, default=0))     # never reuse a recorded inode range
            bound = [rec for rec in records if rec.key is not None and rec.base is not None
                     and rec.end is not None and (held_plain is not None or not rec.plain)
                     and is_mountpoint(rec.mountpoint)]
            fresh_plain = held_plain is None
            if fresh_plain:
                log.info("%s is mounted afresh (its connection was not held)", self.plain_dir)
                # the binds of its layers point at a dead (or unserved) connection: detached
                # without a look (a stat would fail or hang), then restored like a fresh start's
                for rec in records:
                    if rec.plain:
                        with contextlib.suppress(ColdstartError, OSError):
                            lazy_unmount(rec.mountpoint)
                handover.release(self.root, name=handover.PLAIN_HOLDER_SOCKET)
                _clear_mount(self.plain_dir)
                fuse_mount(self.fs, str(self.plain_dir), plain=True)
            await self.layers.restore(bound, takeover=True)
            fuse_adopt(self.fs, held)
            taken = self._held = True
            log.info("took over the FUSE connection of %s", self.fuse_dir)
            if held_plain is not None:
                fuse_adopt(self.fs, held_plain, plain=True)
                held_plain = None
                self._held_plain = True
                log.info("took over the FUSE connection of %s", self.plain_dir)
            async with trio.open_nursery() as nursery:
                self._serve_fuse(nursery)
                if fresh_plain:
                    self._held_plain = await self._ready(self.plain_dir,
                                                         handover.PLAIN_HOLDER_SOCKET)
                taken_ids = {id(rec) for rec in bound}
                rest = [rec for rec in records if id(rec) not in taken_ids]
                if rest:
                    await self.layers.restore(rest)
                assert self._restored is not None
                self._restored.set()
                nursery.start_soon(self._serve, listener)
                await self._serve_until_signal(nursery)
        finally:
            if not taken:
                os.close(held)
            if held_plain is not None:
                os.close(held_plain)
            self._stopped(session=taken, unmount=self._clean_stop)

    def _hold(self, name: str) -> bool:
        """Give the holder ``name`` a copy of its connection (a failure costs only the
        takeover)."""
        session = (self.fs.plain_session if name == handover.PLAIN_HOLDER_SOCKET
                   else self.fs.session)
        try:
            if session is None:
                raise FailedPrecondition("no FUSE connection is served")
            handover.hold(session.fd, self.root, name=name)
            return True
        except (ColdstartError, OSError) as exc:
            log.warning("the FUSE connection is not held outside this process (%s): if it "
                        "dies, running containers lose their lazily mounted layers", exc)
            return False

    async def _ready(self, mountpoint: Path, holder: str) -> bool:
        """Once the connection mounted at ``mountpoint`` is initialized (a stat waits for
        ``INIT``), have it held and raise its read-ahead; whether it is held. The kernel caps
        read-ahead at what FUSE_INIT negotiated (128 KiB); after INIT the bdi setting may be
        raised. Never earlier: a successor must not see a connection whose INIT is not
        done."""
        await trio.to_thread.run_sync(os.stat, mountpoint)
        held = await trio.to_thread.run_sync(self._hold, holder)   # may start a process
        if not set_read_ahead(str(mountpoint), self.config.fuse.read_ahead_kb):
            log.warning("read_ahead_kb of %s not set", mountpoint)
        return held

    async def _serve_until_signal(self, nursery: trio.Nursery) -> None:
        # SIGUSR2: hand over (an upgrade): leave the mounts and the connection to the next
        # server, which takes them over; SIGTERM, SIGINT: stop for good (unmount)
        self._clean_stop = await self._wait_signal() != signal.SIGUSR2
        self._unlink_socket()
        await self.layers.stop(unmount=self._clean_stop)
        for session in self.fs.sessions():
            session.terminate()
        nursery.cancel_scope.cancel()

    def _stopped(self, *, session: bool, unmount: bool) -> None:
        """Close what we opened; ``session``: a FUSE session was started, ``unmount``: end
        it with the mount (else the holder keeps the connection for a successor)."""
        self._unlink_socket()
        fuse, plain = self.fs.session, self.fs.plain_session
        deadline = time.monotonic() + self.config.fetch.read_deadline
        for s in (fuse, plain):
            if s is not None:
                # first: the reads under way finish with the fetcher and cache still open (on
                # a handover a reader never sees an error); the rest wait for the successor
                with contextlib.suppress(Exception):
                    s.stop(timeout=max(0.0, deadline - time.monotonic()))
        if self.files is not None:
            self.files.close()
        self.resolver.close()
        self.fetcher.close()
        with contextlib.suppress(Exception):
            self.cache.close()
        self.fs.session = self.fs.plain_session = None
        # a connection no holder has would die with us: unmounted (its layers are restored
        # afresh by the successor), never left to abort under the containers
        unmount_plain = unmount or (plain is not None and not self._held_plain)
        for s, where, off in ((fuse, self.fuse_dir, unmount),
                              (plain, self.plain_dir, unmount_plain)):
            if s is not None:
                with contextlib.suppress(Exception):
                    s.close(unmount=session and off, mountpoint=str(where))
        # unmounted: nothing left to hold
        if session and unmount:
            handover.release(self.root)
        if session and unmount_plain:
            handover.release(self.root, name=handover.PLAIN_HOLDER_SOCKET)
        with contextlib.suppress(Exception):
            self.client.close()
        log.info("FUSE server stopped")

    def _unlink_socket(self) -> None:
        """Remove our control socket, never a successor's that replaced the path."""
        unlink_own(self.socket_path, self._socket_ino)
        self._socket_ino = None

    def _serve_fuse(self, nursery: trio.Nursery) -> None:
        """Serve each FUSE connection in a thread of its own until terminated or unmounted."""
        for session in self.fs.sessions():
            nursery.start_soon(functools.partial(
                trio.to_thread.run_sync, session.serve, abandon_on_cancel=True))

    async def _wait_signal(self) -> int:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR2) as sigs:
            async for signum in sigs:
                if signum == signal.SIGUSR2:
                    log.info("signal %d: exiting, the mounts are left to the next server",
                             signum)
                else:
                    log.info("signal %d: shutting down", signum)
                return int(signum)
        raise AssertionError("the signal receiver ended")

    def _listen(self) -> trio.SocketListener:
        path = self.socket_path
        try:
            # nothing answers there (checked under the lock): a dead predecessor's socket
            std, self._socket_ino = listen_unix(path, mode=0o600, dir_mode=0o711)
        except OSError as exc:
            raise FailedPrecondition(f"cannot listen on the control socket {path}: "
                                     f"{exc}") from exc
        sock = trio.socket.from_stdlib_socket(std)
        return trio.SocketListener(sock)

    async def _serve(self, listener: trio.SocketListener) -> None:
        assert self._restored is not None
        handler = _Handler(self.fuse_dir, self.layers, self._restored, self._unpack,
                           self.fetcher.hold)

        async def connection(stream: trio.SocketStream) -> None:
            await serve_connection(stream, handler)

        await trio.serve_listeners(connection, [listener])

    async def _restore(self, records: list[MountRecord]) -> None:
        try:
            async def ready_plain() -> None:
                self._held_plain = await self._ready(self.plain_dir,
                                                     handover.PLAIN_HOLDER_SOCKET)

            async with trio.open_nursery() as nursery:   # each starts a holder process
                nursery.start_soon(ready_plain)
                self._held = await self._ready(self.fuse_dir, handover.HOLDER_SOCKET)
            await self.layers.restore(records)
        finally:
            if self._restored is not None:
                self._restored.set()


def _clear_mount(directory: Path) -> None:
    """Lazily unmount what a dead predecessor left at ``directory`` (stacked mounts too),
    then make sure the directory exists (FailedPrecondition if it cannot be made)."""
    for _ in range(8):
        try:
            if not lazy_unmount(str(directory)):
                break
        except (ColdstartError, OSError):
            break
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FailedPrecondition(f"cannot create {directory}: {exc}") from exc


async def serve_connection(stream: trio.abc.HalfCloseableStream,
                           handler: control.ControlHandler) -> None:
    """Answer the request lines of one control connection, in order, until the peer closes it
    (or sends a line over :data:`~coldstart.lazyfs.control.MAX_LINE`: one error reply, closed)."""
    lines = control.LineBuffer()
    try:
        async with stream:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                try:
                    requests = lines.feed(data)
                except InvalidArgument as exc:   # a line too long: the stream is lost
                    await stream.send_all(control.error_reply(exc))
                    return
                for line in requests:
                    await stream.send_all(await control.dispatch(line, handler))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return


class _Handler:
    """The server as :class:`~coldstart.lazyfs.control.ControlHandler`: ``ping`` from the
    process, the rest from the layer table once the restore is done."""

    def __init__(self, fuse_dir: Path, layers: LayerTable, restored: trio.Event,
                 unpack: Callable[..., dict[str, Any]],
                 hold: Callable[[float], None]) -> None:
        self.fuse_dir = fuse_dir
        self.layers = layers
        self.restored = restored
        self._unpack = unpack
        self._hold = hold
        # full pulls at once: each takes a core to unpack, one to inflate
        self._unpacking = trio.CapacityLimiter(2)

    async def ready(self) -> None:
        await self.restored.wait()  # answer from the restored mount table

    async def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "fuse_dir": str(self.fuse_dir)}

    async def mount(self, mountpoint: str, spec: LayerSpec) -> None:
        await self.layers.mount(mountpoint, spec)

    async def check(self, mountpoint: str) -> None:
        await self.layers.check(mountpoint)

    async def unmount(self, mountpoint: str) -> None:
        await self.layers.unmount(mountpoint)

    def status(self) -> list[dict[str, Any]]:
        return self.layers.status()

    def record(self, on: bool, mountpoint: str | None) -> int:
        return self.layers.record(on, mountpoint)

    def profile(self) -> list[dict[str, Any]]:
        return self.layers.profile()

    def hold(self, seconds: float) -> None:
        self._hold(seconds)

    async def unpack(self, directory: str, spec: LayerSpec, lowers: list[str],
                     parent_chain: str, chain: str) -> dict[str, Any]:
        return await trio.to_thread.run_sync(
            functools.partial(self._unpack, directory, spec, lowers, parent_chain, chain),
            limiter=self._unpacking)

