"""One typed configuration tree (CONVENTIONS §9).

Every key is written once, here, with its default and, in the comment above it, its meaning.
``load(path)`` reads TOML; unknown keys and wrong types are an
:class:`~coldstart.errors.InvalidArgument` naming the key. Durations are float seconds; sizes
(keys ending in ``_bytes``, and ``fetch.background_rate`` in bytes/second) are integer bytes or a
string with a binary suffix (``"20G"``, ``"512MiB"``, ``"4k"``). ``dump(config)`` writes the
whole tree back as TOML with each key's comment (``coldstart snapshotter --print-config``). CLI
flags override with :func:`dataclasses.replace`.

Example::

    cfg = load("/etc/coldstart/config.toml")
    cfg = dataclasses.replace(cfg, root="/tmp/cs")
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from coldstart.errors import InvalidArgument

__all__ = [
    "CACHE_VERIFY_MODES",
    "LOG_FORMATS",
    "CacheConfig",
    "Config",
    "FetchConfig",
    "FuseConfig",
    "IndexConfig",
    "ProbeTimingConfig",
    "PullConfig",
    "RegistryConfig",
    "SnapshotConfig",
    "SourceConfig",
    "WeightsConfig",
    "dump",
    "from_dict",
    "load",
    "parse_size",
]

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


# Numbers in the tree must be positive, except these, which may also be 0.
_MAY_BE_ZERO = frozenset({"retries", "background_rate", "neighbor_bytes", "shutdown_grace",
                          "drain_delay",
                          "grace", "progress_every", "sink_retries"})
_LOG_LEVELS = ("debug", "info", "warning", "error")
#: values of ``log_format``
LOG_FORMATS = ("text", "json")
#: values of ``snapshot.pages``
SNAPSHOT_PAGES = ("eager", "lazy")


def _one_of(where: str, value: str, choices: tuple[str, ...]) -> None:
    """InvalidArgument unless ``value`` is one of ``choices`` (key ``where``)."""
    if value not in choices:
        raise InvalidArgument(f"config: {where} must be one of {', '.join(choices)}, "
                              f"not {value!r}")


class _Checked:
    """Range checks of every numeric key, run however the config is built."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if v < 0 or (v == 0 and f.name not in _MAY_BE_ZERO):
                want = ">= 0" if f.name in _MAY_BE_ZERO else "> 0"
                raise InvalidArgument(f"config: {f.name} must be {want}, not {v}")


@dataclass(frozen=True)
class RegistryConfig(_Checked):
    # hosts reached over plain HTTP (loopback is always allowed)
    insecure_hosts: tuple[str, ...] = ()
    # containerd-style mirrors and TLS: <hosts_dir>/<host>/hosts.toml
    hosts_dir: str = "/etc/containerd/certs.d"
    # docker-style credentials; "" means $DOCKER_CONFIG/config.json or ~/.docker/config.json
    docker_config: str = ""
    # deadline of one registry request, seconds
    timeout: float = 30.0
    # attempts after the first on 5xx / connection errors (exponential backoff with jitter)
    retries: int = 3
    # directory (root-only) where the CRI proxy keeps the registry credentials kubelet passes in
    # PullImage, by image repository; the FUSE server looks there before docker_config and
    # re-reads it on every lookup, so rotated credentials apply on the next PullImage;
    # "" means <root>/cri-credentials
    cri_keychain: str = ""


@dataclass(frozen=True)
class FetchConfig(_Checked):
    # deadline of one range request, seconds
    request_timeout: float = 10.0
    # a FUSE read not served within this many seconds returns EIO (never a hang)
    read_deadline: float = 30.0
    # adjacent missing chunks are fetched in one range request up to this many bytes
    max_coalesce_bytes: int = 16 * MiB
    # concurrent range requests per FUSE server
    concurrency: int = 8
    # the hybrid fill: after the prefetch, the rest of every layer is fetched in the
    # background (niced, yielding to on-demand reads), capped at this many bytes/second;
    # the default is above any link (the fill runs at the link's rate); 0 = off
    background_rate: int = 100 * GiB
    # a small file's miss also fetches the small files stored after it, this many compressed
    # bytes at first (0 = off); the window then adapts to the reads, doubling while the
    # neighbours it brought are read and halving when they are not, up to neighbor_max_bytes
    neighbor_bytes: int = 256 * KiB
    neighbor_max_bytes: int = 4 * MiB


