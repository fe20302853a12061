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


def test_the_fill_plan_is_made_as_it_is_fetched(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan makes one entry at a time, not kept (a layer's chunks are never held as one
    list): the first chunk comes after a few entries are made, and no pass over the layer
    leaves entries in the TOC's cache."""
    from coldstart.format.toc import TOCEntries

    tree = metadata_tar()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tree.tar)
    made: list[int] = []
    real = TOCEntries.made
    monkeypatch.setattr(TOCEntries, "made", lambda self, i: made.append(i) or real(self, i))
    order = reader.fill.fill_order()
    next(order)
    assert 0 < len(made) <= 3
    rest = list(order)
    regs = sum(1 for t in reader.layer.toc.entries.types if t == "reg")
    assert len(rest) > 100 and regs <= len(made) <= regs + 10
    assert not reader.layer.toc.entries._made        # nothing kept


def test_the_fill_waits_while_the_node_lists_and_stats(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata requests (a find's listings and getattrs) count as the node being busy: the
    fill fetches nothing while they come, and goes on once they pause."""
    import threading

    from coldstart.lazyfs import fetcher as fetcher_module

    monkeypatch.setattr(fetcher_module, "QUIET_SECONDS", 3.0)
    tree = metadata_tar()
    reader, src, fetcher = make(tmp_path, "zstd:chunked", tar=tree.tar)
    reader.fill.rate = 1 << 40
    busy, tick = threading.Event(), threading.Event()
    busy.set()

    def lister() -> None:               # FuseFS.readdir / getattr call note_read
        while busy.is_set():
            fetcher.note_read()
            tick.wait(0.05)
    t = threading.Thread(target=lister, daemon=True)
    t.start()
    done = threading.Thread(target=reader.fill.fetch_rest, daemon=True)
    done.start()
    done.join(1.5)
    assert done.is_alive() and src.counting.requests == 0      # held the whole time
    busy.clear()
    t.join(10)
    done.join(60)
    assert not done.is_alive() and src.counting.requests > 0
    assert reader.stats.as_dict()["state"] == "complete"


def test_a_layer_unmounted_during_the_last_check_is_not_called_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill's last pass checks that nothing is missing; a layer no longer served cuts
    that pass short, and a pass cut short must not say the layer is complete."""
    from coldstart.lazyfs import fill as fill_module
    monkeypatch.setattr(fill_module, "PLAN_STEP", 1)     # the pass asks about stopping often
    tree = metadata_tar()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tree.tar)
    reader.fill.rate = 1 << 40
    fill = reader.fill
    real_order, real_pause = fill.fill_order, fill._pause
    passes: list[int] = []

    def fill_order():  # type: ignore[no-untyped-def]
        passes.append(1)
        return real_order()

    def pause() -> bool:
        if len(passes) == 3:            # the last check has begun: the layer is unmounted
            fill.target.stopped.set()
        return real_pause()

    monkeypatch.setattr(fill, "fill_order", fill_order)
    monkeypatch.setattr(fill, "_pause", pause)
    assert fill.fetch_rest() > 0
    assert len(passes) == 3            # measured, fetched, checked
    state = reader.stats.as_dict()
    assert state["state"] == "on-demand", state
