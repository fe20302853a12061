"""``coldstart demo``: the built-in demonstration (no arguments needed)."""

from __future__ import annotations

from pathlib import Path

import click

from coldstart.commands._common import echo_json, output_option


@click.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the image, registry data and logs here (default: a temporary "
                   "directory removed at the end).")
@click.option("--scale", type=click.FloatRange(0.05, 20.0), default=1.0, show_default=True,
              help="Multiply the demo image's size (1.0 is about 110 MB uncompressed).")
@output_option("the figures the narration gives (sizes, seconds, bytes fetched); the "
               "narration goes to stderr")
@click.option("--quiet", "-q", is_flag=True, help="No narration (with -o json: only the JSON).")
def demo(workdir: Path | None, scale: float, output: str, quiet: bool) -> None:
    """Build a small image, serve it from a local registry, convert it to zstd:chunked and
    eStargz, and show how little of it a lazy start-up fetches.

    Needs Debian's docker-registry and busybox-static (scripts/install.sh installs them).
    """
    from coldstart.benchmark.demo import run_demo

    def narrate(line: str) -> None:
        if not quiet:
            click.echo(line, err=output == "json")

    figures = run_demo(narrate, workdir=workdir, scale=scale)
    if output == "json":
        echo_json(figures)
