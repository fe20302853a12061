"""``coldstart models``: a versioned model repository on a local directory or S3, with hot swap."""

from __future__ import annotations

import dataclasses
import json
import time

import click

from coldstart.commands._common import echo_json, output_option
from coldstart.errors import ColdstartError

_ROOT_HELP = ("Repository root: a local directory or s3://BUCKET/PREFIX (standard AWS "
              "credentials; AWS_ENDPOINT_URL for S3-compatible stores). Layout: "
              "ROOT/MODEL/VERSION/... and ROOT/MODEL/active.yaml.")


def _root_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option("--root", required=True, envvar="COLDSTART_MODELS_ROOT",
                        help=_ROOT_HELP)(f)


@click.group()
def models() -> None:
    """Publish model versions, point a model at one, roll back, and follow changes live.

    A version is immutable and usable only once its completion marker (_complete.yaml, written
    after every file) exists; active.yaml names the active version and keeps the earlier ones
    for rollback.
    """


@models.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@_root_option
@click.option("--model", required=True, help="Model name (letters, digits, . _ -).")
@click.option("--version", "version", help="Version name. Default: one more than the highest "
              "numeric version.")
@click.option("--activate", is_flag=True, help="Make it the active version once complete.")
@click.option("--no-validate", is_flag=True,
              help="Skip checking the safetensors files before uploading.")
@output_option("model, version, active, location")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
def publish(folder: str, root: str, model: str, version: str | None, activate: bool,
            no_validate: bool, output: str, quiet: bool) -> None:
    """Upload FOLDER as a new version of --model.

    Example: coldstart models publish ./out --root s3://models/prod --model llama --activate
    """
    from coldstart.commands._progress import Progress
    from coldstart.weights import ModelRepository

    repo = ModelRepository(root)
    with Progress(["hash", "upload"], quiet=quiet) as progress:
        v = repo.publish(folder, model, version, activate=activate, validate=not no_validate,
                         progress=progress)
    if output == "json":
        echo_json({"model": model, "version": v, "active": activate,
                   "location": repo.location(model, v)})
        return
    click.echo(f"published {model}/{v}" + (" (active)" if activate else ""))


@models.command()
@_root_option
@click.option("--model", required=True, help="Model name.")
@click.argument("version")
@output_option("model, version, previous (null on a first activation)")
def activate(root: str, model: str, version: str, output: str) -> None:
    """Make VERSION the active version of --model (it must be complete and intact).

    Example: coldstart models activate --root /srv/models --model llama 7
    """
    from coldstart.weights import ModelRepository

    previous = ModelRepository(root).activate(model, version)
    if output == "json":
        echo_json({"model": model, "version": version, "previous": previous})
        return
    if previous is None:
        click.echo(f"{model}: active version {version} (its first active version)")
    elif previous == version:
        click.echo(f"{model}: active version {version} (already active)")
    else:
        click.echo(f"{model}: active version {version} (was {previous})")


@models.command()
@_root_option
@click.option("--model", required=True, help="Model name.")
@output_option("model, version")
def rollback(root: str, model: str, output: str) -> None:
    """Re-activate the previously active version of --model.

    Example: coldstart models rollback --root /srv/models --model llama
    """
    from coldstart.weights import ModelRepository

    version = ModelRepository(root).rollback(model)
    if output == "json":
        echo_json({"model": model, "version": version})
        return
    click.echo(f"{model}: rolled back to version {version}")


@models.command("list")
@_root_option
@click.option("--model", help="Only this model.")
@output_option("a list of {model, version, complete, active, files, bytes}", json_alias=True)
def list_cmd(root: str, model: str | None, output: str) -> None:
    """List models and versions; * marks the active one, 'incomplete' a half-written one.

    Example: coldstart models list --root s3://models/prod
    """
    from coldstart.weights import ModelRepository

    infos = ModelRepository(root).list_versions(model)
    if output == "json":
        echo_json([dataclasses.asdict(info) for info in infos])
        return
    for info in infos:
        state = "complete" if info.complete else "incomplete"
        mark = "*" if info.active else " "
        click.echo(f"{mark} {info.model}/{info.version}\t{state}\t{info.files} files\t"
                   f"{info.bytes / 1e6:.1f} MB")


@models.command()
@_root_option
@click.option("--model", required=True, help="Model name.")
@click.option("--interval", type=click.FloatRange(0.01), default=5.0, show_default=True,
              help="Seconds between reads of active.yaml.")
@click.option("--device", default="cpu", show_default=True,
              help="Where each version's tensors are loaded (cpu or cuda).")
@click.option("--once", is_flag=True, help="Load the active version, report, and exit.")
@output_option("one JSON object per line and event: serving, refused, stopped")
def watch(root: str, model: str, interval: float, device: str, once: bool,
          output: str) -> None:
    """Load the active version of --model and hot-swap whenever active.yaml changes.

    The new version is loaded beside the serving one and swapped in only when complete and
    valid; a version that fails keeps the old one serving (reported, not retried until the
    pointer moves). Example: coldstart models watch --root s3://models/prod --model llama
    """
    from coldstart.weights import ModelRepository, ModelWatcher, load

    def loader(location: str) -> dict[str, object]:
        return dict(load(location, device=device))

    def event(kind: str, text: str, err: bool = False, **fields: object) -> None:
        if output == "json":
            click.echo(json.dumps({"event": kind, "model": model, **fields}))
        else:
            click.echo(text, err=err)

    def on_swap(old: object, new: object) -> None:
        version = getattr(new, "version", None)
        tensors = len(getattr(new, "value", {}))
        event("serving", f"{model}: serving version {version or '?'} ({tensors} tensors)",
              version=version, tensors=tensors)

    watcher: ModelWatcher[dict[str, object]] = ModelWatcher(
        ModelRepository(root), model, loader=loader, poll_interval=interval, on_swap=on_swap)
    last_error: BaseException | None = None

    def report() -> None:
        nonlocal last_error
        cur = watcher.current()
        if watcher.last_error is not None and watcher.last_error is not last_error:
            last_error = watcher.last_error
            event("refused", f"{model}: refused new version, still serving "
                  f"{cur.version if cur else 'nothing'}: {last_error}", err=True,
                  serving=cur.version if cur else None, error=str(last_error))

    watcher.poll_once()
    report()
    if once:
        if watcher.current() is None:
            raise ColdstartError(f"{model}: nothing to serve")
        return
    try:
        while True:
            time.sleep(interval)
            watcher.poll_once()
            report()
    except KeyboardInterrupt:
        event("stopped", f"{model}: stopped")
