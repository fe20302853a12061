"""``coldstart cri-proxy``: the CRI image-service proxy (see :mod:`coldstart.cri.proxy`)."""

from __future__ import annotations

import logging

import click

from coldstart.commands._common import configure_logging, explicit_log_level


@click.command("cri-proxy")
@click.option("--listen", default="/run/coldstart/cri.sock", show_default=True,
              envvar="COLDSTART_CRI_LISTEN",
              help="Unix socket to serve CRI on (kubelet's --image-service-endpoint).")
@click.option("--upstream", default="/run/containerd/containerd.sock", show_default=True,
              envvar="COLDSTART_CRI_UPSTREAM", help="containerd's CRI socket.")
@click.option("--keychain", "keychain_dir", default="/var/lib/coldstart/cri-credentials",
              show_default=True, envvar="COLDSTART_CRI_KEYCHAIN",
              help="Where PullImage credentials are kept (root-only) for the FUSE server; the "
                   "same directory as the snapshotter config's registry.cri_keychain.")
def cri_proxy(listen: str, upstream: str, keychain_dir: str) -> None:
    """Forward CRI calls to containerd, keeping PullImage credentials for lazy layers.

    \b
    Point kubelet at it:
      kubelet --container-runtime-endpoint unix:///run/containerd/containerd.sock \\
              --image-service-endpoint unix:///run/coldstart/cri.sock
    kubelet then sends image calls (PullImage with an imagePullSecret's credentials, ...)
    here; each is forwarded to containerd unchanged, and a PullImage's credentials are first
    written to --keychain, where the FUSE server finds them when it fetches the image's layers
    lazily (and again whenever kubelet pulls with rotated credentials). Every other call (any
    service) is forwarded as it is. Runs until SIGTERM/SIGINT; logs one line per PullImage
    (the image, whether credentials were kept; never a secret)."""
    configure_logging(explicit_log_level() or "info", daemon=True)
    logging.getLogger("grpc").setLevel(logging.WARNING)
    from coldstart.commands._signals import signals_unwind
    from coldstart.cri.proxy import CriProxy
    from coldstart.oci.keychain import Keychain

    proxy = CriProxy(listen, upstream, Keychain(keychain_dir))
    with signals_unwind():
        proxy.start()
        try:
            proxy.wait()
        except KeyboardInterrupt:
            pass
        finally:
            proxy.stop()
