"""The FUSE server process: serves every lazily mounted layer of the node, outlives the gRPC one.

It mounts :class:`~coldstart.lazyfs.fusefs.FuseFS` once at ``<root>/fuse`` and answers a
JSON-lines control protocol on a unix socket (``fuse.socket``), from the same trio loop::

    {"op": "ping"}                                        -> {"ok": true, "result": {"pid": …}}
    {"op": "mount", "mountpoint": P, "spec": {…}}         -> {"ok": true, "result": null}
    {"op": "check", "mountpoint": P}                      -> {"ok": true, "result": null}
    {"op": "unmount", "mountpoint": P}                    -> {"ok": true, "result": null}
    {"op": "status"}                                      -> {"ok": true, "result": [{…}, …]}
    failure:  {"ok": false, "error": {"kind": "IntegrityError",
                                      "kinds": ["IntegrityError", "ColdstartError"], "message": …}}

Mounting resolves the spec (range reads of the footer and TOC, verified against the manifest's
annotation), adds the layer to the file system (one directory per layer digest, shared by every
mountpoint of that layer) and bind-mounts it onto the mountpoint. Every mount is persisted under
``<root>/fuse-state/``; a (re)started server lazily unmounts what a dead predecessor left and
restores every recorded mount. SIGTERM/SIGINT: stop accepting, unmount, exit 0, keep the records.

One server per root: it holds an exclusive ``flock`` on ``<root>/fuse-server.lock`` for its
lifetime (the kernel drops it when the process dies) and refuses to start, before it touches
any mount or socket, when another holds it or something already answers on its control socket
(:class:`~coldstart.errors.FailedPrecondition`: one line, exit status 5).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import trio

from coldstart.cache.chunks import ChunkCache
from coldstart.config import Config
from coldstart.errors import (
    AlreadyExists,
    ColdstartError,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
)
from coldstart.format.layer import ESTARGZ_TOC_DIGEST, ZSTD_CHUNKED_MANIFEST_CHECKSUM, open_layer
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.fusefs import (
    FuseFS,
    LayerTree,
    build_tree,
    fuse_close,
    fuse_init,
    fuse_main,
    fuse_terminate,
    set_read_ahead,
)
from coldstart.lazyfs.metrics import FuseMetrics
from coldstart.lazyfs.mountstate import MountState
from coldstart.lazyfs.mountsys import bind_mount, is_mountpoint, lazy_unmount
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.spec import LayerSpec
from coldstart.oci.manifest import parse_manifest
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.remote import RegistryBlob
from coldstart.unixsock import socket_answers

__all__ = ["LOCK_FILE", "FuseServer", "error_payload", "parse_metrics_address"]

log = logging.getLogger(__name__)

#: held (flock, exclusive) by the one FUSE server of a root, for its whole life
LOCK_FILE = "fuse-server.lock"
_MAX_LINE = 1 << 20
_TOC_KEYS = (ESTARGZ_TOC_DIGEST, ZSTD_CHUNKED_MANIFEST_CHECKSUM,
             "io.containers.zstd-chunked.manifest-checksum")


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


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The wire form of an error: its kind, the kinds it derives from, its message."""
    kinds = [c.__name__ for c in type(exc).__mro__
             if issubclass(c, ColdstartError)] or ["ColdstartError"]
    return {"kind": kinds[0], "kinds": kinds, "message": str(exc)}