#: values of ``cache.verify``
CACHE_VERIFY_MODES = ("first-read", "always", "never")


@dataclass(frozen=True)
class CacheConfig(_Checked):
    # node-wide chunk cache directory; "" means <root>/cache
    dir: str = ""
    # size limit; least-recently-used chunks are evicted beyond it
    max_bytes: int = 20 * GiB
    # when a big chunk's file is re-hashed before it is served (a mismatch: dropped, fetched
    # again). "first-read": files this process did not write (found at start, or stored by
    # another process), once each per process lifetime; "always": every read, also pack
    # records; "never": trust the disk. Chunks this process writes are verified before they
    # are cached, and pack records whenever a pack is scanned, in every mode.
    verify: str = "first-read"

    def __post_init__(self) -> None:
        super().__post_init__()
        _one_of("cache.verify", self.verify, CACHE_VERIFY_MODES)


#: values of ``pull.mode``
PULL_MODES = ("auto", "lazy", "full")


@dataclass(frozen=True)
class PullConfig(_Checked):
    # per layer: "auto": lazily when it has a TOC or a trusted gzip index, else pulled in full
    # by coldstart (parallel range requests, unpacked as they arrive); "lazy": never pulled in
    # full by coldstart (a layer it cannot mount lazily is pulled by containerd, one stream);
    # "full": never lazily (every layer pulled in full by coldstart)
    mode: str = "auto"
    # a full pull: range requests in flight, and the bytes of each
    jobs: int = 4
    part_bytes: int = 16 * MiB
    # deadline of one layer's full pull, seconds (fetch, inflate and unpack)
    timeout: float = 1800.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _one_of("pull.mode", self.mode, PULL_MODES)


#: values of ``index.trust``
INDEX_TRUST_MODES = ("pinned", "repository", "off")


@dataclass(frozen=True)
class IndexConfig(_Checked):
    # which gzip indexes (`coldstart index IMAGE --push`) mount plain gzip layers lazily:
    # "pinned": only an index whose artifact digest is in `trusted` or in `trusted_file`;
    # "repository": any index pushed to the image's repository (whoever may push there then
    # decides what the layer's files are); "off": plain gzip layers are always pulled in full
    trust: str = "pinned"
    # artifact digests of trusted indexes (what `coldstart index --push` prints)
    trusted: tuple[str, ...] = ()
    # more trusted digests, one per line (# comments), read on every lookup; "" means
    # <root>/trusted-indexes
    trusted_file: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _one_of("index.trust", self.trust, INDEX_TRUST_MODES)


