"""Issue 11, the hybrid fill: with ``fetch.background_rate`` on, every layer of a lazily pulled
image ends local (state ``complete`` in the FUSE server's status, ``coldstart snapshotter
status``); then the registry is stopped and every file of every layer still reads back
byte for byte, from the chunk cache alone."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest

from coldstart.lazyfs.client import FuseServerClient
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack.registry import start_registry
from tests.integration.pull.pull_env import coldstart_cli, lazy_stack, push_image, rich_layers

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_filled_image_reads_whole_with_the_registry_gone(tmp_path: Path) -> None:
    layers = rich_layers(seed=11)
    with contextlib.ExitStack() as stack:
        reg = stack.enter_context(start_registry(tmp_path / "registry"))
        src = f"{reg.host}/fill/app:gzip"
        dst = f"{reg.host}/fill/app:zstd"
        with RegistryClient() as client:
            push_image(client, src, layers)
        proc = coldstart_cli("convert", src, dst)
        assert proc.returncode == 0, proc.stderr
        with RegistryClient() as client:
            digests = [d.digest for d in client.resolve(Reference.parse(dst)).manifest.layers]
        with lazy_stack(background_rate=1 << 30) as st:
            proc = coldstart_cli("pull", "--address", st.ctd.address, "--namespace", "fill", dst)
            assert proc.returncode == 0, proc.stderr
            client_ = FuseServerClient(st.fuse_socket)
            deadline = time.monotonic() + 120
            rows = client_.status()
            while not (rows and all(r["state"] == "complete" for r in rows)):
                assert time.monotonic() < deadline, rows
                time.sleep(0.2)
                rows = client_.status()
            assert {r["digest"] for r in rows} == set(digests)
            assert all(r["local_bytes"] == r["total_bytes"] > 0 for r in rows)
            assert sum(r["filled_bytes"] for r in rows) > 0
            # the CLI shows the same
            cli = coldstart_cli("snapshotter", "status", "--fuse-socket", st.fuse_socket,
                                "-o", "json")
            assert cli.returncode == 0, cli.stderr
            assert {r["state"] for r in json.loads(cli.stdout)} == {"complete"}
            table = coldstart_cli("snapshotter", "status", "--fuse-socket", st.fuse_socket)
            assert table.stdout.count("complete") == len(digests)

            reg_stack = stack.pop_all()
            reg_stack.close()                    # the registry is gone from here on
            requests = sum(r["requests"] for r in client_.status())
            checked = 0
            for row in rows:
                entries = layers[digests.index(row["digest"])]
                root = Path(row["mountpoint"])
                for e in entries:
                    if e.kind == "file" and e.data:
                        assert (root / e.path).read_bytes() == e.data, e.path
                        checked += 1
            assert checked > 10
            assert sum(r["requests"] for r in client_.status()) == requests
            assert all(r["errors"] == 0 for r in client_.status())
