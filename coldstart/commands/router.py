"""``coldstart router``: pick, release, quarantine and list a service's targets in Valkey/Redis."""

from __future__ import annotations

import json

import click

from coldstart.probe.router import Router

_redis_option = click.option(
    "--redis", "url", default="redis://127.0.0.1:6379/0", show_default=True,
    envvar="COLDSTART_REDIS", metavar="URL",
    help="Valkey/Redis holding the routing state (redis://, rediss://, valkey://).",
)
_timeout_option = click.option(
    "--timeout", type=float, default=2.0, show_default=True,
    help="Deadline of each Redis call (s).",
)


@click.group()
def router() -> None:
    """Route requests to READY targets, as the probers report them.

    \b
    coldstart router pick llama            # prints a target, counts one request in flight
    coldstart router release llama 10.0.0.5:8000
    coldstart router list llama
    """


@router.command()
@click.argument("service")
@_redis_option
@_timeout_option
def pick(service: str, url: str, timeout: float) -> None:
    """Print the least-loaded READY, live, non-quarantined target of SERVICE.

    Its in-flight count goes up by one; `release` it when the request is over. Exits 3 when no
    target can take a request.
    """
    click.echo(Router.connect(url, service, timeout).pick())


@router.command()
@click.argument("service")
@click.argument("target")
@click.option("--failed", is_flag=True,
              help="The request failed to connect: also quarantine TARGET (backoff doubles "
                   "with each consecutive failure).")
@_redis_option
@_timeout_option
def release(service: str, target: str, failed: bool, url: str, timeout: float) -> None:
    """Mark one request to TARGET of SERVICE as finished; prints its in-flight count."""
    r = Router.connect(url, service, timeout)
    count = r.release(target, ok=not failed)
    if failed:
        backoff = r.quarantine(target)
        click.echo(f"{count} (quarantined for {backoff:g} s)")
    else:
        click.echo(str(count))


@router.command()
@click.argument("service")
@click.argument("target")
@click.option("--base", type=float, default=1.0, show_default=True,
              help="Backoff of the first strike (s); it doubles with each one.")
@click.option("--limit", type=float, default=60.0, show_default=True,
              help="Longest backoff (s).")
@_redis_option
@_timeout_option
def quarantine(service: str, target: str, base: float, limit: float, url: str,
               timeout: float) -> None:
    """Keep TARGET of SERVICE out of picks after a connection failure; prints the backoff."""
    click.echo(f"{Router.connect(url, service, timeout).quarantine(target, base, limit):g}")


@router.command(name="list")
@click.argument("service")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per target.")
@_redis_option
@_timeout_option
def list_(service: str, as_json: bool, url: str, timeout: float) -> None:
    """Show every target of SERVICE: state, in flight, heartbeat left, quarantine, progress."""
    views = Router.connect(url, service, timeout).list()
    if as_json:
        for v in views:
            click.echo(json.dumps({
                "target": v.target, "state": v.state, "inflight": v.inflight,
                "heartbeat_ms": v.heartbeat_ms, "quarantine_ms": v.quarantine_ms,
                "strikes": v.strikes, "status": v.doc,
            }))
        return
    click.echo(f"{'TARGET':<28} {'STATE':<9} {'INFLIGHT':>8} {'HEARTBEAT':>10} "
               f"{'QUARANTINE':>10}  DETAIL")
    for v in views:
        hb = f"{v.heartbeat_ms / 1000:.1f}s" if v.alive else "expired"
        q = f"{v.quarantine_ms / 1000:.1f}s" if v.quarantine_ms else "-"
        extra = v.doc.get("phase") or ""
        if "progress" in v.doc:
            extra = f"{extra} {float(v.doc['progress']) * 100:.0f}%".strip()
        detail = v.doc.get("detail", "")
        click.echo(f"{v.target:<28} {v.state:<9} {v.inflight:>8} {hb:>10} {q:>10}  "
                   f"{extra} {detail}".rstrip())


@router.command()
@click.argument("service")
@click.argument("target")
@_redis_option
@_timeout_option
def forget(service: str, target: str, url: str, timeout: float) -> None:
    """Remove TARGET from SERVICE entirely (it is gone for good)."""
    if not Router.connect(url, service, timeout).forget(target):
        from coldstart.errors import NotFound

        raise NotFound(f"{target} is not a target of {service}")