@dataclass(frozen=True)
class FuseConfig(_Checked):
    # hand each prefetched (start-up) chunk to the kernel's page cache as soon as it is
    # verified: the start-up then reads those files without a FUSE request
    page_cache: bool = True
    # control socket of the FUSE server process (outlives the gRPC process)
    socket: str = "/run/coldstart/fuse.sock"
    # the files socket: loaders inside containers (coldstart.weights) read lazily mounted files
    # through it in parallel, verified and cached, instead of page by page; mount its directory
    # into the container. "auto": files/files.sock beside `socket`; "": off
    files_socket: str = "auto"
    # kernel entry / attribute cache timeouts, seconds (layers are immutable)
    entry_timeout: float = 86400.0
    attr_timeout: float = 86400.0
    # read-ahead set on each FUSE mount's backing device, KiB
    read_ahead_kb: int = 1024
    # serve the layers that show no extended attribute (none in the TOC, no opaque directory,
    # no *.safetensors file: the weights loader's token is one) on a second FUSE connection
    # that answers no getxattr: overlayfs then stops asking each lower file for
    # trusted.overlay.* (a round trip each, a third of a PyTorch start-up's requests). Inside
    # a container started on them, a getxattr of their files fails with EOPNOTSUPP (ENODATA on
    # a local disk; listing still answers an empty list); views and the mounts of a container
    # already running or changed (containerd's diff, commit, checkpoint --rw) read them through
    # the first connection and get ENODATA. false: every new layer on the first connection
    split_xattrs: bool = True
    # host:port for the FUSE server's Prometheus metrics (fetches, cache, page cache, errors
    # per layer); "" disables; must differ from the top-level metrics_address
    metrics_address: str = ""
    # the snapshotter starts `coldstart fuse-server` (detached) when nothing answers on `socket`
    spawn: bool = True
    # seconds the snapshotter waits for a spawned FUSE server to answer on `socket`
    start_timeout: float = 30.0
    # deadline of one control request to the FUSE server (a mount fetches and verifies the TOC)
    request_timeout: float = 60.0
    # record every layer's file accesses from its mount on (a start-up profile, read back by
    # `coldstart optimize`); also switchable per mount through the control socket
    record: bool = False


@dataclass(frozen=True)
class SourceConfig(_Checked):
    """Byte sources opened by location (``coldstart.remote.open_source``, the weights loader):
    local files, ``http(s)://``, ``s3://``, ``registry://`` blobs."""

    # deadline of one network request, seconds: each range attempt has this long, and a
    # range's retries share twice this
    timeout: float = 30.0
    # range requests in flight to one network source (its connection pool is this big)
    concurrency: int = 16
    # attempts after the first when a range body breaks off or stalls (jittered backoff)
    retries: int = 3
    # longest pause between two attempts, seconds
    max_backoff: float = 2.0


@dataclass(frozen=True)
class WeightsConfig(_Checked):
    """The safetensors loader (``coldstart.weights.load``, ``coldstart weights``)."""

    # bytes of one read (a tensor larger than this is read in pieces, in parallel)
    chunk_bytes: int = 16 * MiB
    # pinned staging memory of a CUDA load. Pinning costs: on an H200 machine (16 cores) 512 MiB
    # took 225-256 ms to pin, most of a process's first 4 GB load (0.40 s, 10.1 GB/s); 128 MiB
    # took 42 ms, and the load 0.225 s (17.9 GB/s; bench/published/gpu-2026-12-04)
    max_host_bytes: int = 128 * MiB
    # registry blobs: ranges that arrive ahead of the in-order digest are held up to this many
    # bytes; beyond it they are read again to verify
    verify_hold_bytes: int = 64 * MiB


@dataclass(frozen=True)
class ProbeTimingConfig(_Checked):
    """``coldstart probe``: timings of the prober, its checks and its sinks, seconds."""

    # between tries while STARTING/LOADING
    startup_interval: float = 0.005
    # deadline of one try while starting (Knative: 100 ms)
    startup_try_timeout: float = 0.1
    # FAILED if not READY within this long
    startup_timeout: float = 600.0
    # between tries once READY or DEGRADED
    interval: float = 0.1
    # deadline of one try once READY
    try_timeout: float = 1.0
    # sinks' keep-alive period
    heartbeat: float = 1.0
    # a router stops picking a target this long after its last heartbeat
    ttl: float = 3.0
    # progress-only updates are pushed at most this often
    progress_every: float = 0.1
    # after routers know we drain, before the app's SIGTERM
    drain_delay: float = 0.0
    # the app's grace period after its SIGTERM
    grace: float = 30.0
    # how long to wait for sinks to take a change when draining
    flush_timeout: float = 2.0
    # deadline of one Valkey/Redis command of the routing sink
    redis_timeout: float = 1.0
    # deadline of one webhook / Kubernetes API request
    http_timeout: float = 2.0
    # attempts after the first of a failed webhook / Kubernetes request
    sink_retries: int = 3
    # deadline of one Valkey/Redis command of a router (``coldstart router``)
    router_timeout: float = 2.0


