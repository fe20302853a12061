"""``coldstart optimize``: record what an image's start-up reads, and write the image with
that set first. It drives the same private node as ``coldstart bench`` (:mod:`.node`).

:func:`record_profile` runs the image once on a private node (a fresh containerd, coldstart's
snapshotter with an empty chunk cache and recording on, a private registry on loopback), until
the command exits, the ready condition holds, or the timeout; then reads each layer's recording
back from the FUSE server and returns a :class:`~coldstart.prefetch.profile.Profile`.
:func:`optimize_image` converts the source first if it is not seekable, records, and writes the
destination with :func:`~coldstart.oci.convert.convert_image` and that profile.

Everything it starts is stopped by PID and every mount it made is undone, whatever happens.

>>> result = optimize_image("oci:./app:v1", "oci:./app-opt:v1",
...                         OptimizeOptions(command=["python3", "-c", "import torch"]))
...                                                                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coldstart.benchmark.node import MODES, Workload, cold_start, require_root, start_node
from coldstart.benchmark.ready import parse_ready
from coldstart.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from coldstart.lazyfs.client import FuseServerClient
from coldstart.oci.convert import ConvertSummary, convert_image, normalise_format
from coldstart.oci.manifest import ImageConfig, Index, parse_any, parse_manifest, select_platform
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.oci.store import open_store
from coldstart.prefetch.profile import LayerProfile, Profile
from coldstart.prefetch.recorder import FileAccess
from coldstart.progress import ByteProgress
from coldstart.stack.registry import start_registry

__all__ = ["OptimizeOptions", "OptimizeResult", "optimize_image", "record_profile"]

log = logging.getLogger(__name__)

#: the private node's directory is /tmp/<NODE_PREFIX>…: unix socket paths must stay short
NODE_PREFIX = "cs-optimize-"


@dataclass(frozen=True)
class OptimizeOptions:
    command: Sequence[str] = ()          # default: the image's own entrypoint and command
    env: Sequence[str] = ()              # K=V, added to the image's
    mounts: Sequence[tuple[str, str]] = ()   # (host path, container path) bind mounts
    ready: str = "exit"                  # exit | notify | http://… | log:REGEX
    timeout: float = 300.0
    format: str = "zstd:chunked"
    insecure: Sequence[str] = ()
    workdir: Path | None = None
    tls_verify: bool = True              # of SRC's and DST's registries
    authfile: Path | None = None         # their credentials (Docker config.json)
    hosts_dir: Path | None = None        # their mirrors and TLS (containerd certs.d)
    cut_chunks: bool = True              # chunks also start where the start-up's reads do


@dataclass
class OptimizeResult:
    profile: Profile
    summary: ConvertSummary | None = None
    warnings: list[str] = field(default_factory=list)


Progress = Callable[[str], None]


def _quiet(_text: str) -> None:
    pass


def record_profile(src: str, opts: OptimizeOptions, *, progress: Progress = _quiet,
                   warnings: list[str] | None = None,
                   byte_progress: ByteProgress | None = None) -> Profile:
    """Run ``src`` once under recording and return its start-up profile (see the module
    docstring). InvalidArgument/FailedPrecondition/Unavailable/DeadlineExceeded on failure,
    one line each; nothing is left running or mounted."""
    require_root()
    cond = parse_ready(opts.ready)
    notes = warnings if warnings is not None else []
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="coldstart-optimize-", dir=opts.workdir)))
        reg = stack.enter_context(start_registry(work / "registry", log_level="error",
                                                 access_log=False))
        client = stack.enter_context(RegistryClient(insecure_hosts=[reg.host, *opts.insecure],
                                                    tls_verify=opts.tls_verify,
                                                    docker_config=opts.authfile,
                                                    hosts_dir=opts.hosts_dir))
        run_ref = f"{reg.host}/optimize/run:zstd"
        progress(f"making a lazily pullable copy of {src} to record with")
        convert_image(src, run_ref, format="zstd:chunked", client=client, workdir=work,
                      progress=byte_progress)
        run_image = client.resolve(Reference.parse(run_ref))
        src_diff_ids = _diff_ids(client, src)
        layers = run_image.manifest.layers
        if len(src_diff_ids) != len(layers):
            raise FailedPrecondition(f"{src}: {len(src_diff_ids)} layers in its config, "
                                     f"{len(layers)} after conversion")
        progress("starting a private containerd and snapshotter (recording on)")
        # the node's unix sockets live below its directory: keep that path short
        node_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=NODE_PREFIX,
                                                                        dir="/tmp")))
        node = stack.enter_context(start_node(MODES["coldstart"], node_dir / "n",
                                              insecure=(reg.host,), record=True))
        work_load = Workload(command=list(opts.command), env=list(opts.env), ready=cond,
                             timeout=opts.timeout, mounts=tuple(opts.mounts))
        progress(f"running the image until {'it exits' if cond.kind == 'exit' else cond}"
                 f" (at most {opts.timeout:g} s)")
        run = cold_start(node, run_ref, work_load, 0, traffic=None)
        started = any(p.name == "start" for p in run.phases)    # the app was running
        if not run.ok:
            if run.error_kind == DeadlineExceeded.__name__ and cond.kind == "exit" and started:
                notes.append(f"the command was still running after --timeout "
                             f"{opts.timeout:g} s: the profile holds what it read until then")
            elif run.error_kind == DeadlineExceeded.__name__:
                raise DeadlineExceeded(f"{src}: not ready ({cond}) within --timeout "
                                       f"{opts.timeout:g} s: {_first_line(run.error)}")
            else:
                raise Unavailable(f"{src}: the recorded start failed: "
                                  f"{_first_line(run.error)}")
        elif run.exit_code not in (None, 0):
            notes.append(f"the command exited with status {run.exit_code} after it was "
                         "ready; the profile holds what it read until it was ready")
        client_ = FuseServerClient(node.fuse_socket)
        client_.record(False)
        recorded = {x["digest"]: x["files"] for x in client_.profile()}
        # times are since each layer's mount, which came after the run's start: a file first
        # read later than the ready time (since the start) was read after ready
        ready_at = run.ready_s if run.ok and run.ready_s is not None else float("inf")
        out = []
        for i, desc in enumerate(layers):
            files = tuple(FileAccess(f["path"], float(f["t"]),
                                     [(a, a + n) for a, n in f["ranges"]])
                          for f in recorded.get(desc.digest, []) if float(f["t"]) <= ready_at)
            out.append(LayerProfile(index=i, diff_id=src_diff_ids[i], digest=desc.digest,
                                    files=files))
        profile = Profile(image=src, layers=tuple(out), ready=str(cond.kind),
                          seconds=run.ready_s or 0.0)
        if profile.files == 0:
            notes.append("the start-up read no file of the image: the profile is empty")
        return profile


def optimize_image(src: str, dst: str, opts: OptimizeOptions, *,
                   progress: Progress = _quiet,
                   on_profile: Callable[[Profile], None] | None = None,
                   byte_progress: ByteProgress | None = None) -> OptimizeResult:
    """Record ``src``'s start-up and write ``dst`` with each layer's files in that order;
    ``on_profile`` gets the profile as soon as it is recorded (to keep it before ``dst`` is
    written); ``byte_progress`` counts the bytes of both conversions."""
    fmt = normalise_format(opts.format)
    if src == dst:
        raise InvalidArgument("SRC and DST must differ")
    warnings: list[str] = []
    profile = record_profile(src, opts, progress=progress, warnings=warnings,
                             byte_progress=byte_progress)
    if on_profile is not None:
        on_profile(profile)
    progress(f"writing {dst} with {profile.files} start-up file(s) first")
    with RegistryClient(insecure_hosts=list(opts.insecure), tls_verify=opts.tls_verify,
                        docker_config=opts.authfile, hosts_dir=opts.hosts_dir) as client:
        summary = convert_image(src, dst, format=fmt, client=client, profile=profile,
                                workdir=opts.workdir, progress=byte_progress,
                                cut_chunks=opts.cut_chunks)
    for img in summary.images:
        for layer in img.layers:
            if layer.prefetch_missing:
                warnings.append(f"layer {layer.source.digest[:19]}: "
                                f"{len(layer.prefetch_missing)} recorded file(s) not found")
    return OptimizeResult(profile=profile, summary=summary, warnings=warnings)


def _diff_ids(client: RegistryClient, src: str) -> list[str]:
    """The source image's diff_ids (this host's platform of an index), for matching profile
    layers to the source's layers when the profile is applied."""
    store = open_store(src, client)
    body, media, _ = store.get_root()
    root = parse_any(body, media or None)
    if isinstance(root, Index):
        body, media = store.get_manifest(select_platform(root).digest)
    manifest = parse_manifest(body, media or None)
    return list(ImageConfig.parse(store.get_blob(manifest.config.digest)).diff_ids)


def _first_line(text: str | None) -> str:
    return (text or "unknown error").split(" | ")[0]
