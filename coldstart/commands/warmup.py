"""``coldstart warmup``: compile caches (Inductor, Triton, vLLM, the CUDA driver's) shipped as
OCI artifacts of their image, restored before the app compiles, and a hit proven.

Not the chunk cache: that one holds the node's image bytes; this one holds what an app's
start-up compiled, so the next start on any node with the same key does not compile again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from coldstart.commands._common import echo_json, output_option, registry_client, registry_options

__all__ = ["warmup"]

_model_option = click.option(
    "--model-version", default=None, envvar="COLDSTART_MODEL_VERSION", metavar="VERSION",
    help="The model version the caches were compiled for (part of the key) "
         "[default: $COLDSTART_MODEL_VERSION, else none].")
_chunks_option = click.option(
    "--chunk-cache", default=None, envvar="COLDSTART_WARMUP_CHUNKS", metavar="DIR",
    help="A chunk cache directory the restore reads first and fills (verified chunks by "
         "digest; a node directory mounted into every pod shares it across restores, images "
         "and versions) [default: $COLDSTART_WARMUP_CHUNKS, else none].")
_timeout_option = click.option("--timeout", default=30.0, show_default=True, type=float,
                               help="Deadline in seconds of each registry call.")


@click.group()
def warmup() -> None:
    """Warm-up caches: compile once per fleet, not once per start.

    \b
    A key names what compiled kernels depend on: torch's and Triton's builds (the digest of
    their installed file lists), Python, this CPU's instruction-set extensions, the GPU, its
    driver and CUDA, and the model version; never paths, host names or pod IPs (`key`).
    `run` wraps an unmodified app: it restores the artifact of IMAGE matching this node's key
    into the directories the app's environment names (TORCHINDUCTOR_CACHE_DIR,
    TRITON_CACHE_DIR, VLLM_CACHE_ROOT, CUDA_CACHE_PATH, or their defaults), starts the app,
    and at READY (sd_notify) says hit, partial or miss, from the compile work the app left in
    those directories; --capture pushes the caches after a start that compiled.

    \b
      coldstart warmup key
      coldstart warmup run --image reg/app:v3 --capture -- python3 serve.py
      coldstart warmup restore reg/app:v3        # an init container, into a shared volume
      coldstart warmup capture reg/app:v3        # after the app compiled, same environment

    What an artifact holds: the files of those cache directories (generated C++ and Python
    source, compiled kernels, autotuning results). Caches hold no weights or inputs, but the
    generated code names the model's layer shapes. They are pushed only by capture (or
    run --capture), to IMAGE's repository.
    """


@warmup.command()
@_model_option
@output_option("the key's digest and components")
def key(model_version: str | None, output: str) -> None:
    """Print this node's warm-up key (computed without importing torch)."""
    from coldstart.warmup.keys import compute_key

    k = compute_key(model_version)
    if output == "json":
        echo_json(k.to_json())
        return
    click.echo(k.digest)
    for name, value in k.components.items():
        click.echo(f"  {name:7} {value}")


@warmup.command()
@click.argument("image")
@_model_option
@_chunks_option
@registry_options
@_timeout_option
@output_option("status (restored, miss, refused), reason, files, bytes fetched, seconds")
def restore(image: str, model_version: str | None, chunk_cache: str | None,
            hosts_dir: Path | None, insecure: tuple[str, ...], tls_verify: bool,
            authfile: Path | None, timeout: float, output: str) -> None:
    """Restore IMAGE's warm-up artifact matching this node into the cache directories.

    A miss (no artifact, another key) or a refusal (a chunk that fails its digest, a registry
    error) exits 0 with its reason: the app then compiles as it would have. Files already in
    the directories are kept. Run it where the app runs (same image, same environment), e.g.
    as an init container of the app's image writing into a volume the app mounts.
    """
    from coldstart.warmup.keys import compute_key
    from coldstart.warmup.runner import restore as do_restore

    with registry_client(insecure, tls_verify, authfile, hosts_dir, timeout=timeout) as client:
        got = do_restore(client, image, key=compute_key(model_version), chunk_cache=chunk_cache)
    if output == "json":
        echo_json(got.to_json())
        return
    click.echo(f"{got.status}: {got.reason}")
    if got.status == "restored":
        click.echo(f"fetched {got.fetched_bytes} bytes in {got.requests} requests "
                   f"({got.chunks_cached} chunks from the chunk cache) in {got.seconds:.2f} s")


