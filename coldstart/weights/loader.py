"""Stream safetensors checkpoints into CPU or GPU memory with parallel reads.

Plan: every selected tensor gets its own destination buffer (``uint8`` of its size, on the target
device). Per-tensor rather than per-file buffers because (1) a view of a per-file buffer needs
its offset aligned to the element size, and real files are sometimes misaligned; (2) each tensor
owns its memory, so dropping one frees it (no whole-file buffer kept alive by a view); (3) a
tensor-parallel rank allocates only its slice. The byte ranges to read are cut into reads of at
most ``chunk_bytes``; one read may cover several small tensors (``preadv`` with one buffer per
tensor) and skip small gaps.

CPU: the source writes straight into the destination tensors' memory: no staging, no extra copy.
CUDA: reads land in a bounded pool of pinned staging buffers (``max_host_bytes`` in all, each a
power of two of at most 1/``_STAGING_BUFFERS`` of it, so reading overlaps copying); each worker
thread copies its buffer to the device on its own stream with ``non_blocking=True`` and records
an event; a buffer is reused only after its event completes. dtype conversion happens on the
device once a tensor is complete. The device side of that pipeline is one small object
(:class:`_CudaCopies`); the tests drive the same pipeline with a fake asynchronous device where
no GPU is present.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from coldstart.config import SourceConfig, WeightsConfig
from coldstart.errors import (
    ColdstartError,
    FormatError,
    IntegrityError,
    InvalidArgument,
    NotFound,
)
from coldstart.weights.checkpoint import Checkpoint, Opener, ShardFile, read_header
from coldstart.weights.dtypes import BITS, torch_dtype, torch_shape
from coldstart.weights.header import TensorInfo
from coldstart.weights.sources import LocalSource, Source, name_of

if TYPE_CHECKING:
    import torch

__all__ = ["LoadStats", "Slice", "iter_load", "load", "tensor_parallel"]

log = logging.getLogger(__name__)

_SOURCE = SourceConfig()
_WEIGHTS = WeightsConfig()
DEFAULT_CONCURRENCY = _SOURCE.concurrency  # network sources: many requests in flight hide latency


def staging_chunk(chunk_bytes: int, max_host_bytes: int) -> int:
    """The size of a CUDA load's pinned staging buffers: ``chunk_bytes`` shrunk until the
    budget holds ``_STAGING_BUFFERS`` of them (at least 4 KiB), down to a power of two, since
    torch's pinned allocator rounds each block up to one: any other size would hold more
    pinned memory than allowed."""
    n = max(4096, min(chunk_bytes, max_host_bytes // _STAGING_BUFFERS))
    return 1 << (n.bit_length() - 1)


def local_concurrency(mapped: bool) -> int:
    """Threads for local files: reading into fresh memory is CPU work (page faults, copies), so
    a few per core; populating a file map mostly waits on the disk, so more."""
    cpus = os.cpu_count() or 1
    return max(8, min(16, 4 * cpus)) if mapped else max(2, min(16, 2 * cpus))
DEFAULT_CHUNK = _WEIGHTS.chunk_bytes
DEFAULT_MAX_HOST = _WEIGHTS.max_host_bytes
# Gaps up to this size between wanted ranges are read and dropped rather than cut into two reads.
_COALESCE_GAP = 256 << 10
#: A CUDA load cuts its pinned staging budget into at least this many buffers (one for each of
#: the default 16 threads; at least 4 KiB each, unless the longest read is smaller; never
#: fewer than 2, nor more than the load's reads). On the H200 machine, 16 buffers of 8 MiB
#: loaded a 4 GB file at 17.9 GB/s where 32 of 4 MiB managed 10.6
#: (bench/published/gpu-2026-12-04).
_STAGING_BUFFERS = 16
#: Mapped local files: while a thread populates one read, the reads after it, up to this many
#: bytes, are asked of the kernel (``LocalFileBlob.advise``, WILLNEED: the reads submitted,
#: not waited for); populating then mostly maps pages already read or on their way.
POPULATE_AHEAD = 64 << 20


@dataclass(frozen=True)
class Slice:
    """Rows ``start:stop`` of dimension ``dim`` of a tensor (what a tensor-parallel rank loads)."""

    dim: int
    start: int
    stop: int


Select = Callable[[TensorInfo], "bool | Slice"] | Collection[str] | None


def tensor_parallel(
    rank: int, world_size: int, dim_of: Callable[[TensorInfo], int | None],
) -> Callable[[TensorInfo], bool | Slice]:
    """A ``select`` for rank ``rank`` of ``world_size``: split ``dim_of(tensor)`` evenly.

    ``dim_of`` returns the dimension to split, or None to load the tensor whole (norms, biases).

    >>> sel = tensor_parallel(1, 2, lambda t: 0 if t.name.endswith("q_proj.weight") else None)
    >>> info = TensorInfo("l.q_proj.weight", "BF16", (8, 4), 0, 64)
    >>> sel(info)
    Slice(dim=0, start=4, stop=8)
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgument(f"rank {rank} is not in 0..{world_size - 1}")

    def select(info: TensorInfo) -> bool | Slice:
        dim = dim_of(info)
        if dim is None:
            return True
        if not 0 <= dim < len(info.shape) or info.shape[dim] % world_size:
            raise InvalidArgument(f"tensor {info.name!r}: dimension {dim} of shape "
                                  f"{list(info.shape)} does not split into {world_size} parts")
        part = info.shape[dim] // world_size
        return Slice(dim, rank * part, (rank + 1) * part)

    return select


