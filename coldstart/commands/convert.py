"""``coldstart convert``: rewrite an image's layers as zstd:chunked or eStargz."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

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
@click.option("--format", "fmt", type=click.Choice(["zstd-chunked", "estargz"]),
              default="zstd-chunked", show_default=True,
              help="Seekable layer format to write. zstd:chunked decompresses several times "
                   "faster; eStargz is gzip, readable by older stargz snapshotters.")
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
@click.option("--platform", "platforms", multiple=True, metavar="OS/ARCH[/VARIANT]",
              help="Convert only these platforms of a multi-platform image (repeatable; "
                   "default: every platform).")
@click.option("--insecure", "insecure", multiple=True, metavar="HOST[:PORT]",
              help="Talk plain HTTP to this registry (repeatable; loopback always is).")
@click.option("--hosts-dir", type=click.Path(file_okay=False, path_type=Path),
              help="containerd certs.d directory with <host>/hosts.toml (mirrors, TLS).")
@click.option("--jobs", "-j", default=2, show_default=True, type=click.IntRange(1, 64),
              help="Layers converted at the same time.")
@click.option("--level", type=click.IntRange(1, 22), default=None,
              help="Compression level (default: the format's own default).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the per-layer summary as JSON to this file ('-' = stdout).")
def convert(src: str, dst: str, fmt: str, chunk_size: str, prefetch_list: Path | None,
            profile_path: Path | None, keep_layers: bool, platforms: tuple[str, ...],
            insecure: tuple[str, ...], hosts_dir: Path | None, jobs: int, level: int | None,
            json_out: Path | None) -> None:
    """Convert image SRC into DST with seekable (lazily pullable) layers.

    SRC and DST are registry references (registry/repo:tag) or OCI layout directories
    (oci:DIR[:tag]). Every platform of a multi-platform image is converted, layers already in a
    seekable format are kept as they are, and the config's diff_ids are rewritten. The result
    is still a standard OCI image that any runtime can pull.

    \b
    Examples:
      coldstart convert 127.0.0.1:5000/app:v1 127.0.0.1:5000/app:v1-zstd
      coldstart convert oci:./app:v1 oci:./app-estargz:v1 --format estargz
    """
    from coldstart.oci.convert import convert_image, read_prefetch_list
    from coldstart.oci.registry import RegistryClient
    from coldstart.prefetch.profile import load_profile

    size = _parse_chunk_size(chunk_size)
    if prefetch_list is not None and profile_path is not None:
        raise InvalidArgument("give --prefetch-list or --profile, not both")
    prefetch = read_prefetch_list(prefetch_list) if prefetch_list else None
    profile = load_profile(profile_path) if profile_path is not None else None
    if keep_layers and profile is None:
        raise InvalidArgument("--keep-layers needs --profile")
    tty = sys.stderr.isatty()

    def on_layer(layer: object, done: int, total: int) -> None:
        from coldstart.oci.convert import LayerSummary

        assert isinstance(layer, LayerSummary)
        what = "kept" if layer.kept else f"{_size(layer.size_before)} -> " \
                                         f"{_size(layer.size_after)}"
        line = f"[{done}/{total}] {layer.source.digest[:19]}  {what}  ({layer.seconds:.1f} s)"
        if tty:
            click.echo(f"\r\x1b[K{line}", err=True, nl=done == total)
        else:
            click.echo(line, err=True)

    with RegistryClient(insecure_hosts=insecure, hosts_dir=hosts_dir) as client:
        summary = convert_image(src, dst, format=fmt, chunk_size=size, prefetch=prefetch,
                                platforms=platforms or None, client=client, workers=jobs,
                                level=level, on_layer=on_layer, profile=profile,
                                keep_layers=keep_layers)
    for skipped in summary.skipped:
        click.echo(f"skipped {skipped}", err=True)
    for img in summary.images:
        for x in img.layers:
            if x.prefetch_missing:
                click.echo(f"warning: layer {x.source.digest[:19]}: {len(x.prefetch_missing)} "
                           f"profile file(s) not in the layer, skipped (e.g. "
                           f"{x.prefetch_missing[0]!r})", err=True)
    before, after = summary.size_before, summary.size_after
    ratio = f" ({after / before:.2f}x)" if before else ""
    click.echo(f"{summary.destination}@{summary.digest}")
    click.echo(f"{len(summary.images)} image(s), {summary.layers_converted} layer(s) converted "
               f"to {summary.format}, {summary.layers_kept} kept; "
               f"{_size(before)} -> {_size(after)}{ratio} in {summary.seconds:.1f} s", err=True)
    if json_out is not None:
        text = json.dumps(summary.to_json(), indent=2)
        if str(json_out) == "-":
            click.echo(text)
        else:
            json_out.write_text(text + "\n")
