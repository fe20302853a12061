"""``coldstart bench-image``: build and list the reproducible images ``coldstart bench`` runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import click

from coldstart.commands._common import echo_json, output_option
from coldstart.errors import InvalidArgument

__all__ = ["bench_image"]

_CACHE_HELP = ("Where the images are kept (default: $COLDSTART_BENCH_IMAGES, else bench/images "
               "in a checkout, else ~/.cache/coldstart/bench-images).")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _progress(name: str, quiet: bool) -> Callable[[str], None]:
    def echo(line: str) -> None:
        if not quiet:
            click.echo(f"{name}: {line}", err=True)
    return echo


@click.group("bench-image")
def bench_image() -> None:
    """Build and list the images `coldstart bench` runs.

    Each is built on this machine, reproducibly (fixed seeds, mtimes and entry order), into an
    OCI layout directory with gzip layers (tag "latest"), and cached: a second build reuses it.

    \b
      tiny       busybox + an 80 MB demo app; seconds to build
      torch      Debian 12 (debootstrap) + python3 + torch 2.13.0 CPU, ~1.1 GB (needs root and
                 debootstrap; downloads ~300 MB once)
      server     torch + 2.7 GB of bf16 weights + a model server (sd_notify, GET /infer)
      cuda-like  15.7 GB shaped like a CUDA PyTorch server image; a few minutes to build
      compile    torch + g++ + an app that compiles a small transformer at start
                 (torch.compile, Inductor's C++ backend; COMPILE_MODE=jit|aoti)
    """


@bench_image.command("build")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              envvar="COLDSTART_BENCH_IMAGES", help=_CACHE_HELP)
@click.option("--force", is_flag=True,
              help="Build again even if a complete build is cached (downloads and the Debian "
                   "rootfs under <cache>/_build are still reused; delete it to redo them).")
@output_option("a list with one object per image: name, layout, command, ready, env, "
               "sizes, description")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def build(names: tuple[str, ...], cache_dir: Path | None, force: bool, output: str,
          quiet: bool) -> None:
    """Build the images NAME... (or find them cached) and print where they are.

    Progress goes to stderr; stdout gets, per image, its layout directory and sizes (or JSON
    with -o json). server and cuda-like build torch first if it is not built.

    \b
    Examples:
      coldstart bench-image build tiny
      coldstart bench-image build torch server -o json
      coldstart bench-image build cuda-like --cache-dir /data/bench-images
    """
    from coldstart.benchmark.images import BUILTIN, build_image

    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise InvalidArgument(f"unknown bench image {unknown[0]!r} "
                              f"(built-in: {', '.join(BUILTIN)})")
    built = []
    for name in dict.fromkeys(names):
        t0 = time.monotonic()
        image = build_image(name, cache_dir, force=force, progress=_progress(name, quiet))
        built.append(image.to_json())
        if output == "text":
            click.echo(f"{image.name}\t{image.layout}\t{_size(image.uncompressed_bytes)} "
                       f"uncompressed, {_size(image.compressed_bytes)} gzip\t"
                       f"({time.monotonic() - t0:.1f} s)")
    if output == "json":
        echo_json(built)


@bench_image.command("list")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              envvar="COLDSTART_BENCH_IMAGES", help=_CACHE_HELP)
@output_option("a list of {name, description, built, and the built image's fields}")
def list_images(cache_dir: Path | None, output: str) -> None:
    """List the built-in images, whether each is built, and their sizes."""
    from coldstart.benchmark.images import BUILTIN, default_cache_dir, load_image

    cache = cache_dir if cache_dir is not None else default_cache_dir()
    rows = []
    for name, description in BUILTIN.items():
        image = load_image(name, cache)
        row: dict[str, object] = {"name": name, "description": description,
                                  "built": image is not None}
        if image is not None:
            row.update(image.to_json())
        rows.append(row)
    if output == "json":
        echo_json(rows)
        return
    click.echo(f"{'NAME':<10} {'BUILT':<5} {'UNCOMPRESSED':>12} {'GZIP':>10}  DESCRIPTION")
    for row in rows:
        un = _size(int(str(row["uncompressed_bytes"]))) if row["built"] else "-"
        gz = _size(int(str(row["compressed_bytes"]))) if row["built"] else "-"
        click.echo(f"{row['name']!s:<10} {'yes' if row['built'] else 'no':<5} {un:>12} "
                   f"{gz:>10}  {row['description']}")
    click.echo(f"(cache: {cache})")
