#!/usr/bin/env python3
"""How much of a second snapshot a node that holds the first does not fetch, and what the
registry stores for it: the dedup figure of issue 50.

    .venv/bin/python bench/bench_snapshot_dedup.py --storage bench/images/registry \\
        --repo bench/compile --first sha256:… --second sha256:… [--json out.json]
    .venv/bin/python bench/bench_snapshot_dedup.py --storage bench/images/registry \\
        --repo bench/torch --changed zstd-chunked --command "python3 -c '…'" [--json out.json]

``--first`` and ``--second`` are snapshot artifacts (the digests ``coldstart bench`` prints for
its snapshot modes, or ``coldstart snapshot create -o json`` gives) in repository ``--repo`` of
the registry whose storage is ``--storage`` (started here on loopback, stopped afterwards).
``--changed TAG`` makes them: the image ``REPO:TAG`` and the same image plus a new app layer
(pushed as ``TAG-v2``), each started once by ``coldstart bench`` (mode coldstart+snapshot),
checkpointed at READY and pushed.
For each bundle it reads the TOC (verified against the artifact's annotation) and reports:

* chunks and their compressed bytes, pages and rootfs apart;
* the second's chunks whose digest the first has (a node's snapshot chunk cache holds one
  copy of each: what a restore of the second on a node that restored the first fetches is the
  rest), as chunks and compressed bytes;
* what the registry stores for the second: its whole bundle blob (one blob per snapshot; the
  registry does not share parts of blobs), against the first's.

Pages are cut by content (:mod:`coldstart.snapshot.bundle`), so the same pages at other
offsets make the same chunks; the script also counts what a fixed 1 MiB grid would have
shared, from the pages themselves, as the baseline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from coldstart.format.layer import SeekableLayer, open_layer
from coldstart.oci.manifest import OCI_MANIFEST
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.remote.registry_blob import open_blob
from coldstart.stack.registry import start_registry


def _bundle(client: RegistryClient, repo: Reference, digest: str) -> tuple[dict[str, Any],
                                                                           SeekableLayer]:
    body, _, _ = client.get_manifest(repo.with_digest(digest), (OCI_MANIFEST,))
    layer = json.loads(body)["layers"][0]
    blob = open_blob(client, repo, layer["digest"], int(layer["size"]))
    return layer, open_layer(blob, annotations=layer["annotations"])


def _chunks(lay: SeekableLayer) -> dict[str, tuple[int, int, str]]:
    """digest -> (compressed bytes, raw bytes, owner kind) of every chunk of the bundle."""
    out: dict[str, tuple[int, int, str]] = {}
    for name, entry in lay.toc.entries.items():
        if entry.type != "reg":
            continue
        kind = "pages" if "/pages-" in name else "rootfs" if name == "rootfs.tar" else "other"
        for c in entry.chunks:
            if c.digest and not c.zeros:
                out.setdefault(c.digest, (c.end_offset - c.offset, c.chunk_size, kind))
    return out


def _grid(lay: SeekableLayer, grid: int = 1 << 20) -> list[str]:
    """Digests of the pages files cut every ``grid`` bytes (1 MiB: the baseline of no content
    cuts; 4 KiB: each page, the most any cut could share)."""
    out = []
    for name, entry in lay.toc.entries.items():
        if entry.type == "reg" and "/pages-" in name:
            data = lay.read_file(name)
            for off in range(0, len(data), grid):
                out.append(hashlib.sha256(data[off:off + grid]).hexdigest())
    return out


def compare(client: RegistryClient, repo: Reference, first: str, second: str) -> dict[str, Any]:
    """What a node that holds snapshot ``first`` fetches of snapshot ``second``, and what the
    registry stores for it."""
    la, lay_a = _bundle(client, repo, first)
    lb, lay_b = _bundle(client, repo, second)
    ca, cb = _chunks(lay_a), _chunks(lay_b)
    shared = {d: v for d, v in cb.items() if d in ca}
    new = {d: v for d, v in cb.items() if d not in ca}
    ga, gb = set(_grid(lay_a)), set(_grid(lay_b))
    zero = hashlib.sha256(bytes(4096)).hexdigest()
    pa, pb = set(_grid(lay_a, 4096)), [p for p in _grid(lay_b, 4096) if p != zero]
    return {
        "first": {"artifact": first, "blob_bytes": int(la["size"]), "chunks": len(ca),
                  "compressed_bytes": sum(v[0] for v in ca.values())},
        "second": {"artifact": second, "blob_bytes": int(lb["size"]), "chunks": len(cb),
                   "compressed_bytes": sum(v[0] for v in cb.values()),
                   "pages_raw_bytes": sum(v[1] for v in cb.values() if v[2] == "pages")},
        "shared_chunks": len(shared),
        "shared_compressed_bytes": sum(v[0] for v in shared.values()),
        "new_chunks": len(new),
        "new_compressed_bytes": sum(v[0] for v in new.values()),
        "fetched_fraction_on_a_node_with_the_first": (
            sum(v[0] for v in new.values()) / max(1, sum(v[0] for v in cb.values()))),
        "registry_adds_bytes": int(lb["size"]),
        "grid_1mib_pages_shared_fraction": len(gb & ga) / max(1, len(gb)),
        # the second's non-zero pages found anywhere in the first: what no cut can beat
        "nonzero_pages": len(pb),
        "nonzero_pages_in_the_first_fraction": sum(1 for p in pb if p in pa) / max(1, len(pb)),
    }


def derive(client: RegistryClient, base: Reference, tag: str, files: dict[str, bytes]) -> str:
    """Push ``base`` (a zstd:chunked image) plus one layer holding ``files`` as ``tag`` in its
    repository (a new app layer on the same image: what a new version of an app is); its
    reference."""
    import io
    import tarfile

    from coldstart.format.writer import convert_layer
    from coldstart.oci.manifest import canonical_json, digest_of

    body, media_type, _ = client.get_manifest(base, (OCI_MANIFEST,))
    manifest = json.loads(body)
    config = json.loads(client.get_blob(base, manifest["config"]["digest"]))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    raw.seek(0)
    out = io.BytesIO()
    layer = convert_layer(raw, out, format="zstd:chunked")
    client.push_blob(base, out.getvalue(), layer.digest)
    config["rootfs"]["diff_ids"].append(layer.diff_id)
    config.setdefault("history", []).append({"created_by": "bench_snapshot_dedup: a new app "
                                             "layer"})
    cfg = canonical_json(config)
    client.push_blob(base, cfg, digest_of(cfg))
    manifest["config"] = {**manifest["config"], "digest": digest_of(cfg), "size": len(cfg)}
    manifest["layers"].append({"mediaType": layer.media_type, "digest": layer.digest,
                               "size": layer.size, "annotations": layer.annotations})
    ref = Reference.parse(f"{base.registry}/{base.repository}:{tag}")
    client.push_manifest(ref, canonical_json(manifest), media_type or OCI_MANIFEST)
    return str(ref)


def _snapshot_of(ref: str, command: str, workdir: Path) -> str:
    """One ``coldstart bench`` run of mode coldstart+snapshot on ``ref``: its preparation
    takes the snapshot (one start, checkpointed at READY, pushed beside the image); its
    artifact digest."""
    import subprocess

    out = workdir / f"bench-{ref.rpartition(':')[2]}.json"
    argv = [str(Path(sys.executable).parent / "coldstart"), "bench", ref, "--embedded",
            "--runs", "1", "--mode", "coldstart+snapshot", "--image",
            f"coldstart+snapshot={ref}", "--no-floor", "--no-limit", "--ready", "notify",
            "--command", command, "--json", str(out), "-q"]
    subprocess.run(argv, check=True, timeout=1800)
    doc = json.loads(out.read_text())
    return str(doc["image"]["snapshot"]["coldstart+snapshot"]["digest"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storage", type=Path, required=True,
                    help="the registry's directory (coldstart bench's: bench/images/registry)")
    ap.add_argument("--repo", required=True, help="repository, e.g. bench/compile")
    ap.add_argument("--first", help="a snapshot artifact's digest")
    ap.add_argument("--second", help="another one's")
    ap.add_argument("--changed", metavar="TAG",
                    help="instead of --first/--second: snapshot the image REPO:TAG "
                         "(zstd:chunked) and the same image plus a new app layer, each "
                         "started with --command, and compare the two")
    ap.add_argument("--command", default="", help="the app's command (with --changed)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if not a.changed and not (a.first and a.second):
        ap.error("give --first and --second, or --changed TAG")
    with start_registry(a.storage, log_level="error") as reg, \
            RegistryClient(insecure_hosts=[reg.host]) as client:
        repo = Reference.parse(f"{reg.host}/{a.repo}:x")
        extra: dict[str, Any] = {}
        if a.changed:
            import tempfile

            base = Reference.parse(f"{reg.host}/{a.repo}:{a.changed}")
            app = (b"# app v2: a new version of the app's code\n" +
                   b"VERSION = 2\n" * 4096)
            changed = derive(client, base, f"{a.changed}-v2", {"app/version.py": app})
            with tempfile.TemporaryDirectory(prefix="dedup-") as tmp:
                a.first = _snapshot_of(str(base), a.command, Path(tmp))
                a.second = _snapshot_of(changed, a.command, Path(tmp))
            extra = {"first_image": str(base), "second_image": changed,
                     "change": "one new layer: app/version.py"}
        doc = {**extra, **compare(client, repo, a.first, a.second)}
    print(json.dumps(doc, indent=1))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
