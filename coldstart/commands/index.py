"""``coldstart index REF [--push]``: a seekable index for every plain gzip layer of an image that
nobody converted, stored beside the image as an OCI artifact (the image is not changed)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from coldstart.commands._common import echo_json, output_option, registry_client, registry_options

__all__ = ["index"]


@click.command()
@click.argument("ref")
@click.option("--push", is_flag=True,
              help="Push the indexes as an OCI artifact whose subject is the image (the "
                   "referrers API, or the sha256-<hex> fallback tag where the registry has "
                   "none). Without it, the indexes are built and checked, and nothing is "
                   "written.")
@click.option("--span", default="2MiB", show_default=True, metavar="SIZE",
              help="Uncompressed bytes between two checkpoints: a file read inflates half a "
                   "span on average; each checkpoint adds a 32 KiB window to the index.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, metavar="FILE",
              help="A start-up profile (`coldstart optimize --profile-out`, run on this image "
                   "or a converted copy): each layer's index then names the spans its start-up "
                   "touched, and a node fetches them as soon as it mounts the layer, one "
                   "request per span in the order the start-up first read their files (the "
                   "image stays as it is).")
@registry_options
@click.option("--platform", default=None, metavar="OS/ARCH[/VARIANT]",
              help="Platform to pick from an index (default: this host).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where each layer blob is downloaded while it is indexed (default: $TMPDIR).")
@click.option("--timeout", default=60.0, show_default=True, type=float,
              help="Deadline in seconds of each registry call.")
@output_option("the artifact digest and each layer: indexed (files, checkpoints, bytes) or "
               "skipped (why)")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def index(ref: str, push: bool, span: str, profile_path: Path | None,
          hosts_dir: Path | None, insecure: tuple[str, ...],
          tls_verify: bool, authfile: Path | None, platform: str | None,
          workdir: Path | None, timeout: float, output: str, quiet: bool) -> None:
    """Index the plain gzip layers of image REF for lazy pulling.

    Each layer is downloaded (verified), and its deflate checkpoints (one every --span of
    output, with the 32 KiB window before each) and its file table, each file cut at the
    checkpoints with a digest per piece, are written as one index blob per layer. With --push
    they go to REF's repository as one artifact; the digest printed is what a node pins
    (index.trusted in the snapshotter's config, or a line of its trusted-indexes file): a
    node mounts a plain gzip layer lazily only through an index it trusts, and pulls it in
    full otherwise.

    With --profile, the indexes also carry the start-up set, so a node prefetches it at
    mount as it does for an image that `coldstart optimize` wrote. To record one for an image
    you cannot convert: `coldstart optimize REF oci:/tmp/scratch --profile-out p.json` (the
    recording runs on a converted copy, also written to the scratch layout; its diffIDs are
    REF's), then
    `coldstart index REF --profile p.json --push`.
    """
    from coldstart.config import parse_size
    from coldstart.errors import InvalidArgument
    from coldstart.format.gzindex import MAX_SPAN
    from coldstart.oci.gzindex import index_image, push_image_index
    from coldstart.oci.manifest import Platform
    from coldstart.oci.reference import Reference
    from coldstart.prefetch.profile import load_profile

    if timeout <= 0:
        raise InvalidArgument("--timeout must be > 0")
    span_bytes = parse_size(span, "--span")
    if not 64 << 10 <= span_bytes <= MAX_SPAN:
        raise InvalidArgument(f"--span must be between 64KiB and {MAX_SPAN >> 20}MiB, not {span}")
    name = Reference.parse(ref.removeprefix("docker://"))
    want = Platform.parse(platform) if platform else None
    profile = load_profile(profile_path) if profile_path is not None else None

    def say(line: str) -> None:
        if not quiet:
            click.echo(line, err=True)

    with registry_client(insecure, tls_verify, authfile, hosts_dir, timeout=timeout) as client, \
            tempfile.TemporaryDirectory(prefix="coldstart-index-", dir=workdir) as tmp:
        result = index_image(client, name, span=span_bytes, workdir=Path(tmp), platform=want,
                             profile=profile, say=say)
        pushed = push_image_index(client, result) if push else ""
    if output == "json":
        echo_json({"image": str(name), "manifest": result.manifest_digest,
                   "artifact": result.digest, "pushed": bool(pushed),
                   "layers": [{"digest": li.digest, "size": li.size, "indexed": bool(li.blob),
                               "reason": li.reason, "index": li.index_digest,
                               "index_bytes": len(li.blob), "files": li.files,
                               "checkpoints": li.checkpoints, "seconds": round(li.seconds, 3),
                               "prefetch_files": li.prefetch_files,
                               "prefetch_bytes": li.prefetch_bytes}
                              for li in result.layers]})
        return
    indexed = sum(1 for li in result.layers if li.blob)
    click.echo(f"{name}@{result.manifest_digest}: {indexed} of {len(result.layers)} layers "
               f"indexed")
    if pushed:
        click.echo(f"pushed {result.digest}  (pin it on nodes: index.trusted, or a line of "
                   f"<root>/trusted-indexes)")
    else:
        click.echo(f"artifact {result.digest} (not pushed: --push)")