class FuseServer:
    """One FUSE server: ``FuseServer(config).run()`` blocks until SIGTERM/SIGINT.

    The constructor already claims the root (FailedPrecondition when another server has it);
    :meth:`run` releases it when it returns."""

    def __init__(self, config: Config, *, root: str | None = None,
                 socket_path: str | None = None, metrics_address: str | None = None) -> None:
        self.config = config
        self.root = Path(root or config.root)
        self.fuse_dir = self.root / "fuse"
        self.socket_path = socket_path or config.fuse.socket
        self.metrics_address = (config.metrics_address if metrics_address is None
                                else metrics_address)
        if self.metrics_address:
            parse_metrics_address(self.metrics_address)
        # before anything below opens the cache or state: a refused start touches nothing
        self._root_lock: IO[str] | None = self._claim_root()
        self._socket_ino: int | None = None       # our control socket's inode, once bound
        self.state = MountState(self.root / "fuse-state")
        self.metrics = FuseMetrics()
        cache_dir = config.cache.dir or str(self.root / "cache")
        self.cache = ChunkCache(cache_dir, max_bytes=config.cache.max_bytes)
        f = config.fetch
        self.fetcher = ChunkFetcher(self.cache, concurrency=f.concurrency,
                                    max_coalesce_bytes=f.max_coalesce_bytes,
                                    request_timeout=f.request_timeout, telemetry=self.metrics)
        self.fs = FuseFS(entry_timeout=config.fuse.entry_timeout,
                         attr_timeout=config.fuse.attr_timeout,
                         read_threads=max(8, 2 * f.concurrency), on_error=self.metrics.error)
        r = config.registry
        self.client = RegistryClient(
            insecure_hosts=r.insecure_hosts,
            docker_config=Path(r.docker_config) if r.docker_config else None,
            hosts_dir=Path(r.hosts_dir) if r.hosts_dir else None,
            timeout=r.timeout, retries=r.retries)
        self.mounts: dict[str, _Mount] = {}
        self.layers: dict[str, _Layer] = {}        # layer digest -> shared tree
        self._locks: dict[str, trio.Lock] = {}
        self._generation = 0
        self._listener: trio.SocketListener | None = None
        self._stopping = False
        self._restored: trio.Event | None = None

    # -- process lifecycle -----------------------------------------------------------------

    def run(self) -> None:
        """Mount, restore, serve until a signal; then unmount and return."""
        try:
            trio.run(self._main)
        finally:
            self._release_root()

    def _claim_root(self) -> IO[str]:
        """Lock ``<root>/fuse-server.lock``; FailedPrecondition if another server has it or
        already answers on our control socket (checked before any unmount or unlink)."""
        path = self.root / LOCK_FILE
        try:
            self.root.mkdir(parents=True, exist_ok=True)
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
        mounted = False
        try:
            if self.metrics_address:  # first: a bad address must not leave a mount behind
                try:
                    self.metrics.serve(self.metrics_address)
                except OSError as exc:
                    raise FailedPrecondition(f"cannot serve metrics on {self.metrics_address}: "
                                             f"{exc.strerror or exc}") from exc
            records = self.state.load()
            for rec in records:  # binds left by a dead predecessor point at a dead connection
                with contextlib.suppress(ColdstartError, OSError):
                    lazy_unmount(rec.mountpoint)
            for _ in range(8):
                try:
                    if not lazy_unmount(str(self.fuse_dir)):
                        break
                except (ColdstartError, OSError):
                    break
            try:
                self.fuse_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise FailedPrecondition(f"cannot create {self.fuse_dir}: {exc}") from exc
            listener = self._listen()
            fuse_init(self.fs, str(self.fuse_dir))
            mounted = True
            log.info("FUSE server pid %d: %s mounted, control socket %s", os.getpid(),
                     self.fuse_dir, self.socket_path)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._fuse_task)
                nursery.start_soon(self._restore, records)
                nursery.start_soon(self._serve, listener)
                await self._wait_signal()
                self._stopping = True
                self._unlink_socket()
                await self._unmount_all()
                fuse_terminate()
                nursery.cancel_scope.cancel()
        finally:
            self._unlink_socket()
            self.fetcher.close()
            with contextlib.suppress(Exception):
                self.cache.close()
            if mounted:
                with contextlib.suppress(Exception):
                    fuse_close(unmount=True)
            with contextlib.suppress(Exception):
                self.client.close()
        log.info("FUSE server stopped")

    def _unlink_socket(self) -> None:
        """Remove our control socket, never a successor's that replaced the path."""
        if self._socket_ino is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == self._socket_ino:
                os.unlink(self.socket_path)
        self._socket_ino = None

    async def _fuse_task(self) -> None:
        await fuse_main()

    async def _wait_signal(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal %d: shutting down", signum)
                return

    def _listen(self) -> trio.SocketListener:
        path = self.socket_path
        std = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # nothing answers there (checked under the lock): a dead predecessor's socket
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            std.bind(path)
            self._socket_ino = os.stat(path).st_ino
            os.chmod(path, 0o600)
            std.listen(64)
        except OSError as exc:
            std.close()
            raise FailedPrecondition(f"cannot listen on the control socket {path}: "
                                     f"{exc}") from exc
        sock = trio.socket.from_stdlib_socket(std)
        return trio.SocketListener(sock)

    async def _serve(self, listener: trio.SocketListener) -> None:
        await trio.serve_listeners(self._handle, [listener])

    async def _unmount_all(self) -> None:
        for mp in list(self.mounts):
            try:
                await trio.to_thread.run_sync(lazy_unmount, mp)
            except (ColdstartError, OSError) as exc:
                log.error("unmount %s: %s", mp, exc)

    # -- restore ---------------------------------------------------------------------------

    async def _restore(self, records: list[Any]) -> None:
        try:
            # The kernel caps read-ahead at what FUSE_INIT negotiated (128 KiB); once INIT is
            # done (a stat of the mount waits for it), the bdi setting may be raised.
            await trio.to_thread.run_sync(os.stat, self.fuse_dir)
            if not set_read_ahead(str(self.fuse_dir), self.config.fuse.read_ahead_kb):
                log.warning("read_ahead_kb of %s not set", self.fuse_dir)
            await self._restore_all(records)
        finally:
            if self._restored is not None:
                self._restored.set()

    async def _restore_all(self, records: list[Any]) -> None:
        for rec in records:
            if not await trio.to_thread.run_sync(os.path.isdir, rec.mountpoint):
                # the snapshot was removed while we were down: nothing to restore
                log.warning("restore %s: the mountpoint is gone; record dropped", rec.mountpoint)
                await trio.to_thread.run_sync(self.state.remove, rec.mountpoint)
                continue
            try:
                await self.mount(rec.mountpoint, rec.spec, restoring=True)
                log.info("restored %s (%s)", rec.mountpoint, rec.spec.digest)
            except ColdstartError as exc:
                # keep the record: the next start (or a mount call) tries again
                log.error("restore %s (%s) failed: %s: %s", rec.mountpoint, rec.spec.digest,
                          type(exc).__name__, exc)

    # -- control protocol ------------------------------------------------------------------

    async def _handle(self, stream: trio.SocketStream) -> None:
        buf = b""
        try:
            async with stream:
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                    if len(buf) > _MAX_LINE and b"\n" not in buf:
                        await stream.send_all(self._reply_error(
                            InvalidArgument("request line too long")))
                        return
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        if line.strip():
                            await stream.send_all(await self._dispatch(line))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    def _reply_error(self, exc: BaseException) -> bytes:
        return json.dumps({"ok": False, "error": error_payload(exc)}).encode() + b"\n"

    async def _dispatch(self, line: bytes) -> bytes:
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise InvalidArgument("request must be a JSON object")
            op = req.get("op")
            result: Any = None
            if op != "ping" and self._restored is not None:
                await self._restored.wait()  # answer from the restored mount table
            if op == "ping":
                result = {"pid": os.getpid(), "fuse_dir": str(self.fuse_dir)}
            elif op == "mount":
                spec = LayerSpec.from_json(json.dumps(req.get("spec")))
                await self.mount(_mountpoint(req), spec)
            elif op == "unmount":
                await self.unmount(_mountpoint(req))
            elif op == "check":
                await self.check(_mountpoint(req))
            elif op == "status":
                result = self.status()
            else:
                raise InvalidArgument(f"unknown op {op!r}")
        except ColdstartError as exc:
            return self._reply_error(exc)
        except ValueError as exc:
            return self._reply_error(InvalidArgument(f"bad request: {exc}"))
        except Exception as exc:
            log.exception("control request failed")
            return self._reply_error(ColdstartError(f"internal error: {exc}"))
        return json.dumps({"ok": True, "result": result}).encode() + b"\n"

    # -- operations ------------------------------------------------------------------------

    def _lock(self, mountpoint: str) -> trio.Lock:
        lock = self._locks.get(mountpoint)
        if lock is None:
            lock = self._locks[mountpoint] = trio.Lock()
        return lock

    async def mount(self, mountpoint: str, spec: LayerSpec, *, restoring: bool = False) -> None:
        """Serve ``spec``'s layer at ``mountpoint`` (idempotent for the same layer)."""
        if self._stopping:
            raise FailedPrecondition("the FUSE server is shutting down")
        async with self._lock(mountpoint):
            cur = self.mounts.get(mountpoint)
            if cur is not None:
                if cur.spec.digest == spec.digest:
                    return
                raise AlreadyExists(f"{mountpoint} already serves layer {cur.spec.digest}")
            layer = self.layers.get(spec.digest)
            created = False
            if layer is not None:
                # the layer is served already: this spec must vouch for the same TOC
                annotations = await trio.to_thread.run_sync(self._annotations, spec)
                _check_same_toc(annotations, layer.tree.reader.layer.toc_digest,
                                self.config.allow_unverified, spec.digest)
            else:
                reader = await trio.to_thread.run_sync(self._open_reader, spec)
                self._generation += 1
                key = f"{spec.digest.rpartition(':')[2][:16]}-{self._generation}"
                base = self.fs.allocate(len(reader.layer.toc.entries) + 1)
                tree = await trio.to_thread.run_sync(build_tree, key, base, reader)
                layer = _Layer(key, tree)
                self.layers[spec.digest] = layer
                self.fs.add(tree)
                created = True
            try:
                if await trio.to_thread.run_sync(is_mountpoint, mountpoint):
                    # not ours (we checked): a dead bind left by a crashed predecessor
                    log.warning("%s: lazily unmounting a stale mount first", mountpoint)
                    await trio.to_thread.run_sync(lazy_unmount, mountpoint)
                await trio.to_thread.run_sync(bind_mount, str(self.fuse_dir / layer.key),
                                              mountpoint)
            except BaseException:
                if created and not layer.mountpoints:
                    self._drop_layer(spec.digest)
                raise
            layer.mountpoints.add(mountpoint)
            self.mounts[mountpoint] = _Mount(mountpoint, spec, layer)
            await trio.to_thread.run_sync(self.state.save, mountpoint, spec)
            reader = layer.tree.reader
            if created and (reader.layer.toc.prefetch or reader.background_rate > 0):
                threading.Thread(target=reader.prefetch_then_rest, daemon=True,
                                 name=f"prefetch-{layer.key}").start()
            log.info("mounted layer %s (%s) at %s%s", spec.digest, spec.reference, mountpoint,
                     " (restored)" if restoring else "")

    def _drop_layer(self, digest: str) -> None:
        layer = self.layers.pop(digest, None)
        if layer is not None:
            self.fs.remove(layer.key)

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
                self._drop_layer(cur.spec.digest)
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
                        **tree.reader.stats.as_dict()})
        return out

    def _annotations(self, spec: LayerSpec) -> dict[str, str]:
        """The layer's annotations: the spec's, or its manifest's (fetched, verified)."""
        ref = Reference.parse(spec.reference)
        annotations = dict(spec.annotations)
        if not any(k in annotations for k in _TOC_KEYS) and spec.manifest_digest:
            body, media, _ = self.client.get_manifest(ref.with_digest(spec.manifest_digest))
            manifest = parse_manifest(body, media or None)
            for desc in manifest.layers:
                if desc.digest == spec.digest:
                    annotations = {**desc.annotations, **annotations}
                    break
            else:
                raise NotFound(f"manifest {spec.manifest_digest} has no layer {spec.digest}")
        return annotations

    def _open_reader(self, spec: LayerSpec) -> LayerReader:
        """Resolve a spec: blob source, annotations (from the manifest if needed), TOC."""
        ref = Reference.parse(spec.reference)
        annotations = self._annotations(spec)
        timeout = self.config.fetch.request_timeout
        source = RegistryBlob(self.client, ref, spec.digest, spec.size if spec.size >= 0 else None,
                              timeout=timeout)
        layer = open_layer(source, annotations=annotations,
                           allow_unverified=self.config.allow_unverified)
        return LayerReader(spec.digest, layer, source, self.fetcher,
                           read_deadline=self.config.fetch.read_deadline,
                           background_rate=self.config.fetch.background_rate)


def _check_same_toc(annotations: dict[str, str], toc_digest: str, allow_unverified: bool,
                    digest: str) -> None:
    claimed = [annotations[k] for k in _TOC_KEYS if k in annotations]
    if not claimed:
        if allow_unverified:
            return
        raise FailedPrecondition(f"layer {digest}: no TOC digest annotation: cannot verify it")
    if any(c != toc_digest for c in claimed):
        raise IntegrityError(f"layer {digest}: annotated TOC digest {claimed[0]} does not "
                             f"match the served layer's TOC {toc_digest}")


def _mountpoint(req: dict[str, Any]) -> str:
    mp = req.get("mountpoint")
    if not isinstance(mp, str) or not os.path.isabs(mp):
        raise InvalidArgument(f"mountpoint must be an absolute path, not {mp!r}")
    return os.path.normpath(mp)

