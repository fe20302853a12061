"""The benchmarks' verified-bytes limit: every chunk of the file fetched, decoded and checked;
with ``into``, the file's bytes written where they belong."""

from __future__ import annotations

import io
import os
import random
import tarfile
from pathlib import Path
from typing import Any, cast

import pytest

from coldstart.benchmark import limits
from coldstart.errors import ColdstartError
from coldstart.format import BytesReadAt, open_layer
from tests.unit.format.layers import add, convert

NAME = "data/big.bin"


def _data() -> bytes:
    rnd = random.Random(5)
    words = [b"tensor ", b"weights ", b"\n", b"0x7f "]
    out = bytearray()
    while len(out) < (3 << 20) + 1234:     # a short last chunk
        out += rnd.randbytes(300) if rnd.random() < 0.3 else rnd.choice(words) * 40
    return bytes(out)


def _tar(data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "data/", type=tarfile.DIRTYPE)
        add(tf, NAME, data)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["zstd:chunked", "estargz"])
def test_every_chunk_is_verified_and_written_into_its_place(
        fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _data()
    c = convert(_tar(data), fmt, chunk_size=256 << 10)
    chunks = c.layer.resolve(NAME).chunks
    assert len(chunks) > 8
    monkeypatch.setattr(limits, "GROUP_BYTES", 600 << 10)     # several range reads
    blob = cast(Any, c.layer.blob)
    assert limits.verified_bytes(blob, c.layer, NAME, 3) == len(data)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert limits.verified_bytes(blob, c.layer, NAME, 3, into=fd) == len(data)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == data


def test_a_flipped_byte_fails_the_limit(tmp_path: Path) -> None:
    data = _data()
    c = convert(_tar(data), "zstd:chunked", chunk_size=256 << 10)
    victim = c.layer.resolve(NAME).chunks[5]
    spoiled = bytearray(c.blob)
    spoiled[(victim.offset + victim.end_offset) // 2] ^= 0x40
    layer = open_layer(BytesReadAt(spoiled), annotations=c.result.annotations)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ColdstartError):
            limits.verified_bytes(cast(Any, layer.blob), layer, NAME, 2, into=fd)
    finally:
        os.close(fd)


class _Resolved:
    def __init__(self, layers: list[Any]) -> None:
        self.manifest = type("M", (), {"layers": layers})()


def test_the_checkpoint_is_the_largest_safetensors_file_of_the_seekable_layers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``coldstart bench`` measures its limit on: only the layers' TOCs are read; a layer
    that is not seekable (plain gzip) is passed over."""
    from coldstart.format.layer import SeekableLayer

    small, big = _data()[:100_000], _data()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "model/", type=tarfile.DIRTYPE)
        add(tf, "model/a.safetensors", small)
        add(tf, "model/b.safetensors", big)
        add(tf, "model/c.bin", big + big)
    seekable = convert(buf.getvalue(), "zstd:chunked", chunk_size=256 << 10)
    other = convert(_tar(big), "zstd:chunked", chunk_size=256 << 10)
    opened = {"sha256:s": seekable.layer, "sha256:o": other.layer}

    def fake_open(blob: Any, annotations: Any = None) -> SeekableLayer:
        if blob.digest not in opened:
            raise ColdstartError("not a seekable layer")
        return opened[blob.digest]

    monkeypatch.setattr("coldstart.format.layer.open_layer", fake_open)
    descs = [type("D", (), {"digest": d, "size": 1, "annotations": {}})()
             for d in ("sha256:plain", "sha256:s", "sha256:o")]
    client = type("C", (), {"resolve": lambda self, ref: _Resolved(descs)})()
    found = limits.largest_weights(client, "ref")
    assert found is not None
    blob, layer, name = found
    assert (name, layer, blob.digest) == ("model/b.safetensors", seekable.layer, "sha256:s")
    monkeypatch.setattr(limits, "WEIGHTS_SUFFIX", ".none")
    assert limits.largest_weights(client, "ref") is None
