"""``coldstart optimize SRC DST [-- CMD…]``: record an image's start-up, write it with that set
first (behind the prefetch landmark), and keep the profile as JSON."""

from __future__ import annotations

import re
from pathlib import Path

import click

from coldstart.benchmark.ready import CONDITIONS_HELP
from coldstart.commands._common import (
    FORMAT_CHOICE,
    FORMAT_HELP,
    check_authfile,
    echo_json,
    output_option,
    registry_options,
    split_commas,
)
from coldstart.commands._signals import signals_unwind
from coldstart.errors import InvalidArgument

__all__ = ["optimize"]

_EPILOG = """\b
--ready CONDITION, when the start-up is over:
{ready}
\b
Examples:
  coldstart optimize oci:./torch:v1 oci:./torch-opt:v1 -- python3 -c 'import torch'
  coldstart optimize 127.0.0.1:5000/app:v1 127.0.0.1:5000/app:v1-opt \\
      --ready http://127.0.0.1:8000/health --timeout 120 --profile-out app.profile.json

\b
The image runs once on a private containerd with coldstart's snapshotter and an empty chunk
cache, recording every file each layer serves, until the ready condition holds, the command
exits, or --timeout. DST gets each layer's recorded files first, in access order, then the
prefetch landmark: a node fetches that span in a few large requests as soon as the layer is
mounted. `coldstart convert --profile FILE` applies a saved profile again. Needs root.
""".replace("{ready}", CONDITIONS_HELP)


def _mount(text: str) -> tuple[str, str]:
    host, sep, inside = text.partition(":")
    if not sep or not host.startswith("/") or not inside.startswith("/"):
        raise InvalidArgument(f"--mount {text!r}: expected /HOST/PATH:/CONTAINER/PATH")
    if not Path(host).exists():
        raise InvalidArgument(f"--mount {text!r}: {host} does not exist")
    return host, inside


def _default_profile_path(dst: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", dst.rsplit("/", 1)[-1]).strip("-") or "image"
    return Path(f"{name}.profile.json")


@click.command(epilog=_EPILOG, context_settings={"ignore_unknown_options": False})
@click.argument("src")
@click.argument("dst")
@click.argument("argv", nargs=-1, metavar="[-- CMD…]")
@click.option("--ready", default="exit", show_default=True, metavar="CONDITION",
              help="When the start-up is over (see below).")
@click.option("--timeout", default=300.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds the recorded run may take. Under --ready exit the profile keeps "
                   "what was read until then (a warning); otherwise it is an error.")
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE",
              help="Environment for the recorded run, added to the image's (repeatable).")
@click.option("--mount", "mounts", multiple=True, metavar="SRC:DST",
              help="Bind-mount a host path into the recorded run (repeatable).")
@click.option("--profile-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to keep the profile as JSON [default: <DST name>.profile.json].")
@click.option("--format", "fmt", type=FORMAT_CHOICE,
              default="zstd-chunked", show_default=True,
              help="Layer format of DST" + FORMAT_HELP + ".")
@click.option("--cut-chunks/--no-cut-chunks", default=True, show_default=True,
              help="Also start a chunk at each edge of what the start-up read of a file "
                   "(a node then prefetches and decodes those parts, not the 4 MiB chunks "
                   "around them: fewer bytes, a few more requests).")
@registry_options
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where temporary files go (default: the system's temp directory).")
@output_option("destination, profile, files, files_per_layer, ready_s, warnings")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def optimize(src: str, dst: str, argv: tuple[str, ...], ready: str, timeout: float,
             env: tuple[str, ...], mounts: tuple[str, ...], profile_out: Path | None, fmt: str,
             cut_chunks: bool, hosts_dir: Path | None, insecure: tuple[str, ...], tls_verify: bool,
             authfile: Path | None, workdir: Path | None, output: str, quiet: bool) -> None:
    """Record what image SRC reads as it starts, and write DST with that set first.

    SRC and DST are registry references (registry/repo:tag) or OCI layouts (oci:DIR[:tag]).
    CMD (after --) replaces the image's own command for the recorded run.
    """
    from coldstart.benchmark.optimize import OptimizeOptions, optimize_image
    from coldstart.benchmark.ready import parse_ready
    from coldstart.prefetch.profile import Profile

    parse_ready(ready)
    for e in env:
        if "=" not in e or e.startswith("="):
            raise InvalidArgument(f"--env {e!r}: expected KEY=VALUE")
    binds = tuple(_mount(m) for m in mounts)
    if workdir is not None and not workdir.is_dir():
        raise InvalidArgument(f"--workdir {workdir}: not a directory")
    out_path = profile_out or _default_profile_path(dst)
    if out_path.parent and not out_path.parent.exists():
        raise InvalidArgument(f"--profile-out {out_path}: {out_path.parent} does not exist")
    authfile = check_authfile(authfile)
    opts = OptimizeOptions(command=list(argv), env=list(env), mounts=binds, ready=ready,
                           timeout=timeout, format=fmt, insecure=split_commas(insecure),
                           workdir=workdir, tls_verify=tls_verify, authfile=authfile,
                           hosts_dir=hosts_dir, cut_chunks=cut_chunks)

    from coldstart.commands._progress import Progress

    bar = Progress(["download", "convert"], quiet=quiet)

    def progress(text: str) -> None:
        bar.say(f"coldstart optimize: {text}")

    def keep(profile: Profile) -> None:      # before DST is written: a failure keeps it
        tmp = out_path.with_name(out_path.name + ".tmp")
        try:
            tmp.write_text(profile.dumps())
            tmp.replace(out_path)
        except OSError as exc:
            raise InvalidArgument(f"--profile-out {out_path}: {exc.strerror or exc}") from None
        progress(f"profile kept in {out_path}")

    with signals_unwind(), bar:
        result = optimize_image(src, dst, opts, progress=progress, on_profile=keep,
                                byte_progress=bar)
    for w in result.warnings:
        click.echo(f"coldstart optimize: warning: {w}", err=True)
    summary = result.summary
    assert summary is not None
    per_layer = [len(x.files) for x in result.profile.layers]
    if output == "json":
        echo_json({"destination": f"{summary.destination}@{summary.digest}",
                   "profile": str(out_path), "files": result.profile.files,
                   "files_per_layer": per_layer, "ready_s": round(result.profile.seconds, 3),
                   "warnings": result.warnings})
        return
    click.echo(f"{summary.destination}@{summary.digest}")
    click.echo(f"profile: {out_path} ({result.profile.files} files; per layer "
               f"{', '.join(map(str, per_layer))}; start-up {result.profile.seconds:.2f} s)",
               )
