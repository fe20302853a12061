"""containerd's snapshotter semantics on our store, in containerd's overlayfs layout.

Layout: ``<root>/snapshots/<id>/fs`` (the snapshot's files; for a lazily pulled layer, the FUSE
mountpoint) and ``<root>/snapshots/<id>/work`` (overlay's workdir, ACTIVE only). As containerd's
overlay snapshotter does, a new snapshot's directory is built in a ``new-*`` temp dir and renamed
into place inside the transaction; directories are removed only after the transaction that
forgot them committed (CONVENTIONS §6).

Remote snapshots (the handshake that skips the download): when a Prepare's labels name a layer
(:func:`~coldstart.lazyfs.spec.layer_spec_from_labels`) and carry
``containerd.io/snapshot.ref``, the layer is mounted by the :class:`LayerMounter` on the new
snapshot's ``fs``, committed under the ref's value and the Prepare answers
:class:`~coldstart.errors.AlreadyExists`. Any mounter failure falls back to a plain ACTIVE
snapshot (containerd then downloads and unpacks the layer).

No silent fallback: a layer offered for lazy pulling but not mounted says why, where an operator
looks: one WARNING log line (layer, image, reason), the ``on_remote`` hook (a metric by reason),
and the labels ``coldstart.io/lazy=false``, ``coldstart.io/reason=<reason>`` (plus the layer and
image) on the ACTIVE snapshot, which :meth:`Snapshotter.commit` carries over to the committed
one (``ctr snapshots info`` shows them; ``coldstart snapshotter status`` lists them). The reasons
are :data:`FALLBACK_REASONS`, from :func:`fallback_reason`.

Example::

    snap = Snapshotter("/var/lib/coldstart", Store(".../metadata.db"), mounter=None)
    mounts = snap.prepare("k", "", {})
    snap.commit("layer-1", "k", {})
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from coldstart.errors import (
    AlreadyExists,
    ColdstartError,
    FailedPrecondition,
    FormatError,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.lazyfs.client import FuseServerUnreachable
from coldstart.lazyfs.mountsys import is_mountpoint
from coldstart.lazyfs.spec import (
    BAD_INDEX,
    CRI_IMAGE_REF,
    CRI_LAYER_DIGEST,
    LABEL_LIMIT,
    NO_INDEX,
    PULLED_LABEL,
    REASON_LABEL,
    REMOTE_DIGEST,
    REMOTE_REFERENCE,
    REMOTE_SNAPSHOT,
    REMOTE_SNAPSHOT_VALUE,
    TARGET_SNAPSHOT_REF,
    UNTRUSTED,
    LayerSpec,
    layer_spec_from_labels,
)
from coldstart.snapshotter.filters import parse_all
from coldstart.snapshotter.mounter import LayerMounter
from coldstart.snapshotter.mounts import (
    Mount,
    index_supported,
    mounts_for,
    upper_path,
)
from coldstart.snapshotter.store import Info, Kind, Snapshot, Store, Tx, Usage
from coldstart.snapshotter.xattrpaths import attribute_lowers

__all__ = [
    "FALLBACK_REASONS",
    "IMAGE_LABEL",
    "LAYER_LABEL",
    "LAZY_LABEL",
    "OUR_LABEL_PREFIX",
    "PULLED_LABEL",
    "REASON_LABEL",
    "Snapshotter",
    "disk_usage",
    "fallback_reason",
]

log = logging.getLogger("coldstart.snapshotter")

# labels we set on a snapshot whose layer was offered for lazy pulling but pulled normally;
# Commit carries every ``coldstart.io/`` label of the active snapshot over to the committed one
OUR_LABEL_PREFIX = "coldstart.io/"
LAZY_LABEL = OUR_LABEL_PREFIX + "lazy"          # "false"
# REASON_LABEL (coldstart.io/reason): one of FALLBACK_REASONS; PULLED_LABEL
# (coldstart.io/pulled): "full" when the layer was pulled in full here (lazyfs.spec holds both)
LAYER_LABEL = OUR_LABEL_PREFIX + "layer"        # the layer (blob) digest
IMAGE_LABEL = OUR_LABEL_PREFIX + "image"        # the image reference, as the labels named it

# why a layer offered for lazy pulling was pulled normally (metric label values, snapshot labels)
FALLBACK_REASONS = (
    "not-seekable",    # the blob is no eStargz/zstd:chunked layer (no footer, corrupt TOC)
    "no-toc-digest",   # no TOC digest annotation (a layer that lost it) and allow_unverified
                       # is off
    "no-index",        # a plain gzip layer without a TOC, and no gzip index for its image
    "index-untrusted", # a gzip index exists, but index.trust does not trust it
    "index-failed",    # the layer's gzip index proved wrong once: never used again
    "integrity",       # the TOC does not match its annotated digest
    "unavailable",     # the registry or the FUSE server failed or timed out
    "not-found",       # the registry has no such blob or manifest
    "no-fuse-server",  # no FUSE server: none configured, or it cannot be reached
    "bad-labels",      # the lazy-pull labels are malformed
    "commit-failed",   # mounted, but recording the committed snapshot failed
    "full-pull-forced",  # pull.mode is full: no layer is mounted lazily
    "other",
)


def fallback_reason(exc: BaseException) -> str:
    """The :data:`FALLBACK_REASONS` word for a failure of the mount path.

    The mounter forwards the kind the FUSE server raised (see :mod:`coldstart.lazyfs.client`):
    ``open_layer`` raises FailedPrecondition for a layer without a TOC digest annotation,
    FormatError for a blob without footer, IntegrityError for a TOC that does not match.

    >>> fallback_reason(IntegrityError("TOC digest sha256:1 does not match"))
    'integrity'
    """
    if isinstance(exc, FuseServerUnreachable):
        return "no-fuse-server"
    if isinstance(exc, IntegrityError):
        return "integrity"
    if isinstance(exc, Unavailable):            # DeadlineExceeded too
        return "unavailable"
    if isinstance(exc, FailedPrecondition) and BAD_INDEX in str(exc):
        return "index-failed"
    if isinstance(exc, FailedPrecondition) and UNTRUSTED in str(exc):
        return "index-untrusted"
    if isinstance(exc, FailedPrecondition) and NO_INDEX in str(exc):
        return "no-index"
    if isinstance(exc, FailedPrecondition) and "TOC digest annotation" in str(exc):
        return "no-toc-digest"
    if isinstance(exc, FormatError):
        return "not-seekable"
    if isinstance(exc, NotFound):
        return "not-found"
    if isinstance(exc, InvalidArgument):
        return "bad-labels"
    return "other"


def _chain_of(name: str) -> str:
    """The chain ID a snapshot name ends with (containerd's metadata store names the backend's
    snapshots ``<namespace>/<n>/<chain ID>``), or "" when it does not end with one."""
    last = name.rpartition("/")[2]
    kind, _, hexpart = last.partition(":")
    ok = kind == "sha256" and len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)
    return last if ok else ""


def _fit(key: str, value: str) -> str:
    """``value`` cut so that the label fits containerd's limit (see store.validate_labels)."""
    room = LABEL_LIMIT - len(key.encode())
    return value.encode()[:room].decode(errors="ignore")


