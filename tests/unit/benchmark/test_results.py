"""The bench result document: summaries, the schema it promises, the table, the PNG."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from coldstart.benchmark.results import (
    SCHEMA_PATH,
    BenchResult,
    Floor,
    Limit,
    ModeResult,
    Phase,
    Run,
    describe_floor,
    describe_limit,
    plot_timeline,
    render_table,
    to_json,
)


def _run(mode: str, i: int, pull: float, app: float, nbytes: int) -> Run:
    phases = [Phase("resolve", 0, 0.01), Phase("pull", 0.01, 0.01 + pull),
              Phase("create", 0.01 + pull, 0.05 + pull), Phase("start", 0.05 + pull, 0.1 + pull),
              Phase("importing", 0.1 + pull, 0.1 + pull + app)]
    return Run(mode, i, phases=phases, ready_s=phases[-1].end_s, exit_code=0,
               registry_bytes=nbytes, registry_requests=10 + i,
               cpu_s={"containerd": 1.0 + i, "client": 0.5})


def _result() -> BenchResult:
    res = BenchResult(image={"ref": "builtin:tiny", "formats": {}}, node="embedded",
                      ready="notify",
                      link={"text": "1gbit,2ms", "rate_bps": 1e9, "rtt_s": 0.002},
                      runs_per_mode=3, machine={"cpus": 2}, started_at="2026-12-01T00:00:00")
    res.modes["overlayfs"] = ModeResult("overlayfs", runs=[_run("overlayfs", i, 8 + i, 2, 300)
                                                           for i in range(3)])
    res.modes["coldstart"] = ModeResult("coldstart", runs=[_run("coldstart", i, 1, 3 + i, 100)
                                                           for i in range(3)])
    res.modes["coldstart"].runs.append(Run("coldstart", 3, ok=False, error="boom"))
    res.modes["stargz"] = ModeResult("stargz", status="skipped", reason="no go on PATH")
    res.floor = Floor(warm_start_s=2.0, startup_bytes=100, link_s=0.5, total_s=2.5)
    return res


def test_document_matches_its_schema() -> None:
    doc = to_json(_result())
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema)
    # and a broken document does not
    doc["modes"]["coldstart"]["status"] = "maybe"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


def test_summary_medians_speedup_and_floor() -> None:
    doc = to_json(_result())
    cs = doc["modes"]["coldstart"]["summary"]
    base = doc["modes"]["overlayfs"]["summary"]
    assert cs["ok_runs"] == 3 and cs["failed_runs"] == 1
    assert cs["ready_s"]["median"] == pytest.approx(0.1 + 1 + 4)
    assert base["ready_s"]["median"] == pytest.approx(0.1 + 9 + 2)
    assert cs["ready_s"]["min"] == pytest.approx(4.1) and cs["ready_s"]["max"] == pytest.approx(6.1)
    assert cs["speedup_vs_baseline"] == pytest.approx(11.1 / 5.1)
    assert cs["over_floor"] == pytest.approx(5.1 / 2.5)
    assert cs["phases"]["pull"]["median"] == pytest.approx(1.0)
    assert cs["cpu_total_s"]["median"] == pytest.approx(2.5)
    assert doc["modes"]["stargz"]["summary"] == {"ok_runs": 0, "failed_runs": 0,
                                                 "speedup_vs_baseline": None}


def test_table_has_a_row_per_mode_and_says_why_one_was_skipped() -> None:
    table = render_table(to_json(_result()))
    lines = table.splitlines()
    assert lines[0].startswith("| mode | READY | speed-up | resolve | pull | create | start |")
    assert any(ln.startswith("| coldstart | **5.10 s (4.10-6.10)** | 2.18x |") for ln in lines)
    assert "| stargz | skipped: no go on PATH |" in table
    assert describe_floor(to_json(_result())) == (
        "floor: warm start 2.00 s + 0.0 MB at 1gbit,2ms (0.50 s) = 2.50 s")
    # warm starts measured round by round: how many and their spread
    res = _result()
    res.floor = Floor(warm_start_s=2.0, startup_bytes=100, link_s=0.5, total_s=2.5,
                      warm_runs_s=[2.1, 1.9, 2.0])
    doc = to_json(res)
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))
    assert doc["floor"]["warm_runs_s"] == [2.1, 1.9, 2.0]
    assert describe_floor(doc) == ("floor: warm start 2.00 s (median of 3, 1.90-2.10) + 0.0 MB "
                                   "at 1gbit,2ms (0.50 s) = 2.50 s")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    out = tmp_path / "t.png"
    plot_timeline(to_json(_result()), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_limit_puts_each_loading_phase_against_the_checkpoint_at_its_rate() -> None:
    res = _result()
    for m in ("overlayfs", "coldstart"):
        for r in res.modes[m].ok_runs():
            end = r.phases[-1].end_s
            r.phases.append(Phase("loading", end, end + 4.0))
            r.ready_s = end + 4.0
    assert describe_limit(to_json(res)) is None
    res.limit = Limit(file="model/model.safetensors", bytes=2_000_000_000, gbps=0.5,
                      runs_gbps=[0.4, 0.5, 0.6])
    doc = to_json(res)
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))
    assert doc["limit"]["seconds"] == pytest.approx(4.0)
    assert doc["modes"]["coldstart"]["summary"]["loading_over_limit"] == pytest.approx(1.0)
    assert "loading_over_limit" not in doc["modes"]["stargz"]["summary"]
    assert describe_limit(doc) == ("verified-bytes limit: 0.500 GB/s (median of 3, "
                                   "0.400-0.600), model/model.safetensors (2.00 GB: 4.00 s "
                                   "at that rate)")


def test_warm_cache_runs_carry_their_verdict_and_meet_the_local_cache_floor() -> None:
    from coldstart.benchmark.results import describe_floor_cache

    res = _result()
    runs = [_run("coldstart+warmcache", i, 1, 1.5 + i, 120) for i in range(3)]
    for r, v in zip(runs, ("hit", "hit", "partial"), strict=True):
        r.warmup = {"restore": {"status": "restored", "fetched_bytes": 900_000},
                    "verdict": {"verdict": v, "reason": "…", "evidence": {"compiled": 0}}}
    res.modes["coldstart+warmcache"] = ModeResult("coldstart+warmcache", runs=runs)
    res.floor_cache = Floor(warm_start_s=2.0, startup_bytes=None, link_s=0.0, total_s=2.0,
                            warm_runs_s=[2.1, 2.0, 1.9])
    doc = to_json(res)
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))
    s = doc["modes"]["coldstart+warmcache"]["summary"]
    assert s["warmup"] == {"hit": 2, "partial": 1}
    assert s["warmup_fetched_bytes"]["median"] == 900_000
    assert s["over_floor_cache"] == pytest.approx((0.1 + 1 + 2.5) / 2.0)
    assert doc["modes"]["coldstart+warmcache"]["runs"][0]["warmup"]["verdict"]["verdict"] == "hit"
    table = render_table(doc)
    assert table.splitlines()[0].endswith("| warm-up cache |")
    assert any(ln.startswith("| coldstart+warmcache |") and ln.endswith("| 2 hit, 1 partial |")
               for ln in table.splitlines())
    assert describe_floor_cache(doc) == ("floor with the compile caches local: warm start "
                                         "2.00 s (median of 3, 1.90-2.10)")
    assert describe_floor_cache(to_json(_result())) is None


def test_the_floors_keep_their_phase_medians() -> None:
    from coldstart.benchmark.results import phase_medians

    runs = [_run("floor", i, 0.0, 2 + i, 0) for i in range(3)] + [Run("floor", 3, ok=False)]
    got = phase_medians(runs)
    assert list(got) == ["resolve", "pull", "create", "start", "importing"]
    assert got["importing"] == pytest.approx(3.0)
    res = _result()
    res.floor_cache = Floor(warm_start_s=2.0, startup_bytes=None, link_s=0.0, total_s=2.0,
                            phases_s=got)
    doc = to_json(res)
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))
    assert doc["floor_cache"]["phases_s"]["importing"] == pytest.approx(3.0)
    assert phase_medians([]) == {}
