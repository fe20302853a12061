"""``coldstart pull REF``: pull an image into containerd, lazily through the coldstart snapshotter.

Like ``ctr-remote image rpull``: the manifest and config go into containerd's content store, the
image record is created, and each layer is prepared through containerd with the labels that let
the snapshotter mount it remotely; layers it cannot serve lazily are downloaded and unpacked.
Afterwards ``ctr --address SOCK run --snapshotter coldstart REF ID CMD`` runs the image.
"""

from __future__ import annotations

from pathlib import Path

import click

from coldstart.commands._common import echo_json, output_option, registry_client, registry_options

__all__ = ["pull"]


@click.command()
@click.argument("ref")
@click.option("--address", "-a", default="/run/containerd/containerd.sock", show_default=True,
              envvar="CONTAINERD_ADDRESS", help="containerd's gRPC socket.")
@click.option("--namespace", "-n", default="default", show_default=True,
              envvar="CONTAINERD_NAMESPACE", help="containerd namespace.")
@click.option("--snapshotter", default="coldstart", show_default=True,
              envvar="CONTAINERD_SNAPSHOTTER",
              help="containerd snapshotter to unpack into (e.g. overlayfs for a plain pull).")
@registry_options
@click.option("--platform", default=None, metavar="OS/ARCH[/VARIANT]",
              help="Platform to pick from an index, as containerd reads it (linux/amd64, "
                   "Linux/x86_64, arm64; default: this host). One: a pull unpacks one "
                   "platform.")
@click.option("--timeout", default=60.0, show_default=True, type=float,
              help="Deadline in seconds of each registry and containerd call (connecting to "
                   "containerd included).")
@output_option("the image name, digest and each layer: lazy, downloaded or present")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def pull(ref: str, address: str, namespace: str, snapshotter: str, hosts_dir: Path | None,
         insecure: tuple[str, ...], tls_verify: bool, authfile: Path | None,
         platform: str | None, timeout: float, output: str, quiet: bool) -> None:
    """Pull image REF into containerd (lazily where the snapshotter can).

    REF is registry/repo:tag[@digest], or docker://registry/repo:tag as skopeo writes it. The
    image record gets REF's name without docker://; run it with
    `ctr run --snapshotter coldstart REF ID`.
    """
    from coldstart.commands._progress import Progress
    from coldstart.containerd.client import Containerd
    from coldstart.containerd.pull import pull_image
    from coldstart.errors import InvalidArgument
    from coldstart.oci.manifest import Platform
    from coldstart.oci.reference import Reference

    # every argument is checked before anything is dialled
    if timeout <= 0:
        raise InvalidArgument("--timeout must be > 0")
    name = ref.removeprefix("docker://")
    Reference.parse(name)
    want = Platform.parse(platform) if platform else None

    with Progress(["download"], quiet=quiet) as progress, \
            registry_client(insecure, tls_verify, authfile, hosts_dir,
                            timeout=timeout) as registry, \
            Containerd(address, namespace, timeout=timeout, connect_timeout=timeout) as ctd:
        result = pull_image(ctd, registry, name, snapshotter=snapshotter, platform=want,
                            progress=progress.say, byte_progress=progress)
    if output == "json":
        echo_json({"name": result.name, "digest": result.target.digest,
                   "manifest": result.manifest_digest, "config": result.config_digest,
                   "chain_id": result.chain_id, "seconds": round(result.seconds, 3),
                   "layers": [{"digest": la.digest, "how": la.how, "size": la.size,
                               "fetched_bytes": la.fetched_bytes} for la in result.layers]})
        return
    click.echo(f"{result.name} {result.target.digest}")
