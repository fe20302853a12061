"""``coldstart pull REF``: pull an image into containerd, lazily through the coldstart snapshotter.

Like ``ctr-remote image rpull``: the manifest and config go into containerd's content store, the
image record is created, and each layer is prepared through containerd with the labels that let
the snapshotter mount it remotely; layers it cannot serve lazily are downloaded and unpacked.
Afterwards ``ctr --address SOCK run --snapshotter coldstart REF ID CMD`` runs the image.
"""

from __future__ import annotations

import click

__all__ = ["pull"]


@click.command()
@click.argument("ref")
@click.option("--address", "-a", default="/run/containerd/containerd.sock", show_default=True,
              envvar="CONTAINERD_ADDRESS", help="containerd's gRPC socket.")
@click.option("--namespace", "-n", default="default", show_default=True,
              envvar="CONTAINERD_NAMESPACE", help="containerd namespace.")
@click.option("--snapshotter", default="coldstart", show_default=True,
              help="containerd snapshotter to unpack into (e.g. overlayfs for a plain pull).")
@click.option("--insecure", "insecure", multiple=True, metavar="HOST",
              help="Registry host[:port] spoken to over plain HTTP (repeatable).")
@click.option("--platform", default=None, metavar="OS/ARCH[/VARIANT]",
              help="Platform to pick from an index (default: this host).")
@click.option("--timeout", default=60.0, show_default=True, type=float,
              help="Deadline in seconds of each registry and containerd call.")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def pull(ref: str, address: str, namespace: str, snapshotter: str, insecure: tuple[str, ...],
         platform: str | None, timeout: float, quiet: bool) -> None:
    """Pull image REF into containerd (lazily where the snapshotter can)."""
    from coldstart.containerd.client import Containerd
    from coldstart.containerd.pull import pull_image
    from coldstart.errors import InvalidArgument
    from coldstart.oci.manifest import Platform
    from coldstart.oci.registry import RegistryClient

    if timeout <= 0:
        raise InvalidArgument("--timeout must be > 0")
    want = Platform.parse(platform) if platform else None

    def say(msg: str) -> None:
        if not quiet:
            click.echo(msg, err=True)

    with Containerd(address, namespace, timeout=timeout) as ctd, \
            RegistryClient(insecure_hosts=insecure, timeout=timeout) as registry:
        result = pull_image(ctd, registry, ref, snapshotter=snapshotter, platform=want,
                            progress=say)
    click.echo(f"{result.name} {result.target.digest}")