@dataclass(frozen=True)
class SnapshotConfig(_Checked):
    """``coldstart-runc``, the runc wrapper that restores containers from snapshots."""

    # restores' state, CRIU's images while a restore runs, the events log and the counters
    state_dir: str = "/run/coldstart/snapshots"
    # verified snapshot chunks, shared by every restore on the node; "" means <root>/snapshots
    chunk_dir: str = ""
    # CRIU's images while a restore runs (as big as the process's memory: on disk, not in
    # /run's tmpfs); "" means <root>/snapshot-work
    work_dir: str = ""
    # the chunk cache's size limit (least recently used chunks go first)
    chunk_max_bytes: int = 8 * GiB
    # the CRIU binary; "" finds criu on PATH, then /usr/local/sbin/criu
    criu: str = ""
    # the real runc the wrapper runs; "" finds runc on PATH (not coldstart-runc itself)
    runc: str = ""
    # seconds finding and fetching a snapshot may take; past it the container starts normally
    # (runc restore gets 30 s more: kubelet gives a CRI call 2 minutes)
    timeout: float = 60.0
    # signal sent, after a restore, to each restored process that handles it
    # (coldstart.snapshot.after_restore installs the handler); "" sends none
    signal: str = "SIGRTMIN+6"
    # "eager": every page fetched and verified before CRIU restores; "lazy": the bundle
    # mounted through the FUSE server and CRIU's lazy pages (userfaultfd) fault them in
    pages: str = "eager"

    def __post_init__(self) -> None:
        super().__post_init__()
        _one_of("snapshot.pages", self.pages, SNAPSHOT_PAGES)