@dataclass
class LoadStats:
    """What a load did: filled in as it runs (``path`` says which data path ran)."""

    path: str = ""
    total_bytes: int = 0
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    reads: int = 0
    seconds: float = 0.0
    #: host staging memory the load allocated (pinned, for CUDA): within ``max_host_bytes``
    #: (a budget under 8 KiB still gets up to two buffers of 4 KiB)
    staging_bytes: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Target:
    name: str
    info: TensorInfo
    shape: tuple[int, ...]
    nbytes: int
    remaining: int
    dest: Any = None
    events: list[Any] = field(default_factory=list)
    file: int = 0
    # File offset when the tensor is one contiguous range: a mapped load can view it in place.
    view_at: int | None = None


@dataclass
class _Read:
    file: int
    offset: int
    # (length, target or None for a skipped gap, offset inside the target)
    parts: list[tuple[int, _Target | None, int]]

    @property
    def length(self) -> int:
        return sum(p[0] for p in self.parts)


def _selection(select: Select, info: TensorInfo) -> bool | Slice:
    if select is None:
        return True
    if callable(select):
        return select(info)
    return info.name in select


def _plan(ckpt: Checkpoint, select: Select, chunk_bytes: int,
          ) -> tuple[list[_Target], list[_Read]]:
    targets: list[_Target] = []
    reads: list[_Read] = []
    wanted = set(select) if select is not None and not callable(select) else None
    for fidx, shard in enumerate(ckpt.files):
        header = shard.header
        segments: list[tuple[int, int, _Target, int]] = []
        for info in header.in_file_order():
            choice = _selection(select, info)
            if choice is False:
                continue
            if wanted is not None:
                wanted.discard(info.name)
            where = f"{header.file}: tensor {info.name!r}"
            if torch_dtype(info.dtype) is None:
                raise FormatError(f"{where}: dtype {info.dtype} has no torch equivalent in this "
                                  "torch build")
            if info.dtype == "F4" and (not info.shape or info.shape[-1] % 2):
                raise FormatError(f"{where}: F4 needs an even last dimension to load as torch "
                                  "float4_e2m1fn_x2")
            base = header.data_start + info.begin
            if isinstance(choice, Slice):
                shape, runs = _slice_runs(where, info, choice)
            else:
                shape, runs = info.shape, [(0, info.nbytes)]
            nbytes = sum(r[1] for r in runs)
            target = _Target(info.name, info, shape, nbytes, nbytes, file=fidx,
                             view_at=base + runs[0][0] if len(runs) == 1 else None)
            targets.append(target)
            pos = 0
            for off, length in runs:
                if length:
                    segments.append((base + off, length, target, pos))
                pos += length
        reads += _group(fidx, segments, chunk_bytes)
    if wanted:
        raise NotFound(f"{ckpt.location}: no tensor named {sorted(wanted)[0]!r}"
                       + (f" (and {len(wanted) - 1} more)" if len(wanted) > 1 else ""))
    return targets, reads


