"""Background fetch of the rest of a layer: everything ends local, at the configured rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldstart.format.readat import BytesReadAt, CountingReadAt
from tests.integration.lazy.lazy_helpers import metadata_tar
from tests.unit.lazy.test_lazy_reader import FORMATS, make, read_all


class FakeClock:
    """An injectable clock: ``sleep`` advances it instead of waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.now += seconds


@pytest.mark.parametrize("fmt", FORMATS)
def test_fetch_rest_makes_every_file_local(tmp_path: Path, fmt: str) -> None:
    tree = metadata_tar()
    reader, src, _ = make(tmp_path, fmt, tar=tree.tar)
    reader.fill.rate = 1 << 40
    fetched = reader.fill.fetch_rest()
    assert fetched > 0
    assert reader.stats.background_done
    requests = src.counting.requests
    for name, data in tree.files.items():
        assert read_all(reader, name) == data, name
    assert src.counting.requests == requests      # every read came from the cache
    # a second pass has nothing left to fetch
    assert reader.fill.fetch_rest() == 0


def test_fetch_rest_is_off_at_rate_zero(tmp_path: Path) -> None:
    reader, src, _ = make(tmp_path, "zstd:chunked")
    reader.fill.rate = 0
    assert reader.fill.fetch_rest() == 0
    assert src.counting.requests == 0
    assert not reader.stats.background_done


def test_fetch_rest_keeps_to_its_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from coldstart.lazyfs import fill as fill_module

    request = 16 << 10
    monkeypatch.setattr(fill_module, "BACKGROUND_REQUEST", request)
    reader, _, _ = make(tmp_path, "zstd:chunked", chunk_size=8 << 10)
    rate = 32 << 10
    reader.fill.rate = rate
    clock = FakeClock()
    fetched = reader.fill.fetch_rest(clock=clock.clock, sleep=clock.sleep)
    # enough requests for pacing to matter
    unpaced = fill_module.BACKGROUND_DEPTH * (request + (8 << 10))
    assert fetched > 4 * unpaced
    # no time passes but the sleeps: they must pace the bytes at the rate (the requests
    # still outstanding at the end are not waited for)
    assert clock.slept >= (fetched - unpaced) / rate
    assert clock.slept <= fetched / rate + 1e-6


def test_counting_wrapper_is_what_make_uses(tmp_path: Path) -> None:
    # guards the tests above: `make` must count through CountingReadAt over the blob
    _, src, _ = make(tmp_path, "estargz")
    assert isinstance(src.counting, CountingReadAt)
    assert isinstance(src.counting.inner, BytesReadAt)
