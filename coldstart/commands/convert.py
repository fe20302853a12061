"""``coldstart convert``: rewrite an image's layers as zstd:chunked or eStargz."""

from __future__ import annotations

import json
from pathlib import Path

import click

from coldstart.commands._common import (
    FORMAT_CHOICE,
    FORMAT_HELP,
    echo_json,
    output_option,
    registry_client,
    registry_options,
)
from coldstart.errors import InvalidArgument

__all__ = ["convert"]


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("KB", "MB", "GB"):
        value /= 1000
        if value < 1000 or unit == "GB":
            break
    return f"{value:.1f} {unit}"


def _parse_chunk_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if t and t[-1] in units:
        mult, t = units[t[-1]], t[:-1]
    if not t.isdigit() or int(t) <= 0:
        raise InvalidArgument(f"invalid --chunk-size {text!r} (e.g. 4194304, 4M, 512K)")
    return int(t) * mult


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--format", "fmt", type=FORMAT_CHOICE,
              default="zstd-chunked", show_default=True,
              help="Seekable layer format to write. zstd:chunked decompresses several times "
                   "faster; eStargz is gzip, readable by older stargz snapshotters"
                   + FORMAT_HELP + ".")
@click.option("--chunk-size", default="4M", show_default=True, metavar="SIZE",
              help="Split regular files larger than this into separately fetchable chunks "
                   "(bytes, or with a K/M/G suffix).")
@click.option("--prefetch-list", type=click.Path(dir_okay=False, path_type=Path),
              help="File listing paths (one per line, in access order) to place first in "
                   "each layer behind a prefetch landmark, so a lazy pull fetches them in "
                   "one request.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A start-up profile (from `coldstart optimize`): each layer's recorded "
                   "files go first, in access order, behind a prefetch landmark (layers "
                   "already seekable are rewritten too).")
@click.option("--keep-layers", is_flag=True,
              help="With --profile: keep layers that are already seekable byte for byte and "
                   "only annotate them with the chunks the profile touched (a node prefetches "
                   "those at mount; nothing is re-compressed).")
@click.option("--cut-chunks/--no-cut-chunks", default=True, show_default=True,
              help="With --profile: also start a chunk at each edge of what the start-up "
                   "read of a file (a node then prefetches and decodes those parts, not the "
                   "4 MiB chunks around them: fewer bytes, a few more requests).")
@click.option("--platform", "platforms", multiple=True, metavar="OS/ARCH[/VARIANT]",
              help="Convert only these platforms of a multi-platform image (repeatable or a "
                   "comma list, e.g. linux/amd64,linux/arm64; default: every platform).")
@click.option("--all-platforms", is_flag=True,
              help="Convert every platform (the default; ctr's spelling, excludes --platform).")
@registry_options
@click.option("--jobs", "-j", default=2, show_default=True, type=click.IntRange(1, 64),
              help="Layers converted at the same time.")
@click.option("--level", type=click.IntRange(1, 22), default=None,
              help="Compression level (default: the format's own default).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the summary as JSON to this file ('-' = stdout, as -o json).")
@output_option("the summary with every layer")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def convert(src: str, dst: str, fmt: str, chunk_size: str, prefetch_list: Path | None,
            profile_path: Path | None, keep_layers: bool, cut_chunks: bool,
            platforms: tuple[str, ...],
            all_platforms: bool, hosts_dir: Path | None, insecure: tuple[str, ...],
            tls_verify: bool, authfile: Path | None, jobs: int, level: int | None,
            json_out: Path | None, output: str, quiet: bool) -> None:
    """Convert image SRC into DST with seekable (lazily pullable) layers.

    SRC and DST are registry references (registry/repo:tag, or docker://registry/repo:tag as
    skopeo writes it) or OCI layout directories (oci:DIR[:tag]). Every platform of a
    multi-platform image is converted, layers already in a seekable format are kept as they
    are, and the config's diff_ids are rewritten. The result is still a standard OCI image that
    any runtime can pull.

    \b
    Examples:
      coldstart convert 127.0.0.1:5000/app:v1 127.0.0.1:5000/app:v1-zstd
      coldstart convert oci:./app:v1 oci:./app-estargz:v1 --format estargz
      coldstart convert docker://reg.example/app:v1 docker://reg.example/app:v1-zstd \\
          --platform linux/amd64,linux/arm64 -o json
    """
    from coldstart.commands._progress import Progress
    from coldstart.oci.convert import convert_image, read_prefetch_list
    from coldstart.oci.manifest import parse_platforms
    from coldstart.prefetch.profile import load_profile

    size = _parse_chunk_size(chunk_size)
    if all_platforms and platforms:
        raise InvalidArgument("give --platform or --all-platforms, not both")
    wanted = parse_platforms(platforms)
    if json_out is not None and str(json_out) != "-" and not json_out.resolve().parent.is_dir():
        raise InvalidArgument(f"--json {json_out}: its directory does not exist")
    if prefetch_list is not None and profile_path is not None:
        raise InvalidArgument("give --prefetch-list or --profile, not both")
    prefetch = read_prefetch_list(prefetch_list) if prefetch_list else None
    profile = load_profile(profile_path) if profile_path is not None else None
    if keep_layers and profile is None:
        raise InvalidArgument("--keep-layers needs --profile")

    with Progress(["download", "convert"], quiet=quiet) as progress:
        def on_layer(layer: object, done: int, total: int) -> None:
            from coldstart.oci.convert import LayerSummary

            assert isinstance(layer, LayerSummary)
            what = "kept" if layer.kept else f"{_size(layer.size_before)} -> " \
                                             f"{_size(layer.size_after)}"
            progress.say(f"[{done}/{total}] {layer.source.digest[:19]}  {what}  "
                         f"({layer.seconds:.1f} s)")

        with registry_client(insecure, tls_verify, authfile, hosts_dir) as client:
            summary = convert_image(src, dst, format=fmt, chunk_size=size, prefetch=prefetch,
                                    platforms=wanted or None, client=client, workers=jobs,
                                    level=level, on_layer=on_layer, profile=profile,
                                    keep_layers=keep_layers, progress=progress,
                                    cut_chunks=cut_chunks)
    for skipped in summary.skipped:
        click.echo(f"skipped {skipped}", err=True)
    for img in summary.images:
        for x in img.layers:
            if x.prefetch_missing:
                click.echo(f"warning: layer {x.source.digest[:19]}: {len(x.prefetch_missing)} "
                           f"profile file(s) not in the layer, skipped (e.g. "
                           f"{x.prefetch_missing[0]!r})", err=True)
    doc = summary.to_json()
    if json_out is not None:
        if str(json_out) == "-":
            output = "json"
        else:
            json_out.write_text(json.dumps(doc, indent=2) + "\n")
    if output == "json":
        echo_json(doc)
        return
    before, after = summary.size_before, summary.size_after
    ratio = f" ({after / before:.2f}x)" if before else ""
    click.echo(f"{summary.destination}@{summary.digest}")
    click.echo(f"{len(summary.images)} image(s), {summary.layers_converted} layer(s) converted "
               f"to {summary.format}, {summary.layers_kept} kept; "
               f"{_size(before)} -> {_size(after)}{ratio} in {summary.seconds:.1f} s", err=True)