@dataclass(frozen=True)
class Config(_Checked):
    # metadata, snapshot directories and (by default) the chunk cache live here
    root: str = "/var/lib/coldstart"
    # gRPC socket containerd's proxy_plugins.coldstart.address points at
    socket: str = "/run/coldstart/snapshotter.sock"
    # mount layers whose TOC digest is not annotated (unverified); off: they are pulled normally
    allow_unverified: bool = False
    # host:port for the snapshotter's (gRPC process) Prometheus metrics; "" disables
    metrics_address: str = ""
    # debug, info, warning or error (--log-level overrides)
    log_level: str = "info"
    # "text" (timestamped lines) or "json" (one object per line, UTC timestamps: journald,
    # Kubernetes log pipelines); --log-format overrides
    log_format: str = "text"
    # worker threads serving the snapshotter's gRPC requests
    grpc_workers: int = 8
    # seconds in-flight RPCs may finish in after SIGTERM before the server stops
    shutdown_grace: float = 10.0
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    fuse: FuseConfig = field(default_factory=FuseConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    pull: PullConfig = field(default_factory=PullConfig)
    source: SourceConfig = field(default_factory=SourceConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    probe: ProbeTimingConfig = field(default_factory=ProbeTimingConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _one_of("log_level", self.log_level, _LOG_LEVELS)
        _one_of("log_format", self.log_format, LOG_FORMATS)
        if self.metrics_address and self.metrics_address == self.fuse.metrics_address:
            raise InvalidArgument("config: metrics_address and fuse.metrics_address must differ "
                                  "(two processes cannot listen on one port)")

    @property
    def cache_dir(self) -> str:
        return self.cache.dir or str(Path(self.root) / "cache")

    @property
    def snapshot_chunk_dir(self) -> str:
        return self.snapshot.chunk_dir or str(Path(self.root) / "snapshots")

    @property
    def snapshot_work_dir(self) -> str:
        return self.snapshot.work_dir or str(Path(self.root) / "snapshot-work")

    @property
    def cri_keychain_dir(self) -> str:
        """Where the CRI proxy writes, and the FUSE server reads, kubelet's credentials."""
        return self.registry.cri_keychain or str(Path(self.root) / "cri-credentials")


T = TypeVar("T")


def _check(value: Any, typ: Any, where: str) -> Any:
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ) and isinstance(typ, type):
        if not isinstance(value, dict):
            raise InvalidArgument(f"config: [{where}] must be a table")
        return from_dict(typ, value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise InvalidArgument(f"config: {where} must be a list")
        (item,) = {a for a in typing.get_args(typ) if a is not Ellipsis}
        return tuple(_check(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(typ):
            try:
                return _check(value, arg, where)
            except InvalidArgument:
                continue
        raise InvalidArgument(f"config: {where} has the wrong type ({type(value).__name__})")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, str) and _is_size(where):
        return parse_size(value, where)
    if typ is int and isinstance(value, bool):
        raise InvalidArgument(f"config: {where} must be an integer")
    if not isinstance(value, typ):
        raise InvalidArgument(
            f"config: {where} must be {typ.__name__}, not {type(value).__name__}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a parsed TOML table; unknown keys are an error."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise InvalidArgument(f"config: unknown key {key!r}")
    kwargs = {k: _check(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def load(path: str | Path | None) -> Config:
    """Read the config file at ``path`` (``None``: all defaults)."""
    if path is None:
        return Config()
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise InvalidArgument(f"config file {path} does not exist") from exc
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"config file {path} is not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise InvalidArgument(f"config file {path} cannot be read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"config file {path}: {exc}") from exc
    return from_dict(Config, data)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}


def _is_size(where: str) -> bool:
    name = where.rsplit(".", 1)[-1]
    return name.endswith("_bytes") or name == "background_rate"


def parse_size(text: str, where: str = "size") -> int:
    """``"20G"``, ``"512MiB"``, ``"4k"``, ``"1.5G"``, ``"4096"`` → bytes (binary units)."""
    m = _SIZE_RE.match(text)
    value = Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()] if m else None
    if value is None or value.denominator != 1:
        raise InvalidArgument(f"config: {where} must be bytes or a size like \"20G\" or "
                              f"\"512MiB\" (a whole number of bytes), not {text!r}")
    return int(value)


def _size_text(n: int) -> str:
    for unit, mult in (("T", 1 << 40), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def _comments(cls: type) -> dict[str, list[str]]:
    """The comment lines above each field of ``cls``, read from its source (one home: the
    meaning is written once, next to the default)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, list[str]] = {}
    pending: list[str] = []
    for line in lines[1:]:
        text = line.strip()
        if text.startswith("#"):
            pending.append(text.lstrip("#").strip())
            continue
        m = re.match(r"^(\w+)\s*:", text)
        if m and pending:
            out[m.group(1)] = pending
        pending = []
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def dump(config: Any, _prefix: str = "") -> str:
    """The whole tree as TOML, scalars first, then one table per section; each key with its
    meaning as a comment above it, sizes with a unit (``"20G"``)."""
    notes = _comments(type(config))
    scalars, tables = [], []
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if dataclasses.is_dataclass(v):
            name = f"{_prefix}{f.name}"
            doc = type(v).__doc__ or ""
            if doc.startswith(f"{type(v).__name__}("):      # dataclass's generated one
                doc = ""
            doc = inspect.cleandoc(doc)
            head = "".join(f"# {line}\n" for line in (doc or "").splitlines() if line)
            tables.append(f"\n{head}[{name}]\n" + dump(v, name + "."))
        else:
            text = (f'"{_size_text(v)}"' if isinstance(v, int) and not isinstance(v, bool)
                    and _is_size(f.name) and _size_text(v) != str(v) else _toml_value(v))
            comment = "".join(f"# {line}\n" for line in notes.get(f.name, []))
            scalars.append(f"{comment}{f.name} = {text}\n")
    return "".join(scalars) + "".join(tables)
