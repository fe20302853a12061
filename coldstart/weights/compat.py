"""``safetensors``' own API over coldstart's loader: switch a server with one import.

>>> from coldstart.weights import safe_open, load_file   # was: from safetensors...
>>> state = load_file("model.safetensors", device="cuda:0")  # doctest: +SKIP
>>> with safe_open("model.safetensors", framework="pt", device="cpu") as f:  # doctest: +SKIP
...     emb = f.get_slice("embed.weight")[:, :1024]

Same signatures and results as ``safetensors.torch.load_file`` and ``safetensors.safe_open``
(framework ``"pt"``): names in the same order (safetensors 0.8's), tensors bit-identical,
``device`` a string or a CUDA device number. What differs is how the bytes arrive:
:func:`load_file` and :meth:`safe_open.get_tensors` read the whole file with
:func:`coldstart.weights.load` (in parallel, straight into CUDA through pinned staging, or as
views of a private map of the page cache brought in by parallel populate on CPU);
:meth:`safe_open.get_tensor` and :meth:`safe_open.get_slice` view the same private map, the
pages read as they are touched, as ``safetensors`` does (a file of a lazily mounted layer,
where the node's files socket is mounted in: a map the node fills, each tensor fetched whole,
in parallel and verified, when first asked for). Like ``safetensors``, these take a
local file (a file on a coldstart lazy mount is one); for ``s3://``, ``http(s)://`` and
``registry://`` use :func:`coldstart.weights.load`. A missing file is ``FileNotFoundError``
as there; ``backend`` ("mmap" or "pread") is accepted and checked, and coldstart reads its
own way; other errors are coldstart's (a missing tensor: ``InvalidArgument``).
"""

from __future__ import annotations

import errno
import os
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

from coldstart.errors import ColdstartError, InvalidArgument, NotFound
from coldstart.weights.checkpoint import read_header
from coldstart.weights.dtypes import BITS, torch_dtype, torch_shape
from coldstart.weights.header import Header, TensorInfo
from coldstart.weights.loader import load
from coldstart.weights.nodefile import NodeFileSource, node_source
from coldstart.weights.sources import LocalSource

if TYPE_CHECKING:
    import torch

__all__ = ["load_file", "safe_open"]

_FRAMEWORKS = ("pt", "torch", "pytorch")


def _device(device: str | int | torch.device) -> str | torch.device:
    """safetensors' ``device``: a number is that CUDA device."""
    if isinstance(device, bool):
        raise InvalidArgument(f"device {device!r} is not a device")
    if isinstance(device, int):
        return f"cuda:{device}"
    return device


def _local(filename: str | os.PathLike[str]) -> str:
    path = os.fspath(filename)
    if "://" in path:
        raise InvalidArgument(f"{path}: safe_open and load_file take a local file, as "
                              "safetensors does; coldstart.weights.load reads URLs")
    return path


def _backend(backend: str) -> None:
    # safetensors 0.8 reads by mmap or pread; coldstart picks its own way (see the module)
    if backend not in ("mmap", "pread"):
        raise InvalidArgument(f"backend must be mmap or pread, not {backend!r}")


def load_file(filename: str | os.PathLike[str], device: str | int | torch.device = "cpu",
              *, backend: str = "mmap") -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file``: every tensor of the file on ``device``, in the order
    of their bytes in the file (as safetensors 0.8)."""
    with safe_open(filename, framework="pt", device=device, backend=backend) as f:
        return f.get_tensors()


class _Slice:
    """``safetensors``' slice object: the shape and dtype of a tensor without reading it;
    indexing it reads the part indexed."""

    def __init__(self, owner: safe_open, info: TensorInfo) -> None:
        self._owner, self._info = owner, info
        self._map = owner._source.mapping()     # (reads nothing) kept: usable after close

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        part = self._owner._view(self._info, self._map)[index]
        return self._owner._place(part.contiguous())


class safe_open:
    """``safetensors.safe_open(filename, framework="pt", device=...)``: the header read at
    once, tensors when asked; a context manager (the map lives on in the tensors)."""

    def __init__(self, filename: str | os.PathLike[str], framework: str = "pt",
                 device: str | int | torch.device = "cpu", *, backend: str = "mmap") -> None:
        if framework not in _FRAMEWORKS:
            raise InvalidArgument(f"framework {framework!r} is not supported: coldstart "
                                  "loads torch tensors (framework 'pt')")
        _backend(backend)
        self._path = _local(filename)
        self._device = _device(device)
        # a file of a lazily mounted layer: through the node's files socket, each tensor
        # fetched whole (in parallel, verified) when first asked for
        self._source: LocalSource | NodeFileSource
        try:
            self._source = node_source(self._path) or LocalSource(self._path)
        except NotFound as exc:         # what safetensors raises, for code that catches it
            raise FileNotFoundError(errno.ENOENT, str(exc), self._path) from None
        # closed when this object goes, as safetensors' own (not everyone uses `with`)
        self._closer = weakref.finalize(self, self._source.close)
        try:
            self._header: Header = read_header(self._source)
        except BaseException:
            self._closer()
            raise

    def __enter__(self) -> safe_open:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._closer()

    def keys(self) -> list[str]:
        """Tensor names, sorted (as safetensors)."""
        return sorted(self._header.tensors)

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their bytes in the file."""
        return list(self._header.order)

    def metadata(self) -> dict[str, str] | None:
        meta = self._header.metadata
        return dict(meta) if meta is not None else None

    def _info(self, name: str) -> TensorInfo:
        info = self._header.tensors.get(name)
        if info is None:
            raise InvalidArgument(f"{self._path}: no tensor named {name!r}")
        return info

    def _view(self, info: TensorInfo, mapping: Any = None) -> torch.Tensor:
        """The tensor as a view of the file's private map (a copy where its offset is not
        aligned to its element size: a view of another dtype needs that)."""
        import torch

        at = self._header.data_start + info.begin
        m = mapping if mapping is not None else self._source.mapping()
        if isinstance(self._source, NodeFileSource) and info.nbytes:
            try:    # (closed: Unavailable, never zeros)
                self._source.populate(at, info.nbytes)
            except ColdstartError as exc:
                message = str(exc).removeprefix(f"{self._path}: ")
                raise type(exc)(f"{self._path}: tensor {info.name!r}: {message}") from exc
        raw = torch.frombuffer(m, dtype=torch.uint8, count=info.nbytes,
                               offset=at) if info.nbytes else torch.empty(0, dtype=torch.uint8)
        if at % max(1, BITS[info.dtype] // 8):
            raw = raw.clone()
        tdt = torch_dtype(info.dtype)
        if tdt is None:
            raise InvalidArgument(f"{self._path}: tensor {info.name!r} is {info.dtype}, "
                                  f"which this torch cannot hold")
        return raw.view(tdt).reshape(torch_shape(info.dtype, info.shape))

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        return t if str(self._device) == "cpu" else t.to(self._device)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._place(self._view(self._info(name)))

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self, self._info(name))

    def get_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, in file order, read at once by :func:`coldstart.weights.load`."""
        tensors = load(self._path, device=self._device)
        return {name: tensors[name] for name in self._header.order}
