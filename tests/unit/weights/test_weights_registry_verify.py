"""Registry blobs (``registry://reg/repo@sha256:...``) are checked against their digest before any
tensor is handed out, whatever the read order, selection or hold bound."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from coldstart.errors import IntegrityError
from coldstart.remote.registry_verify import OrderedDigest as _OrderedDigest
from coldstart.weights import LoadStats, RegistrySource, iter_load, load
from coldstart.weights.checkpoint import Opener
from tests.unit.weights.weights_data import assert_identical, every_dtype, save


class FakeRegistry:
    """What RegistrySource needs of RegistryClient, serving ``served`` for blob ``digest``.

    ``second`` (optional) is served from the second read of a range on: a registry whose
    answer changes between reads.
    """

    def __init__(self, served: bytes, second: bytes | None = None) -> None:
        self.served = served
        self.second = second
        self.calls: list[tuple[int, int]] = []
        self.timeouts: set[float | None] = set()
        self._lock = threading.Lock()

    def blob_size(self, ref: Any, digest: str, *, timeout: float | None = None) -> int:
        self.timeouts.add(timeout)
        return len(self.served)

    def read_blob_range(self, ref: Any, digest: str, offset: int, length: int, *,
                        timeout: float | None = None) -> bytes:
        with self._lock:
            seen = any(o <= offset < o + n for o, n in self.calls)
            self.calls.append((offset, length))
            self.timeouts.add(timeout)
        data = self.second if (seen and self.second is not None) else self.served
        return data[offset : offset + length]


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, str]:
    path = save(every_dtype(seed=3), tmp_path_factory.mktemp("reg") / "model.safetensors")
    data = path.read_bytes()
    return path, data, "sha256:" + hashlib.sha256(data).hexdigest()


def _source(digest: str, client: FakeRegistry, **kwargs: Any) -> RegistrySource:
    return RegistrySource(f"registry://127.0.0.1:5000/w/model@{digest}", client=client, **kwargs)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def test_intact_blob_loads(blob: tuple[Path, bytes, str]) -> None:
    path, data, digest = blob
    client = FakeRegistry(data)
    src = _source(digest, client, timeout=7.0)
    assert_identical(load_file(str(path)), load(src, chunk_bytes=8192, concurrency=4))
    assert client.timeouts == {7.0}  # the caller's deadline reaches every registry call
    # Read once: nothing was fetched twice when the whole blob was loaded.
    assert src.reread_bytes == 0


def test_tampered_blob_hands_out_nothing(blob: tuple[Path, bytes, str]) -> None:
    _, data, digest = blob
    bad = _flip(data, len(data) - 3)  # inside the last tensor: the header still parses
    with pytest.raises(IntegrityError, match=r"registry://127\.0\.0\.1:5000/w/model@sha256:.*"
                       r"not sha256:[0-9a-f]{64}"):
        load(_source(digest, FakeRegistry(bad)), chunk_bytes=8192, concurrency=4)
    got: list[str] = []
    with pytest.raises(IntegrityError):
        for name, _ in iter_load(_source(digest, FakeRegistry(bad)), chunk_bytes=8192):
            got.append(name)
    assert got == []  # not one tensor, not even the ones whose bytes were fine


def test_tampered_bytes_outside_the_selection_are_still_caught(
        blob: tuple[Path, bytes, str]) -> None:
    path, data, digest = blob
    # The first tensor is fine; the change is at the end of the file, never selected.
    bad = _flip(data, len(data) - 3)
    client = FakeRegistry(bad)
    with pytest.raises(IntegrityError):
        load(_source(digest, client), select=["scalar.F32"])
    # An intact blob with the same selection loads, and the rest was read to verify it.
    src = _source(digest, FakeRegistry(data))
    stats = LoadStats()
    got = load(src, select=["scalar.F32"], stats=stats)
    assert_identical({"scalar.F32": load_file(str(path))["scalar.F32"]}, got)
    assert src.reread_bytes > 0 and stats.bytes < len(data)


def test_wrong_blob_is_refused(blob: tuple[Path, bytes, str], tmp_path: Path) -> None:
    _, _, digest = blob
    other = save({"x": torch.ones(64)}, tmp_path / "other.safetensors").read_bytes()
    with pytest.raises(IntegrityError, match="tampered or wrong blob"):
        load(_source(digest, FakeRegistry(other)))


def test_out_of_order_ranges_beyond_the_hold_bound(blob: tuple[Path, bytes, str]) -> None:
    """Ranges arriving before the cursor reaches them are held up to ``hold_bytes``; past that
    only their hash is kept and verify() reads them again, checking they did not change."""
    _, data, digest = blob
    pieces = [(o, min(4096, len(data) - o)) for o in range(0, len(data), 4096)]
    for hold in (0, 3 * 4096, 1 << 30):
        client = FakeRegistry(data)
        src = _source(digest, client, hold_bytes=hold)
        for offset, n in reversed(pieces):  # worst order: everything arrives early
            buf = bytearray(n)
            src.read_into(offset, [memoryview(buf)])
            assert bytes(buf) == data[offset : offset + n]
        src.verify()
        assert (src.reread_bytes > 0) == (hold < len(data))
    # A registry that answers differently the second time: the bytes used (first answer)
    # are what must match, so a good second answer does not hide a bad first one.
    client = FakeRegistry(_flip(data, len(data) - 100), second=data)
    src = _source(digest, client, hold_bytes=0)
    for offset, n in reversed(pieces):
        src.read_into(offset, [memoryview(bytearray(n))])
    with pytest.raises(IntegrityError, match="changed between two reads"):
        src.verify()


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000), hold=st.sampled_from([0, 16, 700, 1 << 20]),
       cuts=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), max_size=10),
       order=st.randoms(use_true_random=False))
def test_ordered_digest_any_order_overlap_and_gaps(data: bytes, hold: int,
                                                   cuts: list[tuple[float, float]],
                                                   order: Any) -> None:
    n = len(data)
    pieces = []
    for a, b in cuts:
        start = int(a * n)
        length = int(b * (n - start))
        if length:
            pieces.append((start, length))
    order.shuffle(pieces)
    digest = _OrderedDigest("sha256", hold)
    for start, length in pieces:
        digest.feed(start, data[start : start + length])
    got = digest.finish(n, lambda o, k: data[o : o + k], "blob")
    assert got == "sha256:" + hashlib.sha256(data).hexdigest()


def test_opener_passes_the_callers_timeout_to_the_registry_client() -> None:
    url = "registry://127.0.0.1:5000/w/model@sha256:" + "0" * 64
    with Opener(timeout=7.5) as opener:
        src = opener.open(url)
        try:
            assert isinstance(src, RegistrySource)
            assert src._client.timeout == 7.5
        finally:
            src.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present (CUDA unavailable)")
def test_registry_blob_to_cuda_is_verified(blob: tuple[Path, bytes, str],
                                           ) -> None:  # pragma: no cover
    path, data, digest = blob
    got = load(_source(digest, FakeRegistry(data)), device="cuda", chunk_bytes=8192,
               max_host_bytes=32768)
    assert all(t.is_cuda for t in got.values())
    assert_identical(load_file(str(path)), {n: t.cpu() for n, t in got.items()})
    with pytest.raises(IntegrityError):
        load(_source(digest, FakeRegistry(_flip(data, len(data) - 3))), device="cuda",
             chunk_bytes=8192, max_host_bytes=32768)