def _slice_runs(where: str, info: TensorInfo, s: Slice,
                ) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    shape = info.shape
    if not 0 <= s.dim < len(shape) or not 0 <= s.start <= s.stop <= shape[s.dim]:
        raise InvalidArgument(f"{where}: slice {s} does not fit shape {list(shape)}")
    inner_bits = math.prod(shape[s.dim + 1:]) * BITS[info.dtype]
    if (inner_bits * (s.stop - s.start)) % 8 or inner_bits % 8:
        raise InvalidArgument(f"{where}: slice {s} does not fall on byte boundaries")
    inner = inner_bits // 8
    run = (s.stop - s.start) * inner
    stride = shape[s.dim] * inner
    outer = math.prod(shape[: s.dim])
    new_shape = (*shape[: s.dim], s.stop - s.start, *shape[s.dim + 1:])
    return new_shape, [(o * stride + s.start * inner, run) for o in range(outer)]


def _group(fidx: int, segments: list[tuple[int, int, _Target, int]],
           chunk: int) -> list[_Read]:
    reads: list[_Read] = []
    cur: _Read | None = None
    cur_end = 0
    for off, length, target, tpos in segments:
        while length:
            if cur is not None and 0 <= off - cur_end <= _COALESCE_GAP and \
                    cur_end - cur.offset + (off - cur_end) < chunk:
                if off > cur_end:
                    cur.parts.append((off - cur_end, None, 0))
                take = min(length, chunk - (off - cur.offset))
            else:
                cur = _Read(fidx, off, [])
                reads.append(cur)
                take = min(length, chunk)
            cur.parts.append((take, target, tpos))
            off, length, tpos = off + take, length - take, tpos + take
            cur_end = off
    return reads


class _Copies(Protocol):
    """The device side of a staged load: host staging memory and asynchronous copies out of it."""

    def staging_buffer(self, size: int) -> torch.Tensor:
        """A host buffer of ``size`` bytes (``uint8``) that copies can read asynchronously."""
        ...

    def copy_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Start ``dst.copy_(src)`` for each pair, in order, on the calling thread's stream;
        return an event that completes when they all have."""
        ...

    def host_wait(self, event: Any) -> None:
        """Block until ``event`` completed (its source buffer may then be written again)."""
        ...

    def device_wait(self, events: list[Any]) -> None:
        """Order the consumer's work after ``events`` (before a tensor is handed out)."""
        ...

    def synchronize(self) -> None:
        """Wait for every copy started so far."""
        ...


class _CudaCopies:
    """Pinned staging buffers; one side stream per worker thread; CUDA events."""

    def __init__(self, dev: torch.device) -> None:
        import torch

        self._dev = dev
        self._local = threading.local()
        # The caller's stream (current streams are per thread: a worker's is the default one):
        # the destinations are allocated on it, and tensors are handed out on it.
        self._consumer = torch.cuda.current_stream(dev)

    def staging_buffer(self, size: int) -> torch.Tensor:
        import torch

        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def copy_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        import torch

        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self._dev)  # type: ignore[no-untyped-call]
            # The destinations were allocated on the consumer's stream, maybe over memory that
            # work queued there still uses: start this stream after that work.
            stream.wait_stream(self._consumer)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def device_wait(self, events: list[Any]) -> None:
        for ev in events:
            self._consumer.wait_event(ev)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self._dev)


def _copies_for(dev: torch.device) -> _Copies | None:
    """How a load reaches ``dev``: staged copies for CUDA; None (straight into the tensors) for
    CPU. (The tests replace this to run the staged pipeline on a fake device.)"""
    return _CudaCopies(dev) if dev.type == "cuda" else None


class _Staging:
    """A bounded pool of staging buffers; a buffer returns with the event of its last copy."""

    def __init__(self, copies: _Copies, count: int, size: int) -> None:
        self._copies = copies
        self._free: queue.Queue[tuple[Any, Any]] = queue.Queue()
        for _ in range(count):
            self._free.put((copies.staging_buffer(size), None))

    def get(self) -> Any:
        buf, event = self._free.get()
        if event is not None:
            self._copies.host_wait(event)  # the previous copy out of this buffer must be done
        return buf

    def put(self, buf: Any, event: Any) -> None:
        self._free.put((buf, event))