@warmup.command()
@click.argument("image")
@_model_option
@click.option("--compiles", default=0, type=int, show_default=True,
              help="How many compiles the start that filled the caches did (stored with the "
                   "artifact; a later start that compiles as many calls its restore a miss).")
@click.option("--max-bytes", default="4GiB", show_default=True, metavar="SIZE",
              help="Refuse caches bigger than this.")
@registry_options
@_timeout_option
@output_option("the artifact digest, files, bytes, the key")
def capture(image: str, model_version: str | None, compiles: int, max_bytes: str,
            hosts_dir: Path | None, insecure: tuple[str, ...], tls_verify: bool,
            authfile: Path | None, timeout: float, output: str) -> None:
    """Push this environment's compile caches as IMAGE's warm-up artifact for this key.

    Run it after the app compiled (READY), in the same environment (same image, same cache
    variables). The caches go to IMAGE's repository, chunked (zstd:chunked) so that nodes
    verify and deduplicate them chunk by chunk; IMAGE's manifest is the artifact's subject.
    """
    from coldstart.config import parse_size
    from coldstart.warmup.keys import compute_key
    from coldstart.warmup.runner import capture as do_capture

    limit = parse_size(max_bytes, "--max-bytes")
    with registry_client(insecure, tls_verify, authfile, hosts_dir, timeout=timeout) as client:
        got = do_capture(client, image, key=compute_key(model_version), compiles=compiles,
                         max_bytes=limit)
    if output == "json":
        echo_json(got.to_json())
        return
    click.echo(f"{got.artifact}: {got.files} files, {got.bytes} bytes "
               f"({got.compressed_bytes} compressed), key {got.key.digest}")


@warmup.command(context_settings={"ignore_unknown_options": True})
@click.option("--image", default=None, envvar="COLDSTART_WARMUP_IMAGE", metavar="REF",
              help="The image whose warm-up artifacts to restore from and capture to "
                   "[default: $COLDSTART_WARMUP_IMAGE; none: only prove hit or miss].")
@click.option("--capture", "do_capture", is_flag=True,
              help="After READY, when the start compiled, push the caches for this key.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the restore, the verdict and any capture here as JSON (at READY, "
                   "again at exit).")
@_model_option
@_chunks_option
@registry_options
@_timeout_option
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def run(image: str | None, do_capture: bool, report: Path | None, model_version: str | None,
        chunk_cache: str | None, hosts_dir: Path | None, insecure: tuple[str, ...],
        tls_verify: bool, authfile: Path | None, timeout: float, argv: tuple[str, ...]) -> None:
    """Restore the warm-up cache, run ARGV, and say at READY whether it was a hit.

    The app's sd_notify messages are relayed to $NOTIFY_SOCKET; the one with READY=1 gets
    X_WARMUP=hit|partial|miss (`coldstart probe` publishes it). Signals are passed on; the
    exit code is the app's (128 + N when signal N ended it). Without --image nothing is
    restored and the verdict says whether the caches already here were enough. Run it with
    the app's own Python (the key names the torch that Python imports); as PID 1 of a
    container it does not reap orphans: use the runtime's init (`--init`, tini) for that.
    """
    from coldstart.warmup.runner import RunOptions, run_app

    def say(line: str) -> None:
        click.echo(f"coldstart warmup: {line}", err=True)

    opts = RunOptions(argv=list(argv), image=image, capture=do_capture, report=report,
                      chunk_cache=chunk_cache, model_version=model_version)
    if image is None:
        sys.exit(run_app(None, opts, say))
    with registry_client(insecure, tls_verify, authfile, hosts_dir, timeout=timeout) as client:
        code = run_app(client, opts, say)
    sys.exit(code)


if __name__ == "__main__":
    # python3 -m coldstart.commands.warmup …: for images that ship the package, not the script
    from coldstart.commands._common import add_common_options

    add_common_options(warmup)(prog_name="coldstart warmup")
