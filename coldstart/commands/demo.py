"""``coldstart demo``: the built-in demonstration (no arguments needed)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the image, registry data and logs here (default: a temporary "
                   "directory removed at the end).")
@click.option("--scale", type=click.FloatRange(0.05, 20.0), default=1.0, show_default=True,
              help="Multiply the demo image's size (1.0 is about 110 MB uncompressed).")
def demo(workdir: Path | None, scale: float) -> None:
    """Build a small image, serve it from a local registry, convert it to zstd:chunked and
    eStargz, and show how little of it a lazy start-up fetches.

    Needs Debian's docker-registry and busybox-static (scripts/install.sh installs them).
    """
    from coldstart.benchmark.demo import run_demo

    run_demo(click.echo, workdir=workdir, scale=scale)
