"""Issue 11 end to end: ``coldstart optimize`` records a start-up on a real private node and
writes the image with that set first; the node prefetches it at mount; bad input fails in one
line and leaves nothing running or mounted; ``convert --profile`` applies a saved profile.

The image is the e2e pull tests' (busybox + three layers), pushed as gzip to the session's
registry. The workload reads two small files, lists a directory and 20 bytes across a 4 MiB
chunk boundary of a 5 MiB file; ``data/cold.bin`` and ``data/unread.bin`` are never read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coldstart.benchmark.optimize import NODE_PREFIX
from coldstart.format import BytesReadAt, open_layer
from coldstart.lazyfs.client import FuseServerClient
from coldstart.oci.convert import PREFETCH_FILES_ANNOTATION
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.prefetch.profile import SCHEMA, load_profile
from coldstart.prefetch.ranges import (
    CUT_ALIGN,
    PREFETCH_RANGES_ANNOTATION,
    chunk_cuts,
    decode_ranges,
)
from tests.fixtures.procs import mounts_under, processes_naming
from tests.fixtures.registry import Registry
from tests.integration.pull.pull_env import (
    UNREAD,
    WORKLOAD,
    PushedImage,
    coldstart_cli,
    lazy_stack,
    push_image,
    rich_layers,
    workload_expected,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def base(registry: Registry) -> PushedImage:
    with RegistryClient() as reg:
        return push_image(reg, f"{registry.host}/e2e-opt/app:gzip", rich_layers())


def _left_behind(work: Path) -> list[str]:
    """Processes or mounts of an optimize run (its files under ``work``, its node under
    /tmp/cs-optimize-*)."""
    return (processes_naming(str(work), f"/tmp/{NODE_PREFIX}")
            + mounts_under(str(work), f"/tmp/{NODE_PREFIX}"))


def _optimize(work: Path, src: str, dst: str, *args: str) -> tuple[int, str, str]:
    work.mkdir(exist_ok=True)
    proc = coldstart_cli("optimize", src, dst, "--workdir", str(work), *args, timeout=360)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def optimized(base: PushedImage, registry: Registry,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    tmp = tmp_path_factory.mktemp("optimize")
    dst = f"{registry.host}/e2e-opt/app:optimized"
    profile = tmp / "app.profile.json"
    code, out, err = _optimize(tmp / "work", base.ref, dst, "--profile-out", str(profile),
                               "--", "/bin/sh", "-c", WORKLOAD)
    assert code == 0, err
    assert out.startswith(f"{dst}@sha256:"), out
    return dst, profile, tmp / "work"


def test_optimize_records_the_start_up_and_cleans_up(
        optimized: tuple[str, Path, Path], base: PushedImage) -> None:
    _dst, path, work = optimized
    assert _left_behind(work) == []
    profile = load_profile(path)
    assert json.loads(path.read_text())["schema"] == SCHEMA
    assert [x.diff_id for x in profile.layers] == list(base.diff_ids)
    paths = [set(x.paths) for x in profile.layers]
    assert {"bin/busybox", "etc/hello.txt"} <= paths[0]
    assert "data/multi.bin" in paths[1]
    assert "data/small.txt" in paths[2]
    assert not any(u in p for u in UNREAD for p in paths)
    multi = next(f for f in profile.layers[1].files if f.path == "data/multi.bin")
    # head -c 4194314 | tail -c 20: the reads reach past the 4 MiB boundary
    assert multi.ranges and multi.ranges[-1][1] >= (4 << 20) + 10
    assert profile.seconds > 0


def test_optimized_layers_hold_the_recorded_files_first(
        optimized: tuple[str, Path, Path]) -> None:
    dst, path, _ = optimized
    profile = load_profile(path)
    with RegistryClient() as reg:
        resolved = reg.resolve(Reference.parse(dst))
        for i, desc in enumerate(resolved.manifest.layers):
            recorded = profile.layers[i].paths
            blob = reg.get_blob(Reference.parse(dst), desc.digest)
            toc = open_layer(BytesReadAt(blob), annotations=desc.annotations).toc
            regular = [n for n in toc.prefetch if toc.entries[n].type == "reg"]
            # the recorded files, in recorded order (parents and link targets may come along)
            assert [n for n in regular if n in recorded] == recorded
            assert not set(UNREAD) & set(toc.prefetch)
            assert desc.annotations[PREFETCH_FILES_ANNOTATION] == str(len(recorded))
            ranges = decode_ranges(desc.annotations[PREFETCH_RANGES_ANNOTATION])
            cuts = chunk_cuts(profile.layers[i].files)
            for f in profile.layers[i].files:
                entry = toc.entries[f.path]
                starts = {c.chunk_offset for c in entry.chunks}
                # a chunk starts at each edge of what the start-up read (inside the file)
                assert {x for x in cuts.get(f.path, ()) if x < entry.size} <= starts
                if f.ranges:
                    end = f.ranges[-1][1] + -f.ranges[-1][1] % CUT_ALIGN
                    assert end >= entry.size or end in starts
                for c in entry.chunks:
                    read = not f.ranges or any(a < c.chunk_offset + c.chunk_size
                                               and c.chunk_offset < b for a, b in f.ranges)
                    if read and not c.zeros:
                        assert any(a <= c.offset and c.end_offset <= b for a, b in ranges)


def test_optimized_image_is_prefetched_at_mount_and_runs(
        optimized: tuple[str, Path, Path]) -> None:
    dst, _, _ = optimized
    with lazy_stack() as stack:
        proc = coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", "opt", dst)
        assert proc.returncode == 0, proc.stderr
        run = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", dst, "opt-run",
                            "/bin/sh", "-c", WORKLOAD, namespace="opt")
        assert run.stdout == workload_expected(rich_layers())
        status = FuseServerClient(stack.fuse_socket).status()
        assert status and all(s["prefetch_done"] for s in status if s["prefetched_bytes"])
        assert sum(s["prefetched_bytes"] for s in status) > 0
        demand = sum(s["requests_by_kind"]["demand"] for s in status)
        prefetch = sum(s["requests_by_kind"]["prefetch"] for s in status)
        assert prefetch >= 1
        assert demand <= 2, status    # the recorded set came in bulk


def test_failing_workload_is_one_line_and_leaves_nothing(
        base: PushedImage, registry: Registry, tmp_path: Path) -> None:
    code, _, err = _optimize(tmp_path / "work", base.ref, f"{registry.host}/e2e-opt/app:fail",
                             "--", "/bin/sh", "-c", "cat /etc/hello.txt; exit 3")
    assert code != 0
    assert "exited with code 3" in err
    assert err.strip().splitlines()[-1].startswith("coldstart: error:")
    assert _left_behind(tmp_path / "work") == []


def test_never_ready_is_an_error(base: PushedImage, registry: Registry, tmp_path: Path) -> None:
    code, _, err = _optimize(tmp_path / "work", base.ref, f"{registry.host}/e2e-opt/app:never",
                             "--ready", "log:NEVER PRINTED", "--timeout", "4",
                             "--", "/bin/sh", "-c", "sleep 60")
    assert code != 0 and "not ready" in err
    assert _left_behind(tmp_path / "work") == []


def test_timeout_under_exit_keeps_what_was_read(
        base: PushedImage, registry: Registry, tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    code, _, err = _optimize(tmp_path / "work", base.ref, f"{registry.host}/e2e-opt/app:slow",
                             "--timeout", "5", "--profile-out", str(profile),
                             "--", "/bin/sh", "-c", "cat /etc/hello.txt; sleep 60")
    assert code == 0, err
    assert "warning" in err and "--timeout" in err
    assert "etc/hello.txt" in load_profile(profile).layers[0].paths
    assert _left_behind(tmp_path / "work") == []


def test_convert_profile_skips_files_not_in_the_image(
        base: PushedImage, registry: Registry, tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"schema": SCHEMA, "layers": [
        {"index": 0, "diff_id": base.diff_ids[0], "files": ["etc/hello.txt", "no/such/file"]},
    ]}))
    dst = f"{registry.host}/e2e-opt/app:by-profile"
    proc = coldstart_cli("convert", base.ref, dst, "--profile", str(profile))
    assert proc.returncode == 0, proc.stderr
    assert "1 profile file(s) not in the layer" in proc.stderr
    with RegistryClient() as reg:
        resolved = reg.resolve(Reference.parse(dst))
        first = resolved.manifest.layers[0]
        blob = reg.get_blob(Reference.parse(dst), first.digest)
        toc = open_layer(BytesReadAt(blob), annotations=first.annotations).toc
        assert toc.prefetch[-1] == "etc/hello.txt"
        # the other layers had no profile: no landmark
        for desc in resolved.manifest.layers[1:]:
            assert PREFETCH_FILES_ANNOTATION not in desc.annotations


@pytest.mark.parametrize("cut", [True, False])
def test_convert_profile_cuts_chunks_where_reads_end_unless_told_not_to(
        base: PushedImage, registry: Registry, tmp_path: Path, cut: bool) -> None:
    """A recorded read of the first 100 KiB of data/multi.bin (5 MiB + 4): with the cuts a
    chunk starts at 128 KiB; with ``--no-cut-chunks`` the file keeps its 4 MiB chunks."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"schema": SCHEMA, "layers": [
        {"index": 1, "diff_id": base.diff_ids[1],
         "files": [{"path": "data/multi.bin", "t": 0.0, "ranges": [[0, 100 << 10]]}]},
    ]}))
    dst = f"{registry.host}/e2e-opt/app:cut-{cut}"
    proc = coldstart_cli("convert", base.ref, dst, "--profile", str(profile),
                         *(() if cut else ("--no-cut-chunks",)))
    assert proc.returncode == 0, proc.stderr
    with RegistryClient() as reg:
        desc = reg.resolve(Reference.parse(dst)).manifest.layers[1]
        blob = reg.get_blob(Reference.parse(dst), desc.digest)
    toc = open_layer(BytesReadAt(blob), annotations=desc.annotations).toc
    starts = [c.chunk_offset for c in toc.entries["data/multi.bin"].chunks]
    assert starts == ([0, 128 << 10, (128 << 10) + (4 << 20)] if cut else [0, 4 << 20])
    # the prefetch takes the first chunk only: 128 KiB of it with the cuts, 4 MiB without
    ranges = decode_ranges(desc.annotations[PREFETCH_RANGES_ANNOTATION])
    first = toc.entries["data/multi.bin"].chunks[0]
    assert any(a <= first.offset and first.end_offset <= b for a, b in ranges)


