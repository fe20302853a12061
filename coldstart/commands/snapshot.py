"""``coldstart snapshot``: a ready container's memory (CRIU) shipped as an OCI artifact of its
image, restored instead of started on any node whose key matches (``coldstart-runc``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from coldstart.commands._common import echo_json, output_option, registry_client, registry_options

__all__ = ["snapshot"]

_address_option = click.option(
    "--address", default="/run/containerd/containerd.sock", show_default=True,
    envvar="CONTAINERD_ADDRESS", help="containerd's socket.")
_namespace_option = click.option(
    "--namespace", "-n", default="default", show_default=True, envvar="CONTAINERD_NAMESPACE",
    help="containerd namespace of the container (k8s.io for kubelet's).")
_config_option = click.option(
    "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
    envvar="COLDSTART_CONFIG",
    help="The node's config file ([snapshot] table) [default: /etc/coldstart/config.toml "
         "when it exists].")


@click.group()
def snapshot() -> None:
    """Snapshots: restore a ready container instead of starting it again.

    \b
    `create` checkpoints a running container through containerd (runc, then CRIU) once it is
    ready and pushes the checkpoint to the image's repository as an OCI artifact referring to
    the image (referrers API, or the sha256-<hex> tag). Its key says where it may be restored:
    the image digest, the command and environment, the CPU's instruction set, the kernel, the
    CRIU version, the GPU and driver. Memory pages are chunked by content and compressed, a
    digest per chunk: nodes verify every chunk and keep one copy of each.

    \b
    Restore happens in `coldstart-runc`, the runtime binary containerd's runc shim runs
    (runtime option BinaryName; `ctr run --runc-binary`): a container whose spec has the
    annotation dev.coldstart.snapshot=<image ref> (or =auto: the CRI's image name) is restored
    from the snapshot matching it and the node; without one, or on any failure (a chunk that
    fails its digest, CRIU missing or failing, a key that differs), it starts normally and the
    reason is logged and counted (`status`).

    \b
      coldstart snapshot check                   # can this node restore? (CRIU >= 4.2)
      coldstart snapshot create web-1 --push     # checkpoint container web-1 and push it
      coldstart snapshot status                  # restores and fallbacks on this node

    What a snapshot contains: the memory of every process of the container (secrets and
    tokens it read included), open files' positions and its root file system changes; not
    memory mapped from the image's files (weights through mmap come from the image). It is
    pushed only with --push, to the repository of the image (or --image). Load secrets after
    a restore (coldstart.snapshot.after_restore), not before the checkpoint.
    """


@snapshot.command()
@_config_option
@output_option("CRIU's path, version, problems and features")
def check(config_path: Path | None, output: str) -> None:
    """Say whether this node can take and restore snapshots (CRIU >= 4.2, `criu check`)."""
    from coldstart.config import load
    from coldstart.snapshot.criu import find_criu

    cfg = load(config_path if config_path else _default_config())
    criu = find_criu(cfg.snapshot.criu, check=True)
    if output == "json":
        echo_json({"path": criu.path, "version": criu.version, "usable": criu.usable,
                   "problems": list(criu.problems), "features": criu.features})
    else:
        click.echo(f"CRIU {criu.version} at {criu.path}: "
                   + ("can restore" if criu.usable else "CANNOT restore"))
        for p in criu.problems:
            click.echo(f"  problem: {p}")
        for name, ok in criu.features.items():
            click.echo(f"  {name}: {'yes' if ok else 'no'}")
    if not criu.usable:
        raise SystemExit(5)


def _default_config() -> Path | None:
    p = Path("/etc/coldstart/config.toml")
    return p if p.exists() else None


@snapshot.command()
@click.argument("container")
@_address_option
@_namespace_option
@click.option("--image", default=None, metavar="REF",
              help="The image the snapshot is pushed for [default: the container's image as "
                   "containerd names it]; its manifest must be the one the container runs.")
@click.option("--push", "do_push", is_flag=True,
              help="Push the snapshot to the image's repository (it holds the container's "
                   "memory: nothing is pushed without this flag).")
@click.option("--dir", "keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the checkpoint (CRIU's images, the rootfs changes) in this new "
                   "directory [default: a temporary one, removed].")
@click.option("--leave-running", is_flag=True,
              help="Keep the container running after the checkpoint [default: it stops, so "
                   "its files cannot change after the dump].")
@_config_option
@registry_options
@click.option("--timeout", default=60.0, show_default=True, type=float,
              help="Deadline in seconds of each registry call.")
@output_option("the artifact digest, the key, bytes of pages and rootfs changes, seconds")
def create(container: str, address: str, namespace: str, image: str | None, do_push: bool,
           keep: Path | None, leave_running: bool, config_path: Path | None,
           hosts_dir: Path | None, insecure: tuple[str, ...], tls_verify: bool,
           authfile: Path | None, timeout: float, output: str) -> None:
    """Checkpoint CONTAINER (running, ready) and push it as a snapshot of its image.

    Take it once the app is ready (its probe, sd_notify READY=1 or first answer): what the
    process holds then is what every restore starts from. The container must have no
    terminal, no io_uring and no FUSE mount inside it; established TCP connections are not
    kept (close them, or reopen them in an after-restore hook).
    """
    import shutil
    import tempfile
    import time

    from coldstart.config import load
    from coldstart.errors import InvalidArgument
    from coldstart.snapshot.create import checkpoint, push
    from coldstart.snapshot.criu import find_criu

    if not do_push and keep is None:
        raise InvalidArgument("nothing to do: give --push, --dir DIR or both")
    cfg = load(config_path if config_path else _default_config())
    criu = find_criu(cfg.snapshot.criu, check=False)
    tmp = None if keep else Path(tempfile.mkdtemp(prefix="coldstart-snapshot-"))
    dest = keep if keep else Path(str(tmp)) / "ckpt"
    t0 = time.monotonic()
    try:
        with registry_client(insecure, tls_verify, authfile, hosts_dir, timeout=timeout) as c:
            ckpt = checkpoint(address, namespace, container, c, dest,
                              criu_version=criu.version, leave_running=leave_running,
                              image=image)
            doc: dict[str, object] = {"container": container, "image": ckpt.image,
                                      "key": ckpt.key.to_json(), "dir": str(keep or ""),
                                      "rootfs_entries": ckpt.rootfs_entries,
                                      "seconds": {k: round(v, 3) for k, v in
                                                  ckpt.seconds.items()}}
            if do_push:
                t = time.monotonic()
                pushed = push(c, ckpt, image=image)
                doc.update(pushed.to_json())
                ckpt.seconds["push"] = time.monotonic() - t
                doc["seconds"] = {k: round(v, 3) for k, v in ckpt.seconds.items()}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    doc["total_seconds"] = round(time.monotonic() - t0, 3)
    if output == "json":
        echo_json(doc)
        return
    click.echo(f"checkpointed {container} (image {doc['image']}) in "
               f"{ckpt.seconds.get('dump', 0):.2f} s; key {ckpt.key.digest}")
    if do_push:
        click.echo(f"pushed {doc['digest']}: {doc['pages_bytes']} bytes of pages, "
                   f"{doc['rootfs_bytes']} bytes of rootfs changes, {doc['blob_bytes']} "
                   "bytes stored")
    if keep:
        click.echo(f"kept in {keep}")


@snapshot.command()
@_config_option
@click.option("--last", default=10, show_default=True, help="How many recent attempts to show.")
@output_option("counters (restored, fallbacks by reason) and the recent attempts")
def status(config_path: Path | None, last: int, output: str) -> None:
    """Restores and fallbacks (by reason) on this node, and the most recent attempts."""
    from coldstart.config import load
    from coldstart.snapshot.state import NodeState

    cfg = load(config_path if config_path else _default_config())
    st = NodeState(Path(cfg.snapshot.state_dir), Path(cfg.snapshot_work_dir))
    counters, events = st.counters(), st.events(last)
    if output == "json":
        echo_json({"state_dir": str(st.root), "counters": counters, "events": events})
        return
    fb = counters.get("fallbacks") or {}
    click.echo(f"restored: {counters.get('restored', 0)}; fallbacks: "
               + (", ".join(f"{k} {v}" for k, v in sorted(fb.items())) or "none"))
    for e in events:
        phases = e.get("phases") or {}
        click.echo(f"  {e.get('container')}: {e.get('outcome')}"
                   + (f" ({e.get('kind')}): {str(e.get('reason'))[:160]}"
                      if e.get("outcome") != "restored" else
                      f" in {phases.get('total', 0):.2f} s, "
                      f"{e.get('fetched_bytes', 0)} bytes fetched"))


@snapshot.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("image_digest")
@_config_option
@output_option("the key's digest and components")
def key(spec: Path, image_digest: str, config_path: Path | None, output: str) -> None:
    """Print the key a container with OCI spec SPEC (config.json) of image IMAGE_DIGEST has
    on this node (what `create` pushes under and a restore looks for)."""
    from coldstart.config import load
    from coldstart.snapshot.criu import find_criu
    from coldstart.snapshot.keys import compute_key

    cfg = load(config_path if config_path else _default_config())
    k = compute_key(image_digest, json.loads(spec.read_text()),
                    find_criu(cfg.snapshot.criu, check=False).version)
    if output == "json":
        echo_json(k.to_json())
        return
    click.echo(k.digest)
    for name, value in k.components.items():
        click.echo(f"  {name:8} {value[:120]}")
