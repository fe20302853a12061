"""``coldstart bench REF``: the whole cold start of an image, to READY, phase by phase, in each
mode (containerd's full pull into overlayfs, coldstart's lazy pull, stargz-snapshotter), with the
speed-up over the full pull and the floor."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from coldstart.benchmark import HOT_MEMORY_BYTES, SETTLE_S
from coldstart.benchmark.ready import CONDITIONS_HELP
from coldstart.commands._common import output_option, split_commas
from coldstart.commands._signals import signals_unwind

if TYPE_CHECKING:
    from coldstart.benchmark.results import Run

__all__ = ["bench"]

_EPILOG = """\b
REF is one of:
  builtin:NAME       a built-in image (tiny, torch, server, cuda-like, compile), built
                     once and cached (see `coldstart bench-image`)
  oci:DIR[:TAG]      an OCI image layout (gzip layers)
  REGISTRY/REPO:TAG  an image in a registry; its converted copies are pushed beside it
                     (REPO:TAG-zstd-chunked, REPO:TAG-estargz) unless --image names them

\b
--ready CONDITION, when the container counts as ready:
{ready}
\b
Examples:
  coldstart bench builtin:tiny --embedded --runs 3
  coldstart bench builtin:server --embedded --link 1gbit,2ms --json server.json --plot server.png
  coldstart bench builtin:compile --mode overlayfs,coldstart,coldstart+warmcache

