"""``coldstart models``: a versioned model repository on a local directory or S3, with hot swap."""

from __future__ import annotations

import json
import time

import click

from coldstart.errors import ColdstartError

_ROOT_HELP = ("Repository root: a local directory or s3://BUCKET/PREFIX (standard AWS "
              "credentials; AWS_ENDPOINT_URL for S3-compatible stores). Layout: "
              "ROOT/MODEL/VERSION/... and ROOT/MODEL/active.yaml.")


def _root_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option("--root", required=True, envvar="COLDSTART_MODELS_ROOT",
                        help=_ROOT_HELP + " Env: COLDSTART_MODELS_ROOT.")(f)


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
def publish(folder: str, root: str, model: str, version: str | None, activate: bool,
            no_validate: bool) -> None:
    """Upload FOLDER as a new version of --model.

    Example: coldstart models publish ./out --root s3://models/prod --model llama --activate
    """
    from coldstart.weights import ModelRepository

    repo = ModelRepository(root)
    v = repo.publish(folder, model, version, activate=activate, validate=not no_validate)
    click.echo(f"published {model}/{v}" + (" (active)" if activate else ""))


@models.command()
@_root_option
@click.option("--model", required=True, help="Model name.")
@click.argument("version")
def activate(root: str, model: str, version: str) -> None:
    """Make VERSION the active version of --model (it must be complete and intact).

    Example: coldstart models activate --root /srv/models --model llama 7
    """
    from coldstart.weights import ModelRepository

    previous = ModelRepository(root).activate(model, version)
    click.echo(f"{model}: active version {version} (was {previous})")


@models.command()
@_root_option
@click.option("--model", required=True, help="Model name.")
def rollback(root: str, model: str) -> None:
    """Re-activate the previously active version of --model.

    Example: coldstart models rollback --root /srv/models --model llama
    """
    from coldstart.weights import ModelRepository

    version = ModelRepository(root).rollback(model)
    click.echo(f"{model}: rolled back to version {version}")


@models.command("list")
@_root_option
@click.option("--model", help="Only this model.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def list_cmd(root: str, model: str | None, as_json: bool) -> None:
    """List models and versions; * marks the active one, 'incomplete' a half-written one.

    Example: coldstart models list --root s3://models/prod
    """
    from coldstart.weights import ModelRepository

    for info in ModelRepository(root).list_versions(model):
        if as_json:
            click.echo(json.dumps(info.__dict__))
        else:
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
def watch(root: str, model: str, interval: float, device: str, once: bool) -> None:
    """Load the active version of --model and hot-swap whenever active.yaml changes.

    The new version is loaded beside the serving one and swapped in only when complete and
    valid; a version that fails keeps the old one serving (reported, not retried until the
    pointer moves). Example: coldstart models watch --root s3://models/prod --model llama
    """
    from coldstart.weights import ModelRepository, ModelWatcher, load

    def loader(location: str) -> dict[str, object]:
        return dict(load(location, device=device))

    def on_swap(old: object, new: object) -> None:
        click.echo(f"{model}: serving version {getattr(new, 'version', '?')} "
                   f"({len(getattr(new, 'value', {}))} tensors)")

    watcher: ModelWatcher[dict[str, object]] = ModelWatcher(
        ModelRepository(root), model, loader=loader, poll_interval=interval, on_swap=on_swap)
    last_error: BaseException | None = None

    def report() -> None:
        nonlocal last_error
        cur = watcher.current()
        if watcher.last_error is not None and watcher.last_error is not last_error:
            last_error = watcher.last_error
            click.echo(f"{model}: refused new version, still serving "
                       f"{cur.version if cur else 'nothing'}: {last_error}", err=True)

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
        click.echo(f"{model}: stopped")
