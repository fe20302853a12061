"""``coldstart weights``: load a safetensors checkpoint at source speed, or benchmark loading it."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import click

from coldstart.commands._common import (
    AliasChoice,
    check_authfile,
    echo_json,
    output_option,
    registry_options,
    split_commas,
)
from coldstart.config import SourceConfig, WeightsConfig
from coldstart.errors import InvalidArgument

_SOURCE = SourceConfig()
_WEIGHTS = WeightsConfig()
_MiB = 1 << 20
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
# torch's own names too: --dtype bfloat16 is what a PyTorch user types
_DTYPE_ALIASES = {**{v: k for k, v in _DTYPES.items()}, "half": "fp16", "float": "fp32",
                  "double": "fp64", "torch.bfloat16": "bf16", "torch.float16": "fp16",
                  "torch.float32": "fp32", "torch.float64": "fp64"}


def _source_help() -> str:
    return ("SOURCE is a .safetensors file, a model.safetensors.index.json, or a folder holding "
            "either: a local path, s3://BUCKET/KEY (standard AWS credentials, AWS_ENDPOINT_URL "
            "for S3-compatible stores; folders end with /), http(s)://URL (Range GETs) or "
            "registry://REGISTRY/REPO@sha256:DIGEST (a registry blob; oci:DIR means an OCI image "
            "layout in coldstart, as in skopeo).")


def _options(f: Any) -> Any:
    # Applied last-first, so --help lists them in this file's order.
    f = registry_options(f)
    f = click.option("--timeout", type=click.FloatRange(0.1), default=_SOURCE.timeout,
                     show_default=True, help="Deadline of each network request, seconds.")(f)
    f = click.option("--only", "only", multiple=True, metavar="NAME",
                     help="Load only this tensor (repeat for several).")(f)
    f = click.option("--cpu-mode", type=click.Choice(["auto", "mmap", "read"]), default="auto",
                     show_default=True,
                     help="Local files to cpu: mmap = copy-on-write map populated in parallel "
                          "(page cache views, no copy); read = preadv into fresh private "
                          "tensors; auto = mmap unless --direct.")(f)
    f = click.option("--direct", is_flag=True,
                     help="Local files: read with O_DIRECT (bypass the page cache).")(f)
    f = click.option("--max-host-mb", type=click.FloatRange(1), show_default=True,
                     default=_WEIGHTS.max_host_bytes / _MiB,
                     help="Cap on pinned staging memory for --device cuda, MiB.")(f)
    f = click.option("--chunk-mb", type=click.FloatRange(0.01), show_default=True,
                     default=_WEIGHTS.chunk_bytes / _MiB, help="Largest single read, MiB.")(f)
    f = click.option("--concurrency", "concurrency_alias", type=click.IntRange(1, 256),
                     hidden=True, help="Old name of --jobs.")(f)
    f = click.option("-j", "--jobs", "concurrency", type=click.IntRange(1, 256),
                     help="Parallel reads (threads; each read is one preadv, populate or ranged "
                          f"GET). Default: {_SOURCE.concurrency} for network sources, a few "
                          "per core for files.")(f)
    f = click.option("--dtype", type=AliasChoice(sorted(_DTYPES), _DTYPE_ALIASES),
                     help="Convert floating-point tensors to this dtype (on the device); "
                          "torch's names work too (bfloat16, float16, float32, float64).")(f)
    f = click.option("--device", default="cpu", show_default=True, metavar="cpu|cuda[:N]",
                     help="Where the tensors go. cuda streams through pinned staging buffers "
                          "with async host-to-device copies.")(f)
    return f


def _kwargs(device: str, dtype: str | None, concurrency: int | None, chunk_mb: float,
            max_host_mb: float, direct: bool, only: tuple[str, ...], timeout: float,
            cpu_mode: str, concurrency_alias: int | None = None,
            insecure: tuple[str, ...] = (), tls_verify: bool = True,
            authfile: Path | None = None, hosts_dir: Path | None = None) -> dict[str, Any]:
    import torch

    authfile = check_authfile(authfile)
    if concurrency is None:
        concurrency = concurrency_alias
    return {
        "device": device,
        "dtype": getattr(torch, _DTYPES[dtype]) if dtype else None,
        "concurrency": concurrency,
        "chunk_bytes": max(4096, int(chunk_mb * (1 << 20))),
        "max_host_bytes": int(max_host_mb * (1 << 20)),
        "direct": direct,
        "cpu_mode": cpu_mode,
        "select": list(only) or None,
        "timeout": timeout,
        "registry": {"insecure_hosts": split_commas(insecure), "tls_verify": tls_verify,
                     "docker_config": authfile, "hosts_dir": hosts_dir},
    }


def _load_once(source: str, kwargs: dict[str, Any], show_progress: bool) -> Any:
    from coldstart.commands._progress import Progress
    from coldstart.weights import LoadStats, load

    stats = LoadStats()
    expected = threading.Event()
    lock = threading.Lock()

    with Progress(["load"], quiet=not show_progress) as bar:
        def progress(n: int) -> None:    # called from the loader's reading threads
            if not expected.is_set():
                with lock:
                    if not expected.is_set():
                        bar.expect(stats.total_bytes)
                        expected.set()
            bar.advance("load", n)

        tensors = load(source, progress=progress if bar.drawing else None, stats=stats,
                       **kwargs)
    return tensors, stats


@click.group()
def weights() -> None:
    """Stream safetensors weights into CPU or GPU memory at the speed of the source."""


@weights.command("load", epilog=_source_help())
@click.argument("source")
@_options
@output_option("source, files, tensors, bytes, seconds, GB/s", json_alias=True)
@click.option("--list", "list_tensors", is_flag=True, help="Also print each tensor's name, "
              "dtype and shape.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def load_cmd(source: str, device: str, dtype: str | None, concurrency: int | None,
             concurrency_alias: int | None, chunk_mb: float, max_host_mb: float, direct: bool,
             cpu_mode: str, only: tuple[str, ...], timeout: float, hosts_dir: Path | None,
             insecure: tuple[str, ...], tls_verify: bool, authfile: Path | None, output: str,
             list_tensors: bool, quiet: bool) -> None:
    """Load SOURCE once and report tensors, bytes, time and GB/s.

    Example: coldstart weights load s3://models/llama/3/ --device cuda
    """
    from coldstart.weights.sources import check_not_layout

    check_not_layout(source)          # before torch is imported: a typo answers at once
    kwargs = _kwargs(device, dtype, concurrency, chunk_mb, max_host_mb, direct, only, timeout,
                     cpu_mode, concurrency_alias, insecure, tls_verify, authfile, hosts_dir)
    tensors, stats = _load_once(source, kwargs, show_progress=not quiet)
    report = {"source": source, "path": stats.path, "files": stats.files,
              "tensors": stats.tensors, "bytes": stats.bytes, "seconds": round(stats.seconds, 4),
              "gb_per_s": round(stats.gb_per_s, 3), "staging_bytes": stats.staging_bytes}
    if output == "json":
        if list_tensors:
            report["shapes"] = {n: [str(t.dtype).removeprefix("torch."), list(t.shape)]
                                for n, t in tensors.items()}
        echo_json(report)
        return
    if list_tensors:
        for name in sorted(tensors):
            t = tensors[name]
            click.echo(f"{name}\t{str(t.dtype).removeprefix('torch.')}\t{list(t.shape)}")
    click.echo(f"{stats.tensors} tensors from {stats.files} file(s), {stats.bytes / 1e9:.3f} GB "
               f"in {stats.seconds:.3f} s = {stats.gb_per_s:.2f} GB/s  [{stats.path}]")


@weights.command("bench", epilog=_source_help())
@click.argument("source")
@_options
@click.option("--runs", type=click.IntRange(1, 100), default=3, show_default=True,
              help="How many loads; the median is reported.")
@click.option("--evict", is_flag=True,
              help="Local files: drop them from the page cache before each run "
                   "(posix_fadvise DONTNEED) to measure cold reads.")
@output_option("source, each run's GB/s, the median", json_alias=True)
@click.option("--quiet", "-q", is_flag=True, help="No line per run on stderr.")
def bench_cmd(source: str, device: str, dtype: str | None, concurrency: int | None,
              concurrency_alias: int | None, chunk_mb: float, max_host_mb: float,
              direct: bool, cpu_mode: str, only: tuple[str, ...], timeout: float,
              hosts_dir: Path | None, insecure: tuple[str, ...], tls_verify: bool,
              authfile: Path | None, runs: int,
              evict: bool, output: str, quiet: bool) -> None:
    """Load SOURCE --runs times; report each run's GB/s and the median.

    Example: coldstart weights bench ./model.safetensors --runs 5 --evict
    """
    from coldstart.weights.sources import check_not_layout

    check_not_layout(source)
    kwargs = _kwargs(device, dtype, concurrency, chunk_mb, max_host_mb, direct, only, timeout,
                     cpu_mode, concurrency_alias, insecure, tls_verify, authfile, hosts_dir)
    if evict and "://" in source:
        raise InvalidArgument("--evict works on local files only")
    rates: list[float] = []
    path = ""
    for i in range(runs):
        if evict:
            _evict(source)
        started = time.perf_counter()
        tensors, stats = _load_once(source, kwargs, show_progress=False)
        del tensors
        rates.append(stats.bytes / (time.perf_counter() - started) / 1e9)
        path = stats.path
        if not quiet:
            click.echo(f"run {i + 1}: {stats.bytes / 1e9:.3f} GB at {rates[-1]:.2f} GB/s",
                       err=True)
    median = statistics.median(rates)
    if output == "json":
        echo_json({"source": source, "path": path, "runs": rates, "median_gb_per_s": median})
    else:
        click.echo(f"median of {runs}: {median:.2f} GB/s  [{path}]")


def _evict(source: str) -> None:
    files = [source]
    if os.path.isdir(source):
        files = [os.path.join(source, n) for n in os.listdir(source)
                 if n.endswith(".safetensors")]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