@pytest.mark.parametrize("text", ["", "{oops", '{"schema": "x", "layers": []}'])
def test_convert_refuses_a_bad_profile(base: PushedImage, registry: Registry, tmp_path: Path,
                                       text: str) -> None:
    profile = tmp_path / "p.json"
    profile.write_text(text)
    proc = coldstart_cli("convert", base.ref, f"{registry.host}/e2e-opt/app:bad",
                         "--profile", str(profile))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(profile) in lines[0], proc.stderr



def test_profile_rides_with_an_image_that_is_not_reordered(
        optimized: tuple[str, Path, Path], base: PushedImage, registry: Registry) -> None:
    """``convert --profile --keep-layers``: the seekable layers stay byte for byte, only
    annotated with the touched chunks; a node prefetches those at mount all the same."""
    _, path, _ = optimized
    plain = f"{registry.host}/e2e-opt/app:zstd"
    kept = f"{registry.host}/e2e-opt/app:annotated"
    assert coldstart_cli("convert", base.ref, plain).returncode == 0
    proc = coldstart_cli("convert", plain, kept, "--profile", str(path), "--keep-layers")
    assert proc.returncode == 0, proc.stderr
    with RegistryClient() as reg:
        before = reg.resolve(Reference.parse(plain)).manifest.layers
        after = reg.resolve(Reference.parse(kept)).manifest.layers
    assert [d.digest for d in after] == [d.digest for d in before]
    assert all(PREFETCH_RANGES_ANNOTATION in d.annotations for d in after[:2])
    with lazy_stack() as stack:
        assert coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", "keep",
                             kept).returncode == 0
        run = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", kept, "keep-run",
                            "/bin/sh", "-c", WORKLOAD, namespace="keep")
        assert run.stdout == workload_expected(rich_layers())
        status = FuseServerClient(stack.fuse_socket).status()
        assert sum(s["requests_by_kind"]["prefetch"] for s in status) >= 2
        assert sum(s["requests_by_kind"]["demand"] for s in status) <= 2, status