def _finish(target: _Target, dtype: torch.dtype | None, copies: _Copies | None,
            mappings: list[Any] | None = None) -> torch.Tensor:
    import torch

    if target.dest is None:
        assert mappings is not None and target.view_at is not None
        # A view of the private file map: no copy; the tensor keeps the map alive.
        target.dest = torch.frombuffer(mappings[target.file], dtype=torch.uint8,
                                       count=target.nbytes, offset=target.view_at)
    tdt = torch_dtype(target.info.dtype)
    assert tdt is not None
    if copies is not None and target.events:
        copies.device_wait(target.events)
        target.events.clear()
    t = target.dest.view(tdt).reshape(torch_shape(target.info.dtype, target.shape))
    if dtype is not None and t.dtype != dtype and t.is_floating_point():
        t = t.to(dtype)
    target.dest = None
    out: torch.Tensor = t
    return out


def _device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device this loader supports, or :class:`InvalidArgument`."""
    import torch

    if isinstance(device, torch.device):
        dev = device
    else:
        if not isinstance(device, str) or not device.strip():
            raise InvalidArgument(f"device {device!r} is not a device: use cpu, cuda or cuda:N")
        try:
            dev = torch.device(device.strip())
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"device {device!r} is not a device torch knows: use cpu, "
                                  "cuda or cuda:N") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(f"device {device!s} asked for, but CUDA is not available "
                                  "(torch sees no CUDA device)")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise InvalidArgument(f"device {dev} does not exist: torch sees {count} CUDA "
                                  f"device(s)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise InvalidArgument(f"device {dev} is not supported (use cpu, cuda or cuda:N)")
    return dev


def iter_load(
    source: str | os.PathLike[str] | Source,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    concurrency: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK,
    max_host_bytes: int = DEFAULT_MAX_HOST,
    select: Select = None,
    direct: bool = False,
    cpu_mode: str = "auto",
    timeout: float = _SOURCE.timeout,
    progress: Callable[[int], None] | None = None,
    stats: LoadStats | None = None,
    registry: Mapping[str, Any] | None = None,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(name, tensor)`` as soon as each tensor's bytes are in place.

    ``source``: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a folder holding
    either, as a local path, ``s3://bucket/key``, ``http(s)://...`` or
    ``registry://reg/repo@sha256:...``
    (or a :class:`Source`). ``dtype`` converts floating-point tensors (on the device).
    ``select``: names to load, or a function of :class:`TensorInfo` returning False (skip), True
    (whole) or a :class:`Slice`. ``concurrency``: parallel reads (default: local files 2 threads
    per core when reading, 4 per core (8 to 16) when mapping; network sources 16).
    ``max_host_bytes`` bounds the pinned staging memory of a CUDA load (CPU loads put the bytes
    straight into the result and stage nothing). ``progress`` is called with the byte count of
    each completed read. ``timeout`` bounds each network request: every range attempt has a
    deadline (a server that dribbles bytes is cut off and the range retried within twice that).

    Registry blobs (``registry://``) are verified against their digest before anything is handed
    out: their tensors are yielded only after the whole load completed and the blob's bytes
    (including any a selection skipped, read once more in order) hashed to the digest; a
    mismatch raises :class:`~coldstart.errors.IntegrityError` and yields nothing. ``device``
    is ``cpu``, ``cuda`` or ``cuda:N`` (anything else is :class:`InvalidArgument`).
    ``registry``: keyword arguments of the registry client of ``registry://`` sources
    (``insecure_hosts``, ``tls_verify``, ``docker_config``).

    ``cpu_mode`` (CPU loads of local files): ``"mmap"`` maps each file copy-on-write, brings it
    into memory with parallel ``MADV_POPULATE_READ`` (the reads ahead of those being populated
    already asked of the kernel, ``POPULATE_AHEAD``) and returns views of the page cache (no
    copy, no zero-filled pages, memory shared with other processes loading the same file;
    tensors whose offset is misaligned for their dtype, or slices along dim > 0, are copied).
    Like ``safetensors``' own mmap, the tensors change if the file is rewritten in place.
    ``"read"`` reads with ``preadv`` into freshly allocated tensors (private memory).
    ``"auto"`` (default) is ``"mmap"`` for local files without ``direct``, ``"read"`` otherwise.

    >>> for name, tensor in iter_load("model.safetensors", device="cpu"):  # doctest: +SKIP
    ...     model.get_parameter(name).data = tensor
    """
    import torch

    if cpu_mode not in ("auto", "mmap", "read"):
        raise InvalidArgument(f"cpu_mode must be auto, mmap or read, not {cpu_mode!r}")
    if (concurrency is not None and concurrency < 1) or chunk_bytes < 4096 or max_host_bytes < 1:
        raise InvalidArgument("concurrency must be >= 1, chunk_bytes >= 4096, "
                              "max_host_bytes >= 1")
    dev = _device(device)
    st = stats if stats is not None else LoadStats()
    started = time.perf_counter()

    opener = Opener(concurrency=concurrency or DEFAULT_CONCURRENCY, timeout=timeout,
                    direct=direct, registry=registry)
    try:
        if isinstance(source, str | os.PathLike):
            ckpt = opener.checkpoint(source)
        elif all(callable(getattr(source, m, None)) for m in ("size", "read_into", "close")):
            ckpt = Checkpoint(name_of(source), [ShardFile(source, read_header(source))], {})
        else:
            raise InvalidArgument(f"cannot load from a {type(source).__name__}: give a path, "
                                  "a URL or a source (size, read_into, close)")
        try:
            copies = _copies_for(dev)
            staged = copies is not None
            # Pinned staging buffers can't exceed the host budget: reads are cut to their size.
            if staged:
                chunk_bytes = staging_chunk(chunk_bytes, max_host_bytes)
            targets, reads = _plan(ckpt, select, chunk_bytes)
            st.files, st.tensors = len(ckpt.files), len(targets)
            st.total_bytes = sum(r.length for r in reads)
            direct_on = any(getattr(f.source, "direct", False) for f in ckpt.files)
            local = all(isinstance(f.source, LocalSource) for f in ckpt.files)
            # local files, and lazily mounted ones through the node (a memfd it fills)
            mappable = not staged and all(
                callable(getattr(f.source, "mapping", None))
                and callable(getattr(f.source, "populate", None))
                and not getattr(f.source, "direct", False) for f in ckpt.files)
            if cpu_mode == "mmap" and not mappable:
                raise InvalidArgument("cpu_mode mmap needs local (or lazily mounted) files, "
                                      "device cpu and no O_DIRECT")
            mappings: list[Any] | None = None
            if mappable and cpu_mode != "read":
                mappings = [f.source.mapping() for f in ckpt.files  # type: ignore[attr-defined]
                            ] if reads else []
            if concurrency is None:
                concurrency = (local_concurrency(mappings is not None) if local
                               else DEFAULT_CONCURRENCY)
            if staged:
                st.path = f"{dev.type}: pinned staging + async H2D"
            elif mappings is not None:
                st.path = ("cpu: mmap + parallel populate (page cache views)" if local else
                           "cpu: views of a memory map the source fills in parallel")
            else:
                st.path = "cpu: preadv straight into tensors"
            st.path += " (O_DIRECT)" if direct_on else ""
            via = next((v for f in ckpt.files if (v := getattr(f.source, "via", None))), None)
            if via is not None:
                st.path += f" ({via})"
            refused = [r for f in ckpt.files
                       if (r := getattr(f.source, "direct_refused", None))]
            if refused:
                st.path += f" (O_DIRECT not used: {refused[0]}; read through the page cache)"
            for t in targets:
                itemsize = torch_dtype(t.info.dtype).itemsize  # type: ignore[union-attr]
                if (mappings is not None and t.nbytes and t.view_at is not None
                        and t.view_at % itemsize == 0):
                    continue  # viewed in place once populated
                t.dest = torch.empty(t.nbytes, dtype=torch.uint8, device=dev)

            def produce() -> Iterator[tuple[str, torch.Tensor]]:
                assert concurrency is not None
                for t in [t for t in targets if t.remaining == 0]:
                    yield t.name, _finish(t, dtype, copies, mappings)
                if reads:
                    yield from _run(ckpt, reads, dtype, concurrency, chunk_bytes,
                                    max_host_bytes, progress, st, copies, mappings)

            # Sources that check a digest (registry blobs) can only say the bytes are good once
            # all of them went through: hold the tensors (their memory is allocated anyway)
            # until then, so a tampered blob hands out nothing.
            checks = [v for f in ckpt.files if callable(v := getattr(f.source, "verify", None))]
            if checks:
                out = list(produce())
                for check in checks:
                    check()
                yield from out
            else:
                yield from produce()
            if copies is not None:
                copies.synchronize()  # every byte landed before the load counts as done
        finally:
            ckpt.close()
    finally:
        opener.close()
        st.seconds = time.perf_counter() - started