def disk_usage(path: str) -> Usage:
    """containerd's (continuity's) ``DiskUsage``: 512-byte blocks of unique inodes, root too."""
    seen: set[tuple[int, int]] = set()
    size = 0
    stack = [path]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen.add(key)
            size += st.st_blocks * 512
        if os.path.isdir(p) and not os.path.islink(p):
            try:
                stack.extend(e.path for e in os.scandir(p))
            except FileNotFoundError:
                continue
    return Usage(size=size, inodes=len(seen))


class Snapshotter:
    """containerd's snapshotter contract over :class:`Store` and ``<root>/snapshots``."""

    def __init__(self, root: str | Path, store: Store, mounter: LayerMounter | None = None,
                 *, index_off: bool | None = None,
                 on_remote: Callable[[str, str], None] | None = None,
                 pull_mode: str = "lazy", full_pull_timeout: float = 1800.0) -> None:
        self.root = str(Path(root).resolve())
        self.store = store
        self.mounter = mounter
        self.index_off = index_supported() if index_off is None else index_off
        # telemetry hook (stargz style), per lazily offered layer: ("mounted", "") or
        # ("fallback", one of FALLBACK_REASONS)
        self._on_remote = on_remote or (lambda _result, _reason: None)
        self.snapshots_dir = os.path.join(self.root, "snapshots")
        os.makedirs(self.snapshots_dir, exist_ok=True)
        #: pull.mode: "auto" (lazily, else pulled in full by the FUSE server), "lazy" (else
        #: containerd pulls), "full" (never lazily)
        self.pull_mode = pull_mode
        self.full_pull_timeout = full_pull_timeout

    # --- containerd's calls -------------------------------------------------------------

    def prepare(self, key: str, parent: str, labels: Mapping[str, str]) -> list[Mount]:
        """An ACTIVE snapshot; or, for a layer served lazily, AlreadyExists (see module doc)."""
        target = labels.get(TARGET_SNAPSHOT_REF, "")
        spec: LayerSpec | None = None
        bad_labels: ColdstartError | None = None
        if target:
            try:
                spec = layer_spec_from_labels(labels)
            except ColdstartError as exc:
                bad_labels = exc
        if spec is not None and self._target_exists(target, parent):
            raise AlreadyExists(f"target snapshot {target!r}: already exists")
        mounts = self._create(Kind.ACTIVE, key, parent, labels)
        if bad_labels is not None:
            self._fall_back(key, labels, None, "bad-labels", f"lazy-pull labels: {bad_labels}")
        elif spec is not None and self.mounter is None:
            self._fall_back(key, labels, spec, "no-fuse-server", "no layer mounter configured")
        elif spec is not None:
            if self.pull_mode == "full":
                self._fall_back(key, labels, spec, "full-pull-forced",
                                "pull.mode is full: every layer is pulled in full")
            elif self._mount_remote(key, parent, target, labels, spec):
                raise AlreadyExists(f"target snapshot {target!r}: already exists")
            if self.pull_mode != "lazy" and self._pull_full(key, parent, target, labels, spec):
                raise AlreadyExists(f"target snapshot {target!r}: already exists")
        return mounts

    def view(self, key: str, parent: str, labels: Mapping[str, str]) -> list[Mount]:
        return self._create(Kind.VIEW, key, parent, labels)

    def mounts(self, key: str) -> list[Mount]:
        with self.store.transaction() as tx:
            snap = tx.get_snapshot(key)
        return self._mounts_for(snap)

    def commit(self, name: str, key: str, labels: Mapping[str, str]) -> None:
        with self.store.transaction(writable=True) as tx:
            sid, info, _ = tx.get_info(key)
            usage = disk_usage(upper_path(self.root, sid)) if info.kind == Kind.ACTIVE \
                else Usage()
            # containerd commits with its own labels, which replace the active's: keep ours
            # (why a layer was not mounted lazily) unless the caller sets them itself
            ours = {k: v for k, v in info.labels.items() if k.startswith(OUR_LABEL_PREFIX)}
            tx.commit_active(key, name, usage, {**ours, **labels})

    def remove(self, key: str) -> None:
        with self.store.transaction(writable=True) as tx:
            tx.remove(key)
            removals = self._cleanup_dirs(tx)
        for d in removals:
            self._remove_dir(d)

    def stat(self, key: str) -> Info:
        with self.store.transaction() as tx:
            return tx.get_info(key)[1]

    def update(self, name: str, labels: Mapping[str, str], fieldpaths: Sequence[str]) -> Info:
        with self.store.transaction(writable=True) as tx:
            return tx.update_info(name, labels, list(fieldpaths))

    def walk(self, filters: Sequence[str] = ()) -> list[Info]:
        match = parse_all(filters)
        with self.store.transaction() as tx:
            return tx.walk(match)

    def usage(self, key: str) -> Usage:
        with self.store.transaction() as tx:
            sid, info, usage = tx.get_info(key)
        if info.kind == Kind.ACTIVE:
            usage = disk_usage(upper_path(self.root, sid))
        return usage

    def cleanup(self) -> None:
        with self.store.transaction(writable=True) as tx:
            removals = self._cleanup_dirs(tx)
        for d in removals:
            self._remove_dir(d)

    # --- directories ----------------------------------------------------------------------

    def _create(self, kind: Kind, key: str, parent: str,
                labels: Mapping[str, str]) -> list[Mount]:
        with self.store.transaction(writable=True) as tx:
            td: str | None = tempfile.mkdtemp(prefix="new-", dir=self.snapshots_dir)
            path: str | None = None
            try:
                assert td is not None
                os.mkdir(os.path.join(td, "fs"), 0o755)
                if kind == Kind.ACTIVE:
                    os.mkdir(os.path.join(td, "work"), 0o711)
                snap = tx.create(kind, key, parent, labels)
                if snap.parent_ids:
                    st = os.stat(upper_path(self.root, snap.parent_ids[0]))
                    os.lchown(os.path.join(td, "fs"), st.st_uid, st.st_gid)
                path = os.path.join(self.snapshots_dir, snap.id)
                os.rename(td, path)
                td = None
            except BaseException:
                for d in (td, path):
                    if d is not None:
                        shutil.rmtree(d, ignore_errors=True)
                raise
        return self._mounts_for(snap)

    def _mounts_for(self, snap: Snapshot) -> list[Mount]:
        # a view or an active snapshot mounted before reads lazily mounted parents through
        # the FUSE connection that answers getxattr (containerd's diff needs ENODATA)
        return mounts_for(snap, self.root, index_off=self.index_off,
                          lowers=attribute_lowers(self.root, snap))

    def _cleanup_dirs(self, tx: Tx) -> list[str]:
        ids = tx.id_map()
        return [os.path.join(self.snapshots_dir, d) for d in sorted(os.listdir(self.snapshots_dir))
                if d not in ids]

    def _remove_dir(self, d: str) -> None:
        fs = os.path.join(d, "fs")
        if is_mountpoint(fs):
            try:
                if self.mounter is None:
                    raise ColdstartError("no layer mounter configured")
                self.mounter.unmount(fs)
            except Exception as exc:
                log.warning("unmount %s through the FUSE server failed: %s", fs, exc)
            if is_mountpoint(fs):
                # the FUSE server is gone or refused: detach it ourselves, never rmtree through
                subprocess.run(["umount", "-l", fs], capture_output=True, timeout=30, check=False)
            if is_mountpoint(fs):
                log.error("%s is still mounted; leaving %s for a later Cleanup", fs, d)
                return
        try:
            shutil.rmtree(d)
        except OSError as exc:
            log.warning("failed to remove directory %s: %s", d, exc)

    # --- remote snapshots ---------------------------------------------------------------

    def _fall_back(self, key: str, labels: Mapping[str, str], spec: LayerSpec | None,
                   reason: str, detail: str, exc: BaseException | None = None) -> None:
        """Say why the layer of ACTIVE ``key`` is pulled normally: log, hook, labels."""
        digest = spec.digest if spec is not None else \
            labels.get(REMOTE_DIGEST) or labels.get(CRI_LAYER_DIGEST) or "?"
        image = labels.get(REMOTE_REFERENCE) or labels.get(CRI_IMAGE_REF) or \
            (spec.reference if spec is not None else "") or "?"
        then = "containerd pulls it" if self.pull_mode == "lazy" or self.mounter is None \
            else "coldstart pulls it in full"
        log.warning("layer %s of %s not mounted lazily (reason %s), %s: %s",
                    digest, image, reason, then, detail, exc_info=exc)
        self._on_remote("fallback", reason)
        ours = {LAZY_LABEL: "false", REASON_LABEL: reason, LAYER_LABEL: digest,
                IMAGE_LABEL: image}
        ours = {k: _fit(k, v) for k, v in ours.items()}
        try:
            with self.store.transaction(writable=True) as tx:
                tx.update_info(key, ours, [f"labels.{k}" for k in ours])
        except ColdstartError as exc2:
            log.warning("snapshot %s: cannot label the fallback: %s", key, exc2)

    def _pull_full(self, key: str, parent: str, target: str, labels: Mapping[str, str],
                   spec: LayerSpec) -> bool:
        """Have the FUSE server pull the layer of ACTIVE ``key`` in full into its directory
        (parallel range requests unpacked as they arrive, containerd's applier, checked
        against the chain ID ``target`` names) and commit it as ``target``; False: ``key``
        stays a plain ACTIVE snapshot (empty again) and containerd pulls the layer."""
        unpack = getattr(self.mounter, "unpack", None)
        if unpack is None:
            return False
        with self.store.transaction() as tx:
            snap = tx.get_snapshot(key)
            _, info, _ = tx.get_info(key)
        fs = upper_path(self.root, snap.id)
        lowers = [upper_path(self.root, pid) for pid in snap.parent_ids]
        chain = _chain_of(target)
        parent_chain = _chain_of(parent) if parent else ""
        if parent and not parent_chain:
            chain = ""            # nothing to check the diffID against: the blob digest is
        # the FUSE server writes into a staging directory of its own, renamed into place only
        # once it answered: a pull we stop waiting for never writes where containerd unpacks
        staging = tempfile.mkdtemp(prefix="full-", dir=os.path.dirname(fs))
        st = os.stat(fs)                # as _create made it: mode, and the parent's owner
        os.chmod(staging, stat.S_IMODE(st.st_mode))
        os.lchown(staging, st.st_uid, st.st_gid)
        t0 = time.monotonic()
        try:
            done = unpack(staging, spec, lowers=lowers, parent_chain=parent_chain,
                          chain=chain, timeout=self.full_pull_timeout)
            os.rmdir(fs)
            os.rename(staging, fs)
        except Exception as exc:
            log.warning("layer %s: the full pull failed, containerd pulls it: %s", spec.digest,
                        exc, exc_info=None if isinstance(exc, (ColdstartError, OSError))
                        else exc)
            self._on_remote("full-pull-failed", fallback_reason(exc))
            shutil.rmtree(staging, ignore_errors=True)
            if not os.path.isdir(fs):
                os.mkdir(fs, 0o755)
            return False
        ours = {k: v for k, v in info.labels.items() if k.startswith(OUR_LABEL_PREFIX)}
        committed = {**labels, **ours, PULLED_LABEL: "full"}
        try:
            with self.store.transaction(writable=True) as tx:
                tx.commit_active(key, target, disk_usage(fs), committed)
        except ColdstartError as exc:
            if isinstance(exc, AlreadyExists) and self._target_exists(target, parent):
                self.remove(key)
                return True
            log.warning("layer %s: pulled in full, but its commit as %s failed: %s",
                        spec.digest, target, exc)
            self._empty(fs)
            return False
        log.info("layer %s pulled in full as snapshot %s in %.2f s (%s bytes fetched)",
                 spec.digest, target, time.monotonic() - t0,
                 done.get("fetched_bytes", "?") if isinstance(done, dict) else "?")
        self._on_remote("pulled-full", "")
        return True

    def _empty(self, fs: str) -> None:
        """Make ``fs`` an empty directory again (a full pull that could not be committed);
        raises (the Prepare fails) rather than leave containerd a non-empty one."""
        shutil.rmtree(fs)
        os.mkdir(fs, 0o755)

    def _target_exists(self, target: str, parent: str) -> bool:
        with self.store.transaction() as tx:
            try:
                _, info, _ = tx.get_info(target)
            except ColdstartError:
                return False
        # same name on another parent chain: containerd would not adopt it, so pull normally
        return info.kind == Kind.COMMITTED and info.parent == parent

    def _mount_remote(self, key: str, parent: str, target: str, labels: Mapping[str, str],
                      spec: LayerSpec) -> bool:
        """Mount and commit as ``target``; False: ``key`` stays a plain ACTIVE snapshot."""
        assert self.mounter is not None
        with self.store.transaction() as tx:
            sid = tx.get_info(key)[0]
        fs = upper_path(self.root, sid)
        try:
            self.mounter.mount(fs, spec)
        except Exception as exc:
            expected = isinstance(exc, ColdstartError)
            self._fall_back(key, labels, spec, fallback_reason(exc),
                            f"lazy mount failed: {exc}" if expected
                            else f"lazy mount failed: {type(exc).__name__}: {exc}",
                            None if expected else exc)
            return False
        committed = {**labels, REMOTE_SNAPSHOT: REMOTE_SNAPSHOT_VALUE}
        try:
            with self.store.transaction(writable=True) as tx:
                tx.commit_active(key, target, Usage(), committed, remote=True)
        except ColdstartError as exc:
            with contextlib.suppress(Exception):
                self.mounter.unmount(fs)
            if isinstance(exc, AlreadyExists) and self._target_exists(target, parent):
                # another namespace committed the same layer meanwhile: containerd adopts it
                self.remove(key)
                log.info("layer %s: %s was committed concurrently", spec.digest, target)
                return True
            self._fall_back(key, labels, spec, "commit-failed",
                            f"mounted, but its commit as {target} failed: {exc}")
            return False
        log.info("layer %s mounted lazily as snapshot %s", spec.digest, target)
        self._on_remote("mounted", "")
        return True
