"""``coldstart router``: pick, release, quarantine and list a service's targets in Valkey/Redis."""

from __future__ import annotations

import click

from coldstart.commands._common import echo_json, output_option
from coldstart.probe.router import POLICIES, Router

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
@click.option("--policy", type=click.Choice(POLICIES), default="spread", show_default=True,
              help="spread: the fewest requests in flight, ties at random. pack: the most in "
                   "flight that still has room, ties by name, so the others stay idle (for "
                   "targets with a --capacity, e.g. concurrency-1 GPU pods).")
@_redis_option
@_timeout_option
@output_option("service, target")
def pick(service: str, policy: str, url: str, timeout: float, output: str) -> None:
    """Print a READY, live, non-quarantined target of SERVICE that has room for a request.

    Its in-flight count goes up by one; `release` it when the request is over. Exits 3 when no
    target can take a request. The pick costs the store O(log n) in the service's targets.
    """
    target = Router.connect(url, service, timeout, policy=policy).pick()
    if output == "json":
        echo_json({"service": service, "target": target})
        return
    click.echo(target)


@router.command()
@click.argument("service")
@click.argument("target")
@click.option("--failed", is_flag=True,
              help="The request failed to connect: also quarantine TARGET (backoff doubles "
                   "with each consecutive failure).")
@_redis_option
@_timeout_option
@output_option("service, target, inflight, quarantine_s (null unless --failed)")
def release(service: str, target: str, failed: bool, url: str, timeout: float,
            output: str) -> None:
    """Mark one request to TARGET of SERVICE as finished; prints its in-flight count."""
    r = Router.connect(url, service, timeout)
    count = r.release(target, ok=not failed)
    backoff = r.quarantine(target) if failed else None
    if output == "json":
        echo_json({"service": service, "target": target, "inflight": count,
                   "quarantine_s": backoff})
    elif backoff is not None:
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
@output_option("service, target, quarantine_s")
def quarantine(service: str, target: str, base: float, limit: float, url: str,
               timeout: float, output: str) -> None:
    """Keep TARGET of SERVICE out of picks after a connection failure; prints the backoff."""
    backoff = Router.connect(url, service, timeout).quarantine(target, base, limit)
    if output == "json":
        echo_json({"service": service, "target": target, "quarantine_s": backoff})
        return
    click.echo(f"{backoff:g}")


@router.command(name="list")
@click.argument("service")
@_redis_option
@_timeout_option
@output_option("a list of {target, state, inflight, heartbeat_ms, quarantine_ms, strikes, "
               "pooled, status}", json_alias=True)
def list_(service: str, url: str, timeout: float, output: str) -> None:
    """Show every target of SERVICE: state, in flight, heartbeat left, quarantine, progress.

    POOL is "yes" for the targets a pick may take now (READY, alive, not quarantined, with room).

    Read a page of targets per call to the store, so a large service never holds it up.
    """
    views = Router.connect(url, service, timeout).list()
    if output == "json":
        echo_json([{
            "target": v.target, "state": v.state, "inflight": v.inflight,
            "heartbeat_ms": v.heartbeat_ms, "quarantine_ms": v.quarantine_ms,
            "strikes": v.strikes, "pooled": v.pooled, "status": v.doc,
        } for v in views])
        return
    click.echo(f"{'TARGET':<28} {'STATE':<9} {'POOL':<4} {'INFLIGHT':>8} {'HEARTBEAT':>10} "
               f"{'QUARANTINE':>10}  DETAIL")
    for v in views:
        hb = f"{v.heartbeat_ms / 1000:.1f}s" if v.alive else "expired"
        q = f"{v.quarantine_ms / 1000:.1f}s" if v.quarantine_ms else "-"
        extra = v.doc.get("phase") or ""
        if "progress" in v.doc:
            extra = f"{extra} {float(v.doc['progress']) * 100:.0f}%".strip()
        detail = v.doc.get("detail", "")
        pool = "yes" if v.pooled else "-"
        click.echo(f"{v.target:<28} {v.state:<9} {pool:<4} {v.inflight:>8} {hb:>10} {q:>10}  "
                   f"{extra} {detail}".rstrip())


@router.command()
@click.argument("service")
@click.argument("target")
@_redis_option
@_timeout_option
@output_option("service, target, forgotten")
def forget(service: str, target: str, url: str, timeout: float, output: str) -> None:
    """Remove TARGET from SERVICE entirely (it is gone for good); prints nothing in text."""
    if not Router.connect(url, service, timeout).forget(target):
        from coldstart.errors import NotFound

        raise NotFound(f"{target} is not a target of {service}")
    if output == "json":
        echo_json({"service": service, "target": target, "forgotten": True})
