"""Snapshot restore with real containerd, runc, CRIU and coldstart's lazily pulling snapshotter.

Each "node" is a fresh containerd with its own coldstart snapshotter, FUSE server and chunk
caches (``temp_local_stack``); the runtime binary is ``coldstart-runc`` (``ctr run
--runc-binary``), the container asks for a restore with the ``dev.coldstart.snapshot``
annotation. The app is a shell that, before it says it is ready, draws a random number (the
state a restore must bring back, and a fresh start cannot), writes it to its rootfs
(``/tmp/x``, the rootfs changes) and keeps a file of the image open; asked through a bind
mount, it answers with both, on its standard output as well.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldstart.oci.registry import RegistryClient
from coldstart.snapshot.criu import find_criu
from coldstart.stack.images import Entry, busybox_entries
from coldstart.stack.snapshotter import LocalStack
from tests.fixtures.registry import Registry
from tests.integration.pull.pull_env import coldstart_cli, lazy_stack, push_image

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

#: installed beside the interpreter running the tests (.venv/bin), as pip installs it
WRAPPER = str(Path(sys.executable).absolute().parent / "coldstart-runc")
APPLETS = ("sh", "cat", "ls", "echo", "sha256sum", "head", "sleep", "rm", "touch", "kill", "mv")
ANNOTATION = "dev.coldstart.snapshot"

#: draw the state, write it into the rootfs, hold an image file open, say READY through a
#: file; on /io/q answer "<x> <x from /tmp/x> <digest of the open file's start>" into /io/a
#: and on stdout; a USR2 (the after-restore signal here) appends to /io/hook. /io is a
#: directory of the container's own (the key holds the command and environment: every
#: container runs the very same one)
APP = (
    "trap 'echo hook >> /io/hook' USR2; "
    "[ -f /tmp/x ] && echo leftover > /io/leftover; "
    "exec 3< /data/blob; "
    "x=$(head -c 4096 /dev/urandom | sha256sum | head -c 64); echo $x > /tmp/x; "
    "touch /io/ready; "
    "while true; do if [ -f /io/q ]; then rm /io/q; "
    "a=\"$x $(cat /tmp/x) $(cat /data/blob | head -c 100000 | sha256sum | head -c 8)\"; "
    "echo \"answer $a\"; echo \"$a\" > /io/a.tmp; mv /io/a.tmp /io/a; fi; "
    "sleep 0.02; done"
)


def _layers(blob: bytes) -> list[list[Entry]]:
    return [busybox_entries(APPLETS),
            [Entry("data", "dir", mode=0o755), Entry("data/blob", data=blob)]]


@dataclass
class Env:
    ref: str             # the app's image (zstd:chunked)
    other: str           # the same app, another /data/blob (another size)
    io: Path             # bind-mounted at /io in every container
    config: Path         # the wrapper's config ($COLDSTART_CONFIG)
    state: Path          # its state_dir
    chunks: Path         # its chunk cache
    registry: Registry


@pytest.fixture(scope="module")
def env(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.fail("snapshot restore needs root (CRIU, runc, containerd)")
    criu = find_criu(check=True)
    if not criu.usable:
        pytest.fail(f"CRIU cannot restore on this machine ({'; '.join(criu.problems)}); "
                    "scripts/install.sh builds CRIU 4.2.1")
    assert os.path.exists(WRAPPER), f"{WRAPPER} missing: pip install -e . installs it"
    tmp = tmp_path_factory.mktemp("snapshot")
    refs = []
    with RegistryClient(insecure_hosts=[registry.host]) as client:
        for tag, blob in (("a", os.urandom(300_000)), ("b", os.urandom(200_000))):
            src = f"{registry.host}/snap/app:{tag}-gzip"
            push_image(client, src, _layers(blob))
            dst = f"{registry.host}/snap/app:{tag}"
            proc = coldstart_cli("convert", src, dst, "--format", "zstd-chunked")
            assert proc.returncode == 0, proc.stderr
            refs.append(dst)
    io = tmp / "io"
    io.mkdir()
    e = Env(refs[0], refs[1], io, tmp / "config.toml", tmp / "state", tmp / "chunks", registry)
    _write_config(e)
    old = os.environ.get("COLDSTART_CONFIG")
    # containerd's environment is the shim's and so the wrapper's
    os.environ["COLDSTART_CONFIG"] = str(e.config)
    try:
        yield e
    finally:
        if old is None:
            os.environ.pop("COLDSTART_CONFIG", None)
        else:
            os.environ["COLDSTART_CONFIG"] = old


def _write_config(e: Env, fuse_socket: str = "", **snapshot: str | float) -> None:
    table = {"state_dir": str(e.state), "chunk_dir": str(e.chunks),
             "work_dir": str(e.state.parent / "work"), "signal": "SIGUSR2", **snapshot}
    lines = ["[snapshot]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    if fuse_socket:
        lines += ["[fuse]", f"socket = {json.dumps(fuse_socket)}"]
    e.config.write_text("\n".join(lines) + "\n")


@contextmanager
def node(e: Env, **snapshot: str | float) -> Iterator[LocalStack]:
    """A cold node: a new containerd, snapshotter, FUSE server, chunk cache and snapshot
    chunk cache (``snapshot``: more of the wrapper's settings)."""
    e.chunks = Path(tempfile.mkdtemp(prefix="chunks-", dir=e.config.parent))
    with lazy_stack() as st:
        # the wrapper reads it at each call: its FUSE server (a lazy restore's) is this node's
        _write_config(e, st.fuse_socket, **snapshot)
        for ref in (e.ref, e.other):
            out = st.ctr("image", "pull", "--plain-http", "--snapshotter", "coldstart", ref)
            assert out.returncode == 0, out.stderr
        yield st


def _start(st: LocalStack, e: Env, name: str, *, image: str | None = None,
           annotation: str | None = "same",
           env: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    ref = image or e.ref
    io = e.io / name
    io.mkdir(exist_ok=True)
    argv = ["run", "-d", "--runc-binary", WRAPPER, "--snapshotter", "coldstart",
            "--log-uri", f"file://{e.io / (name + '.log')}",
            "--mount", f"type=bind,src={io},dst=/io,options=rbind:rw"]
    for v in env:
        argv += ["--env", v]
    if annotation is not None:
        argv += ["--annotation", f"{ANNOTATION}={ref if annotation == 'same' else annotation}"]
    return st.ctr(*argv, ref, name, "sh", "-c", APP)


def _wait(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _ask(e: Env, name: str) -> list[str]:
    (e.io / name / "a").unlink(missing_ok=True)
    (e.io / name / "q").touch()
    _wait(e.io / name / "a", 30)
    return (e.io / name / "a").read_text().split()


def _remove(st: LocalStack, name: str) -> None:
    st.ctr("task", "kill", "-s", "SIGKILL", name)
    for _ in range(100):
        if st.ctr("task", "delete", name).returncode == 0:
            break
        time.sleep(0.05)
    st.ctr("container", "delete", name)


def _events(e: Env) -> list[dict[str, object]]:
    try:
        lines = (e.state / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(ln) for ln in lines]


def _last_event(e: Env, name: str) -> dict[str, object]:
    """The last restore attempt of ``name`` (a lazy restore's pager may have written its own
    end, pages-in or pages-failed, after it already)."""
    mine = [ev for ev in _events(e) if ev.get("container") == name and
            ev.get("outcome") in ("restored", "fallback")]
    assert mine, f"no restore attempt of {name} recorded"
    return mine[-1]


def _take_snapshot(st: LocalStack, e: Env, name: str, *, image: str | None = None,
                   env: tuple[str, ...] = ()) -> tuple[list[str], dict[str, object]]:
    """Start ``name`` (a fallback: no snapshot yet, or another key), wait until it is ready,
    ask it once, checkpoint and push; its answer and create's JSON."""
    out = _start(st, e, name, image=image, env=env)
    assert out.returncode == 0, out.stderr
    _wait(e.io / name / "ready")
    before = _ask(e, name)
    proc = coldstart_cli("snapshot", "create", name, "--address", st.address, "--namespace",
                         "default", "--push", "-o", "json", *(["--image", image] if image else []),
                         timeout=300)
    assert proc.returncode == 0, proc.stderr
    _remove(st, name)
    return before, json.loads(proc.stdout)


def _leftovers(e: Env) -> list[str]:
    """What the wrapper left on the node besides its logs, counters and CRIU check cache."""
    out = [str(p) for p in (e.state.parent / "work").glob("*")]
    out += [str(p) for p in (e.state / "containers").glob("*")]
    criu = subprocess.run(["pgrep", "-x", "criu"], capture_output=True, text=True).stdout
    out += [f"criu process {p}" for p in criu.split()]
    with open("/proc/self/mountinfo") as f:
        out += [ln for ln in f if str(e.state) in ln or str(e.state.parent / "work") in ln]
    return out


@pytest.fixture(scope="module")
def snapshot_a(env: Env) -> tuple[list[str], dict[str, object]]:
    """A snapshot of the app on image a, taken on a node of its own."""
    with node(env) as st:
        return _take_snapshot(st, env, "src")


def test_a_restored_container_has_the_state_built_before_the_checkpoint(
        env: Env, snapshot_a: tuple[list[str], dict[str, object]]) -> None:
    before, created = snapshot_a
    assert created["pages_bytes"] and created["rootfs_bytes"], created
    key = created["key"]
    assert isinstance(key, dict) and key["components"]["image"].startswith("sha256:")
    with node(env) as st:       # a cold node: new containerd, snapshotter, chunk caches
        out = _start(st, env, "r1")
        assert out.returncode == 0, out.stderr
        ev = _last_event(env, "r1")
        assert ev["outcome"] == "restored", ev
        assert ev["snapshot"] == created["digest"]
        assert not (env.io / "r1" / "ready").exists()       # it did not start from the top
        after = _ask(env, "r1")
        # the random number drawn before the checkpoint, the rootfs change, the open file
        assert after[0] == before[0] and after[1] == before[1] == before[0]
        assert after[2] == before[2]
        # its standard output is the new container's log
        deadline = time.monotonic() + 10
        while "answer " + " ".join(after) not in (env.io / "r1.log").read_text():
            assert time.monotonic() < deadline, (env.io / "r1.log").read_text()
            time.sleep(0.05)
        # the after-restore hook ran once (the app traps the configured signal)
        assert (env.io / "r1" / "hook").read_text().split() == ["hook"]
        assert ev["signalled"] and len(ev["signalled"]) == 1
        # what the process had read of its mapped files (its shell, libc) was read ahead
        # through the container's rootfs while the pages came
        warm = ev["warm"]
        assert isinstance(warm, dict) and warm["files"] >= 1 and warm["bytes"] > 0, warm
        tasks = st.ctr("task", "ls").stdout
        assert "r1" in tasks and "RUNNING" in tasks
        _remove(st, "r1")
        assert _leftovers(env) == []
        # a second restore on this node takes every page from the node's chunk cache, which
        # the first filled once its app was told
        out = _start(st, env, "r1b")
        assert out.returncode == 0, out.stderr
        ev = _last_event(env, "r1b")
        assert ev["outcome"] == "restored", ev
        assert ev["chunks_fetched"] == 0 and int(str(ev["chunks_cached"])) > 0, ev
        assert _ask(env, "r1b")[0] == before[0]
        _remove(st, "r1b")
        assert _leftovers(env) == []


def test_two_restores_of_one_snapshot_on_one_node_at_once(
        env: Env, snapshot_a: tuple[list[str], dict[str, object]]) -> None:
    before, _ = snapshot_a
    with node(env) as st:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda n: _start(st, env, n), ["t1", "t2"]))
        assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
        for name in ("t1", "t2"):
            assert _last_event(env, name)["outcome"] == "restored"
            assert _ask(env, name)[0] == before[0]
        # the second took the chunks the first fetched, or fetched them itself: never fewer
        # than all between them
        evs = [_last_event(env, n) for n in ("t1", "t2")]
        assert all(int(str(ev["chunks_cached"])) + int(str(ev["chunks_fetched"])) > 0
                   for ev in evs)
        for name in ("t1", "t2"):
            _remove(st, name)
        assert _leftovers(env) == []


def _flip(e: Env, digest: str, at: int) -> int:
    path = e.registry.root / "docker/registry/v2/blobs/sha256" / digest[7:9] / digest[7:] / "data"
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(1)[0]
        f.seek(at)
        f.write(bytes([old ^ 0x5A]))
    return old


def _bundle(e: Env, artifact: str) -> dict[str, object]:
    with RegistryClient(insecure_hosts=[e.registry.host]) as client:
        from coldstart.oci.manifest import OCI_MANIFEST
        from coldstart.oci.reference import Reference

        body, _, _ = client.get_manifest(Reference.parse(e.ref).with_digest(artifact),
                                         (OCI_MANIFEST,))
    layer: dict[str, object] = json.loads(body)["layers"][0]
    return layer


def _page_chunk(e: Env, layer: dict[str, object]) -> tuple[int, str]:
    """Where a chunk of a pages file starts in the bundle blob, and that chunk's digest."""
    from coldstart.format.layer import open_layer
    from coldstart.oci.reference import Reference
    from coldstart.remote.registry_blob import open_blob

    with RegistryClient(insecure_hosts=[e.registry.host]) as client:
        blob = open_blob(client, Reference.parse(e.ref), str(layer["digest"]),
                         int(str(layer["size"])))
        lay = open_layer(blob, annotations=layer["annotations"])  # type: ignore[arg-type]
        for name, entry in lay.toc.entries.items():
            if name.startswith("criu/pages-") and entry.chunks:
                c = entry.chunks[len(entry.chunks) // 2]
                return c.offset + (c.end_offset - c.offset) // 2, c.digest
    raise AssertionError("no pages chunk")


def test_a_flipped_byte_in_a_snapshot_chunk_is_never_restored(
        env: Env, snapshot_a: tuple[list[str], dict[str, object]]) -> None:
    before, created = snapshot_a
    layer = _bundle(env, str(created["digest"]))
    at, chunk = _page_chunk(env, layer)
    _flip(env, str(layer["digest"]), at)
    try:
        with node(env) as st:
            out = _start(st, env, "f1")
            assert out.returncode == 0, out.stderr
            ev = _last_event(env, "f1")
            assert ev["outcome"] == "fallback" and ev["kind"] == "integrity", ev
            _wait(env.io / "f1" / "ready")                  # a normal start, to READY
            assert _ask(env, "f1")[0] != before[0]
            assert not (env.io / "f1" / "leftover").exists()
            from coldstart.cache.chunks import ChunkCache

            cache = ChunkCache(env.chunks, max_bytes=1 << 30)
            try:
                assert not cache.contains(chunk)        # never cached either
            finally:
                cache.close()
            _remove(st, "f1")
            assert _leftovers(env) == []
    finally:
        _flip(env, str(layer["digest"]), at)        # the same flip again: the byte back


@pytest.mark.parametrize("case", ["no-snapshot", "other-command", "criu-missing", "deadline",
                                  "restore-fails"])
def test_each_fallback_starts_normally_and_leaves_nothing(
        env: Env, snapshot_a: tuple[list[str], dict[str, object]], case: str) -> None:
    before, created = snapshot_a
    name = f"fb-{case}"
    image, start_env, kind = env.ref, (), ""
    settings: dict[str, str | float] = {}
    try:
        if case == "no-snapshot":
            image, kind = env.other, "no-snapshot"
        elif case == "other-command":
            start_env, kind = ("MODE=other",), "no-snapshot"
        elif case == "criu-missing":
            settings = {"criu": "/nonexistent/criu"}
            kind = "criu"
        elif case == "deadline":
            settings = {"timeout": 0.001}
            kind = "timeout"
        else:
            # a snapshot of image a pushed, key and all, as image b's: its files differ in
            # size, CRIU refuses to restore, after its rootfs changes went in
            image, kind = env.other, "restore-failed"
            _push_as(env, created, env.other)
        with node(env, **settings) as st:
            out = _start(st, env, name, image=image, env=start_env)
            assert out.returncode == 0, out.stderr
            ev = _last_event(env, name)
            assert ev["outcome"] == "fallback" and ev["kind"] == kind, ev
            _wait(env.io / name / "ready")
            answer = _ask(env, name)
            assert answer[0] != before[0] and answer[0] == answer[1]
            # the rootfs changes that went in were taken back out before the normal start
            assert not (env.io / name / "leftover").exists()
            _remove(st, name)
            assert _leftovers(env) == []
            # counted where an operator looks: `coldstart snapshotter status`
            r = coldstart_cli("snapshotter", "status", "--config", str(env.config),
                              "--fuse-socket", st.fuse_socket, "-o", "json")
            assert r.returncode == 0, r.stderr
            (row,) = [x for x in json.loads(r.stdout) if x.get("state") == "snapshot-restores"]
            assert row["fallbacks"][kind] >= 1, row
    finally:
        _write_config(env)
    counters = json.loads((env.state / "counters.json").read_text())
    assert counters["fallbacks"][kind] >= 1


def _push_as(e: Env, created: dict[str, object], image: str) -> None:
    """Push snapshot ``created``'s bundle again as a snapshot of ``image`` with the key a
    container of ``image`` has (a snapshot whose key lies about its image)."""
    from coldstart.oci.manifest import OCI_MANIFEST, canonical_json, digest_of
    from coldstart.oci.reference import Reference
    from coldstart.oci.referrers import push_referrer
    from coldstart.snapshot.artifacts import A_CREATED, A_KEY, ARTIFACT_TYPE, KEY_MEDIA_TYPE
    from coldstart.snapshot.keys import SnapshotKey

    src, dst = Reference.parse(e.ref), Reference.parse(image)
    with RegistryClient(insecure_hosts=[e.registry.host]) as client:
        body, _, _ = client.get_manifest(src.with_digest(str(created["digest"])),
                                         (OCI_MANIFEST,))
        doc = json.loads(body)
        layer = doc["layers"][0]
        data = client.get_blob(src, layer["digest"], max_size=1 << 30)
        client.push_blob(dst, data, layer["digest"])
        target = client.resolve(dst)
        comps = dict(created["key"]["components"])  # type: ignore[index]
        comps["image"] = target.digest
        key = SnapshotKey(comps)
        config = key.canonical()
        client.push_blob(dst, config, digest_of(config))
        doc["config"] = {"mediaType": KEY_MEDIA_TYPE, "digest": digest_of(config),
                         "size": len(config)}
        doc["subject"] = {"mediaType": target.media_type, "digest": target.digest,
                          "size": len(target.manifest_bytes)}
        doc["annotations"][A_KEY] = key.digest
        doc["annotations"][A_CREATED] = "9999-01-01T00:00:00.000000Z"
        push_referrer(client, dst, canonical_json(doc), artifact_type=ARTIFACT_TYPE)


def _pager_event(e: Env, name: str, timeout: float = 60.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        evs = [ev for ev in _events(e) if ev.get("container") == name and
               str(ev.get("outcome", "")).startswith("pages-")]
        if evs:
            return evs[-1]
        assert time.monotonic() < deadline, _events(e)[-3:]
        time.sleep(0.1)


def test_a_lazy_restore_faults_its_pages_in_through_the_fuse_server(
        env: Env, snapshot_a: tuple[list[str], dict[str, object]]) -> None:
    before, _ = snapshot_a
    with node(env, pages="lazy") as st:
        out = _start(st, env, "l1")
        assert out.returncode == 0, out.stderr
        ev = _last_event(env, "l1")
        assert ev["outcome"] == "restored" and ev["pages"] == "lazy", ev
        assert _ask(env, "l1")[:2] == before[:2]
        # the pager brings every page in, then unmounts the bundle and cleans up
        assert _pager_event(env, "l1")["outcome"] == "pages-in"
        assert _ask(env, "l1")[0] == before[0]
        _remove(st, "l1")
        assert _leftovers(env) == []


def test_a_lazy_restore_never_runs_on_a_page_that_fails_its_digest(
        env: Env, snapshot_a: tuple[list[str], dict[str, object]]) -> None:
    """The bad chunk is found when a page of it is read: during the restore (the pages CRIU
    restores at once: the restore fails, and the container starts normally) or after it (a
    page faulted in: the pager kills the restored process rather than let it read zeros for
    its memory). Either way no answer ever comes from a process on the wrong memory."""
    before, created = snapshot_a
    layer = _bundle(env, str(created["digest"]))
    at, _ = _page_chunk(env, layer)
    _flip(env, str(layer["digest"]), at)
    try:
        with node(env, pages="lazy") as st:
            out = _start(st, env, "l2")
            ev = _last_event(env, "l2")
            if ev["outcome"] == "fallback":
                assert out.returncode == 0, out.stderr
                assert ev["kind"] == "restore-failed", ev
                _wait(env.io / "l2" / "ready")          # a normal start, to READY
                assert _ask(env, "l2")[0] != before[0]
            else:
                # restored, then the pager met the bad chunk and killed the process: before
                # ctr's start (which then fails: the container fails visibly) or after it
                pager = _pager_event(env, "l2")
                assert pager["outcome"] == "pages-failed" and pager["killed"], pager
                deadline = time.monotonic() + 30
                while "RUNNING" in st.ctr("task", "ls").stdout:
                    assert time.monotonic() < deadline, st.ctr("task", "ls").stdout
                    time.sleep(0.1)
                answer = env.io / "l2" / "a"
                assert not answer.exists() or answer.read_text().split()[0] == before[0]
            _remove(st, "l2")
            deadline = time.monotonic() + 30
            while _leftovers(env):      # a pager that was running cleans up as it ends
                assert time.monotonic() < deadline, _leftovers(env)
                time.sleep(0.1)
    finally:
        _flip(env, str(layer["digest"]), at)        # the same flip again: the byte back