def _run(ckpt: Checkpoint, reads: list[_Read], dtype: torch.dtype | None,
         concurrency: int, chunk_bytes: int, max_host_bytes: int,
         progress: Callable[[int], None] | None, st: LoadStats,
         copies: _Copies | None, mappings: list[Any] | None = None,
         ) -> Iterator[tuple[str, torch.Tensor]]:
    done: queue.Queue[tuple[list[_Target], BaseException | None]] = queue.Queue()
    lock = threading.Lock()
    cancelled = threading.Event()
    staging = None
    if copies is not None:
        # no more buffers than reads, none larger than the longest read (a power of two): a
        # small checkpoint does not pin the whole budget
        count = min(max(2, min(2 * concurrency, max_host_bytes // chunk_bytes)), len(reads))
        size = min(chunk_bytes, 1 << (max(r.length for r in reads) - 1).bit_length())
        staging = _Staging(copies, count, size)
        st.staging_bytes = count * size

    ahead = _ReadAhead(ckpt, reads, POPULATE_AHEAD) if mappings is not None else None

    def work(i: int) -> None:
        if cancelled.is_set():
            return
        r = reads[i]
        try:
            src = ckpt.files[r.file].source
            finished: list[_Target] = []
            event: Any = None
            if mappings is not None:
                assert ahead is not None
                ahead.hint(i)
                src.populate(r.offset, r.length)  # type: ignore[attr-defined]
                pos = r.offset
                with memoryview(mappings[r.file]) as mview:
                    for length, target, tpos in r.parts:
                        if target is not None and target.dest is not None:
                            arr = target.dest.numpy()
                            memoryview(arr)[tpos : tpos + length] = mview[pos : pos + length]
                        pos += length
            elif staging is None:
                scratch = None
                views: list[memoryview] = []
                for length, target, tpos in r.parts:
                    if target is None:
                        scratch = scratch or bytearray(_COALESCE_GAP)
                        views.append(memoryview(scratch)[:length])
                    else:
                        arr = target.dest.numpy()
                        views.append(memoryview(arr)[tpos : tpos + length])
                src.read_into(r.offset, views)
            else:
                assert copies is not None
                buf = staging.get()
                try:
                    src.read_into(r.offset, [memoryview(buf.numpy())[: r.length]])
                    pairs, pos = [], 0
                    for length, target, tpos in r.parts:
                        if target is not None:
                            pairs.append((target.dest[tpos : tpos + length],
                                          buf[pos : pos + length]))
                        pos += length
                    try:
                        event = copies.copy_async(pairs)
                    except BaseException:
                        # Some copies may be queued already: let them read the buffer before
                        # it goes back to the pool.
                        copies.synchronize()
                        raise
                finally:
                    staging.put(buf, event)
            with lock:
                st.reads += 1
                st.bytes += r.length
                for length, target, _ in r.parts:
                    if target is None:
                        continue
                    if event is not None:
                        target.events.append(event)
                    target.remaining -= length
                    if target.remaining == 0:
                        finished.append(target)
            if progress is not None:
                progress(r.length)
            done.put((finished, None))
        except ColdstartError as exc:   # the same kind, naming the file and the tensors
            named: BaseException = exc
            if not cancelled.is_set():
                try:
                    named = _naming(exc, ckpt.files[r.file].source, r)
                except BaseException:   # naming it must never lose the error
                    named = exc
            done.put(([], named))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            done.put(([], exc))

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="coldstart-weights")
    futures: list[Future[None]] = []
    try:
        futures = [pool.submit(work, i) for i in range(len(reads))]
        for _ in range(len(reads)):
            finished, error = done.get()
            if error is not None:
                raise error
            for t in finished:
                yield t.name, _finish(t, dtype, copies, mappings)
    finally:
        cancelled.set()
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)
        if copies is not None:
            # On an early stop, copies may still target tensors about to be freed: let them land
            # before the allocator can hand that memory out again.
            copies.synchronize()


class _ReadAhead:
    """Asks the sources for the reads ahead of the one being populated (each read once).

    The pool takes ``reads`` in order, so a thread starting read ``i`` hints the reads not
    hinted yet up to the last one that starts within ``ahead`` bytes after read ``i`` ends:
    the disk then has the next ranges on their way while the threads fault in pages already
    there. Only sources with an ``advise(offset, length)`` method (local files; it is not
    part of the Source protocol) get hints; the node's files socket fetches whole ranges
    itself."""

    def __init__(self, ckpt: Checkpoint, reads: list[_Read], ahead: int) -> None:
        self._advise = [getattr(f.source, "advise", None) for f in ckpt.files]
        self._reads = reads
        self._ahead = ahead
        self._ends = list(itertools.accumulate(r.length for r in reads))
        self._starts = [end - r.length for end, r in zip(self._ends, reads, strict=True)]
        self._next = 0          # reads before this index were hinted already
        self._lock = threading.Lock()

    def hint(self, i: int) -> None:
        if not any(self._advise):
            return
        with self._lock:
            # from the first read not hinted yet (a thread that got here before the one
            # holding an earlier read must not skip it); read i itself is always within
            first = last = self._next
            limit = self._ends[i] + self._ahead
            while last < len(self._reads) and self._starts[last] < limit:
                last += 1
            self._next = last
        for r in self._reads[first:last]:
            advise = self._advise[r.file]
            if advise is None:
                continue
            try:
                advise(r.offset, r.length)
            except Exception as exc:  # a hint must never fail a load (nor blame a read)
                log.debug("read-ahead hint for file %d at %d failed: %s", r.file, r.offset, exc)


def _naming(exc: ColdstartError, source: Source, r: _Read) -> ColdstartError:
    """``exc`` (same kind) saying which file and tensors the failed read was for. Bytes that
    do not match their digest are pinned on the tensor that holds them: each tensor's part of
    the read is read again alone, and the first that fails is the one named."""
    names = list(dict.fromkeys(t.name for _, t, _ in r.parts if t is not None))
    if isinstance(exc, IntegrityError) and len(names) > 1:
        pos = r.offset
        for length, target, _ in r.parts:
            if target is not None:
                try:
                    source.read_into(pos, [memoryview(bytearray(length))])
                except IntegrityError:
                    names = [target.name]
                    break
                except ColdstartError:
                    pass
            pos += length
    file = name_of(source)
    what = f"{file}: tensor {names[0]!r}" if names else file
    if len(names) > 1:
        what += f" (and {len(names) - 1} more)"
    message = str(exc).removeprefix(f"{file}: ")    # said once
    named = type(exc)(f"{what}: {message}")
    named.__cause__ = exc
    return named


def load(
    source: str | os.PathLike[str] | Source,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    concurrency: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK,
    max_host_bytes: int = DEFAULT_MAX_HOST,
    select: Select = None,
    direct: bool = False,
    cpu_mode: str = "auto",
    timeout: float = _SOURCE.timeout,
    progress: Callable[[int], None] | None = None,
    stats: LoadStats | None = None,
    registry: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Load a safetensors checkpoint into a dict of tensors on ``device``.

    Same arguments as :func:`iter_load`; tensors are bit-identical to
    ``safetensors.torch.load_file`` (dict order: the order the tensors completed).

    >>> tensors = load("s3://models/llama/3/", device="cuda", concurrency=16)  # doctest: +SKIP
    """
    out = dict(iter_load(source, device, dtype, concurrency=concurrency,
                         chunk_bytes=chunk_bytes, max_host_bytes=max_host_bytes, select=select,
                         direct=direct, cpu_mode=cpu_mode, timeout=timeout,
                         progress=progress, stats=stats, registry=registry))
    return out