\b
Every run starts on a fresh node: a new containerd (empty content store and snapshots), a new
snapshotter with an empty chunk cache, the page cache dropped. The modes alternate. Needs
root. The JSON schema is coldstart/benchmark/result_schema.json.
""".replace("{ready}", CONDITIONS_HELP)




@click.command(epilog=_EPILOG)
@click.argument("ref")
@click.option("--mode", "modes", default="overlayfs,coldstart,stargz", show_default=True,
              metavar="MODE[,MODE…]",
              # our ablations (coldstart+profile-nowarm, -grid, -xattrs) are accepted too but
              # not listed: they are A/B variants for bench/ scripts (see docs/bench.md)
              help="Modes to compare: overlayfs (containerd's full pull: the baseline), "
                   "coldstart (lazy pull, chunks on demand), coldstart+weights (the same, "
                   "the app loading its weights through coldstart.weights and the node's "
                   "files socket), stargz (stargz-snapshotter, "
                   "eStargz), stargz-optimized (its ctr-remote optimized image), "
                   "coldstart+profile (the image from coldstart optimize), coldstart+fill "
                   "(the same with the hybrid fill), coldstart+ctr-profile (coldstart on "
                   "ctr-remote's optimized image), coldstart+warmcache, "
                   "coldstart+profile+warmcache and coldstart+fill+warmcache (the app "
                   "under `coldstart warmup run`: its compile caches restored from their "
                   "warm-up artifact, made by one untimed "
                   "start first; the floor then also takes warm starts with the caches "
                   "already on the node, `floor+cache`). The image must ship the coldstart "
                   "package for the warm-cache modes (builtin:compile does). "
                   "Snapshot modes: coldstart+snapshot-lazy (CRIU's lazy pages), "
                   "coldstart+snapshot, coldstart+snapshot+fill (the hybrid fill on), "
                   "coldstart+profile+snapshot (on the profile's image): the "
                   "container restored from "
                   "the image's snapshot by coldstart-runc (made by one untimed start first, "
                   "checkpointed at READY; READY must come from a process that stays: not "
                   "exit). Needs CRIU >= 4.2.")
@click.option("--runs", "-n", default=5, show_default=True, type=click.IntRange(1, 1000),
              help="Cold starts per mode.")
@click.option("--ready", default=None, metavar="CONDITION",
              help="When the container is ready (see below); default: the built-in image's, "
                   "else exit.")
@click.option("--command", "command", default=None, metavar="'ARGV…'",
              help="Start-up command (shell words); default: the built-in image's.")
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE",
              help="Extra environment for the container (repeatable).")
@click.option("--link", default=None, metavar="RATE,RTT",
              help="Shape registry traffic through a built-in proxy, e.g. 1gbit,2ms or "
                   "200mbit,20ms.")
@click.option("--embedded", is_flag=True,
              help="Start a private containerd, our snapshotter (and stargz) in a temp root, "
                   "and a local registry for built-in/OCI-layout images; all removed afterwards.")
@click.option("--address", default=None, metavar="SOCK", envvar="CONTAINERD_ADDRESS",
              show_envvar=True,
              help="Use this running containerd (its snapshotters named coldstart/stargz) "
                   "instead of --embedded; images are removed between runs, chunk caches "
                   "are not.")
@click.option("--image", "images", multiple=True, metavar="MODE=REF",
              help="The image a mode pulls, instead of converting REF (repeatable).")
@click.option("--insecure", multiple=True, metavar="HOST[:PORT]",
              help="Registry spoken to over plain HTTP (repeatable or comma list; loopback "
                   "always is). A registry that needs credentials or a private CA: copy the "
                   "image into an OCI layout first (coldstart convert … oci:DIR) and bench that.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write the results here (schema: result_schema.json).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Draw the phases per mode into this PNG (needs matplotlib).")
@output_option("the whole result, as --json FILE writes it")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              envvar="COLDSTART_BENCH_IMAGES", show_envvar=True,
              help="Built-in images and the local registry's storage.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the nodes live while it runs (default: a temp dir in /tmp).")
@click.option("--timeout", default=900.0, show_default=True, type=float,
              help="Seconds one cold start may take before it counts as failed.")
@click.option("--settle", default=SETTLE_S, show_default=True, type=float,
              help="Seconds to wait after dropping the page cache (same for every mode and "
                   "the floor). On a VM with free page reporting, freed pages go back to the "
                   "host about two seconds later; a shorter rest lets a run's speed depend on "
                   "how much the run before it freed.")
@click.option("--memory", type=click.Choice(["settled", "hot"]), default="settled",
              show_default=True,
              help="The guest's free memory at each run's start (every mode and the floor "
                   "alike). settled: as the --settle rest leaves it. hot: then up to 3 GiB "
                   "(half the available memory or the cgroup's room at most) written and "
                   "freed, so that what the run allocates first (the page cache, the app) is "
                   "still backed by the host (for about 2 s: freed pages go back). On a "
                   "VM with free page reporting a settled page is backed again on its first "
                   "write: a disk read's DMA pays that in the VMM, a CPU copy (FUSE) on the "
                   "guest's own cores.")
@click.option("--no-floor", is_flag=True,
              help="Skip the warm starts that measure the floor (one per round, alternated "
                   "with the modes; each on a fresh node that first pulls the image in full, "
                   "not timed).")
@click.option("--no-limit", is_flag=True,
              help="Skip the verified-bytes limit (one per round, alternated with the modes): "
                   "the image's largest *.safetensors file fetched from the same registry, "
                   "through the same link, decoded and verified in parallel and dropped: "
                   "the ceiling each mode's loading phase is put against "
                   "(loading_over_limit). Measured when the image holds such a file and a "
                   "zstd:chunked mode runs.")
@click.option("--estargz-level", type=click.IntRange(1, 9), default=None,
              help="gzip level of the eStargz images ctr-remote makes (default: its own, 9; "
                   "1 converts a multi-GB image several times faster).")
@click.option("--prepare-only", is_flag=True,
              help="Build, push and convert the image for each mode (cached), then stop.")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def bench(ref: str, modes: str, runs: int, ready: str | None, command: str | None,
          env: tuple[str, ...], link: str | None, embedded: bool, address: str | None,
          images: tuple[str, ...], insecure: tuple[str, ...], json_path: Path | None,
          plot_path: Path | None, output: str, cache_dir: Path | None, workdir: Path | None,
          timeout: float, settle: float, memory: str, no_floor: bool, no_limit: bool,
          estargz_level: int | None,
          prepare_only: bool, quiet: bool) -> None:
    """Measure the cold start of REF to READY, phase by phase, in each mode."""
    import shlex

    from coldstart.benchmark.node import hot_memory_bytes
    from coldstart.benchmark.ready import parse_ready
    from coldstart.benchmark.results import (
        describe_floor,
        describe_floor_cache,
        describe_limit,
        plot_timeline,
        render_table,
        to_json,
        write_json,
    )
    from coldstart.benchmark.runner import BenchOptions, parse_modes, run_bench
    from coldstart.benchmark.shaping import Link
    from coldstart.errors import InvalidArgument

    # every argument is checked before anything starts
    mode_list = parse_modes(modes)
    if ref.startswith("builtin:"):
        from coldstart.benchmark.images import BUILTIN

        if ref.removeprefix("builtin:") not in BUILTIN:
            raise InvalidArgument(f"unknown bench image {ref.removeprefix('builtin:')!r} "
                                  f"(built-in: {', '.join(BUILTIN)}; see `coldstart "
                                  "bench-image list`)")
    try:
        argv = shlex.split(command) if command else []
    except ValueError as exc:
        raise InvalidArgument(f"--command {command!r}: {exc}") from exc
    for e in env:
        if "=" not in e or e.startswith("="):
            raise InvalidArgument(f"--env {e!r}: expected KEY=VALUE")
    for path in (json_path, plot_path):
        if path is not None and not path.resolve().parent.is_dir():
            raise InvalidArgument(f"{path}: its directory does not exist")
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgument("--plot needs matplotlib (pip install 'coldstart[plot]')")
    if ready is not None:
        parse_ready(ready)
    shaped = Link.parse(link) if link else None
    overrides: dict[str, str] = {}
    for item in images:
        mode, sep, image_ref = item.partition("=")
        if not sep or not image_ref:
            raise InvalidArgument(f"--image {item!r}: expected MODE=REF")
        overrides[parse_modes(mode)[0]] = image_ref
    if timeout <= 0 or settle < 0:
        raise InvalidArgument("--timeout must be > 0 and --settle >= 0")
    if not embedded and address is None:
        raise InvalidArgument("say where to run: --embedded (a private containerd) or "
                              "--address SOCK")
    if embedded:
        address = None
    opts = BenchOptions(ref=ref, modes=mode_list, runs=runs, ready=ready,
                        command=argv, env=env, link=shaped,
                        address=address, workdir=workdir, cache_dir=cache_dir,
                        images=overrides, insecure=tuple(split_commas(insecure)),
                        timeout=timeout, settle=settle,
                        heat=hot_memory_bytes(HOT_MEMORY_BYTES) if memory == "hot" else 0,
                        floor=not no_floor, limit=not no_limit, prepare_only=prepare_only,
                        estargz_level=estargz_level)
    with signals_unwind(), _Progress(quiet, runs * len(mode_list)) as progress:
        result = run_bench(opts, progress)
    doc = to_json(result)
    if prepare_only:
        for name, fmt in doc["image"]["formats"].items():
            click.echo(f"{name}: {fmt['ref']} ({(fmt['compressed_bytes'] or 0) / 1e6:.1f} MB)")
        return
    if output == "json":
        click.echo(json.dumps(doc, indent=2))
    else:
        link_text = f" at {doc['link']['text']}" if doc["link"] else ""
        click.echo(f"{ref}{link_text}: time to READY ({doc['ready']}), medians (min-max) of "
                   f"{runs} runs, speed-up over {doc['baseline']}")
        click.echo(render_table(doc))
        floor = describe_floor(doc)
        if floor:
            click.echo(floor)
        cached = describe_floor_cache(doc)
        if cached:
            click.echo(cached)
        limit = describe_limit(doc)
        if limit:
            click.echo(limit)
        for name, m in doc["modes"].items():
            said = [f"{m['summary'][k]:.2f}x {what}" for k, what in (
                ("over_floor", "the floor"),
                ("over_floor_cache", "the warm start with the compile caches local"),
                ("loading_over_limit", "its loading phase over the checkpoint at the limit"))
                if m["summary"].get(k)]
            if said:
                click.echo(f"{name}: {'; '.join(said)}")
    if json_path is not None:
        write_json(doc, json_path)
    measured = [n for n, m in doc["modes"].items() if m["summary"].get("ok_runs")]
    if plot_path is not None and measured:
        plot_timeline(doc, plot_path)
    if not measured:
        click.echo("coldstart: error: nothing was measured: every mode was skipped or failed",
                   err=True)
        sys.exit(1)
    failed = [n for n, m in doc["modes"].items() if m["summary"].get("failed_runs")]
    if failed:
        click.echo(f"coldstart: error: runs failed in: {', '.join(failed)} "
                   "(see the JSON for each error)", err=True)
        sys.exit(1)


class _Progress:
    """A progress bar over all runs with the current mode and phase (rich; plain lines when
    stderr is not a terminal; nothing with -q)."""

    def __init__(self, quiet: bool, total: int) -> None:
        self.quiet, self.total = quiet, total
        self._bar: Any = None
        self._task: Any = None
        self._console: Any = None

    def __enter__(self) -> _Progress:
        if self.quiet:
            return self
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._console = Console(stderr=True, soft_wrap=True)
        if self._console.is_terminal:
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=self._console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task("preparing", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def _say(self, text: str) -> None:
        if self.quiet:
            return
        if self._console is not None:
            self._console.print(text, highlight=False, markup=False)

    def stage(self, text: str) -> None:
        self._say(f"bench: {text}")

    def phase(self, mode: str, index: int, phase: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"run {index + 1} {mode}: {phase}")

    def run_done(self, run: Run, done: int, total: int) -> None:
        if run.ok and run.ready_s is not None:
            parts = " ".join(f"{p.name} {p.seconds:.2f}" for p in run.phases)
            mb = f", {run.registry_bytes / 1e6:.1f} MB" if run.registry_bytes is not None else ""
            self._say(f"bench: [{done}/{total}] {run.mode} run {run.index + 1}: READY "
                      f"{run.ready_s:.2f} s ({parts}{mb})")
        else:
            self._say(f"bench: [{done}/{total}] {run.mode} run {run.index + 1} failed: "
                      f"{run.error}")
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
