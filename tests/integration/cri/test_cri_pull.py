"""The kubelet path, for real: containerd 1.6 with its CRI plugin, configured by
``coldstart node install`` (coldstart as CRI's snapshotter, snapshot annotations on), a
password-protected docker-registry, the coldstart snapshotter and FUSE server, and
``coldstart cri-proxy`` in front of containerd. CRI ``PullImage`` calls go to the proxy, as
kubelet's ``--image-service-endpoint`` would send them.

Must show (issue 13): a ``PullImage`` with credentials pulls a converted image lazily (registry
bytes ≪ image size); after the registry's password changes, a ``PullImage`` with the new one
pulls a second image lazily, and the first image's lazily mounted layer keeps reading (a file
not read before is fetched, with the rotated credentials the proxy handed over); and a pod runs
as kubelet would run it: RunPodSandbox (host network, no CNI; the sandbox image a busybox one
from the same registry), CreateContainer and StartContainer on a lazily pulled image, exit code
0 and the file's content in the container's CRI log.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldstart._proto.cri.runtime.v1 import api_pb2 as cri
from coldstart.cri import ImageServiceClient, RuntimeServiceClient
from coldstart.lazyfs.client import FuseServerClient
from coldstart.oci.convert import convert_image
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack.mounts import unmount_under
from coldstart.stack.procs import free_port, stop_process, tcp_open, unix_open, wait_for
from coldstart.stack.registry import REGISTRY_BIN, AccessLog, registry_config, write_htpasswd
from coldstart.stack.snapshotter import SnapshotterDaemon
from tests.fixtures.containerd import CONTAINERD_BIN, start_snapshotter
from tests.integration.oci.oci_testimages import (
    BUSYBOX,
    TarBuilder,
    build_image,
    have_busybox,
    push_image,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

USER = "kubelet-pull"
FILES = 12                 # per image: files of FILE_SIZE random bytes
FILE_SIZE = 1 << 20


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="cs-cri-", dir="/tmp"))
    try:
        yield d
    finally:
        unmount_under(d, abort_fuse=True)
        shutil.rmtree(d, ignore_errors=True)


class AuthRegistry:
    """docker-registry with htpasswd auth on a fixed port, restartable on the same storage
    (docker-registry 2.8 re-reads a changed htpasswd file by itself; the test also restarts it,
    as a registry roll-out with new credentials would)."""

    def __init__(self, base: Path, password: str) -> None:
        self.base = base
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.htpasswd = base / "htpasswd"
        self.log = base / "registry.log"
        self.proc: subprocess.Popen[bytes] | None = None
        base.mkdir(parents=True, exist_ok=True)
        (base / "storage").mkdir(exist_ok=True)
        (base / "config.yml").write_text(registry_config(base / "storage", self.port,
                                                         htpasswd=self.htpasswd))
        self.set_password(password)

    def set_password(self, password: str) -> None:
        write_htpasswd(self.htpasswd, {USER: password})
        self.password = password

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(self.base / "config.yml")],
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_for(tcp_open(self.port), timeout=30, what="docker-registry", proc=self.proc,
                 log=self.log)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def client(self) -> RegistryClient:
        return RegistryClient(insecure_hosts=[self.host],
                              credentials={self.host: (USER, self.password)})


def containerd_config(base: Path, certs_d: Path, sandbox_image: str) -> str:
    """containerd 1.6 as a node has it, CRI on; ``node install`` adds coldstart to it.
    ``restrict_oom_score_adj``: this VM's root lacks CAP_SYS_RESOURCE, so runc cannot lower a
    sandbox's oom_score_adj to CRI's -998 ("can't get final child's PID from pipe: EOF");
    restricted, CRI keeps it at containerd's own."""
    return f"""\
version = 2
root = "{base / 'ctrd' / 'root'}"
state = "{base / 'ctrd' / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{base / 'c.sock'}"

[ttrpc]
  address = "{base / 'c.sock.ttrpc'}"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{sandbox_image}"
    restrict_oom_score_adj = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{base / 'cni-bin'}"
      conf_dir = "{base / 'cni-conf'}"
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "{certs_d}"
"""


def layer(seed: int, tag: str, files: int = FILES) -> bytes:
    rnd = random.Random(seed)
    t = TarBuilder().dir("data").file("data/tag.txt", tag.encode())
    for i in range(files):
        t.file(f"data/blob-{i:02d}.bin", rnd.randbytes(FILE_SIZE))
    return t.bytes()


def busybox_layer() -> bytes:
    return (TarBuilder().dir("bin").file("bin/busybox", Path(BUSYBOX).read_bytes(), mode=0o755)
            .symlink("bin/sh", "busybox").dir("etc").dir("tmp", mode=0o1777).bytes())


def make_image(reg: AuthRegistry, repo: str, tag: str, seed: int, *,
               busybox: bool = False, files: int = FILES) -> tuple[str, int]:
    """Push a gzip image (``busybox``: with a busybox layer under the data) and convert it to
    zstd:chunked as ``repo:tag-zc``; return the converted reference and the total size of its
    layers."""
    src = f"{reg.host}/{repo}:{tag}"
    dst = f"{reg.host}/{repo}:{tag}-zc"
    data = layer(seed, tag, files)
    layers = [busybox_layer(), data] if busybox else [data]
    with reg.client() as client:
        push_image(client, Reference.parse(src), build_image(layers))
        convert_image(src, dst, client=client, insecure_hosts=[reg.host])
        manifest = json.loads(client.get_manifest(Reference.parse(dst))[0])
    return dst, sum(int(la["size"]) for la in manifest["layers"])


def coldstart(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def layer_bytes_served(log: AccessLog, repo: str) -> int:
    """Bytes of blobs (layers, configs) the registry sent for ``repo`` since ``log`` began."""
    return sum(s.bytes for s in log.requests()
               if f"/v2/{repo}/blobs/" in s.path and s.status in (200, 206))


def need_tools() -> None:
    for tool in (CONTAINERD_BIN, REGISTRY_BIN):
        if not Path(tool).exists():
            pytest.fail(f"{tool} is not installed")


@dataclass
class Node:
    """The running stack: snapshotter, containerd (CRI on, coldstart as its snapshotter) and
    the CRI proxy in front of it."""

    sn: SnapshotterDaemon
    keychain: Path
    ctd_log: Path
    proxy_log: Path
    cri_sock: Path        # the proxy (kubelet's --image-service-endpoint)
    ctd_sock: Path        # containerd (kubelet's --container-runtime-endpoint)


@contextmanager
def node(base: Path, reg: AuthRegistry, *, sandbox_image: str = "registry.k8s.io/pause:3.9",
         install: Sequence[str] = (), config: str = "",
         env: Mapping[str, str] | None = None) -> Iterator[Node]:
    """The node; ``install``: more ``coldstart node install`` flags, ``config``: more of
    coldstart's config (TOML), ``env``: more of containerd's environment (its shims' and
    runc's)."""
    # containerd's own registry access (manifest, config) over plain HTTP
    certs_d = base / "certs.d"
    (certs_d / reg.host).mkdir(parents=True)
    (certs_d / reg.host / "hosts.toml").write_text(
        f'server = "http://{reg.host}"\n[host."http://{reg.host}"]\n'
        '  capabilities = ["pull", "resolve"]\n')
    keychain = base / "cri-creds"
    extra = ("[registry]\n"
             f'insecure_hosts = ["{reg.host}"]\n'
             f'cri_keychain = "{keychain}"\n' + config)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with start_snapshotter(base / "sn", spawn=True, metrics=False, extra=extra,
                               log_level="info") as sn:
            ctd_config = base / "containerd.toml"
            ctd_config.write_text(containerd_config(base, certs_d, sandbox_image))
            r = coldstart("node", "install", "--containerd-config", str(ctd_config),
                          "--config", str(sn.config), "--state-dir", str(base / "state"),
                          "--systemd-dir", str(base / "units"), *install)
            assert r.returncode == 0, r.stderr
            installed = ctd_config.read_text()
            assert 'snapshotter = "coldstart"' in installed, installed
            assert "disable_snapshot_annotations = false" in installed, installed
            ctd_log = base / "containerd.log"
            with open(ctd_log, "ab") as out:
                procs.append(subprocess.Popen([CONTAINERD_BIN, "--config", str(ctd_config)],
                                              stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True,
                                              # coldstart-runc (a --snapshot-restore
                                              # handler's runc) reads coldstart's config
                                              env={**os.environ,
                                                   "COLDSTART_CONFIG": str(sn.config),
                                                   **(env or {})}))
            wait_for(unix_open(base / "c.sock"), timeout=60, what="containerd", proc=procs[-1],
                     log=ctd_log)
            proxy_log = base / "cri-proxy.log"
            with open(proxy_log, "ab") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "coldstart.cli", "cri-proxy", "--listen",
                     str(base / "cri.sock"), "--upstream", str(base / "c.sock"),
                     "--keychain", str(keychain)],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            wait_for(unix_open(base / "cri.sock"), timeout=30, what="cri-proxy",
                     proc=procs[-1], log=proxy_log)
            yield Node(sn, keychain, ctd_log, proxy_log, base / "cri.sock", base / "c.sock")
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def test_cri_pull_with_credentials_is_lazy_and_survives_a_password_change(base: Path) -> None:
    need_tools()
    reg = AuthRegistry(base / "reg", "first-pw-1")
    reg.start()
    try:
        ref1, size1 = make_image(reg, "team/app", "v1", seed=1)
        ref2, size2 = make_image(reg, "team/app", "v2", seed=2)
        with node(base, reg) as n:
            sn, keychain, ctd_log, proxy_log = n.sn, n.keychain, n.ctd_log, n.proxy_log
            kubelet = ImageServiceClient(n.cri_sock, timeout=180)
            assert kubelet.version().runtime_name == "containerd"

            # 1. PullImage with credentials, through the proxy: lazy
            served0 = AccessLog(reg.log)
            image_ref1 = kubelet.pull_image(ref1, username=USER, password=reg.password)
            assert image_ref1.startswith("sha256:")
            lazy1 = layer_bytes_served(served0, "team/app")
            assert lazy1 < size1 / 4, (lazy1, size1, ctd_log.read_text()[-3000:])
            status = kubelet.image_status(ref1)
            assert status is not None and status.id == image_ref1
            rows = FuseServerClient(sn.fuse_socket, timeout=10).status()
            assert rows, "no lazily mounted layer"
            first = rows[0]
            r = coldstart("snapshotter", "status", "--config", str(sn.config), "-o", "json")
            assert r.returncode == 0, r.stderr
            assert not [row for row in json.loads(r.stdout) if row.get("state") == "not-lazy"]
            assert (keychain.stat().st_mode & 0o777) == 0o700
            (kept,) = keychain.glob("*.json")     # one repository: team/app
            assert (kept.stat().st_mode & 0o777) == 0o600
            mount1 = Path(first["mountpoint"])
            assert (mount1 / "data" / "tag.txt").read_text() == "v1"

            # 2. the password changes on the registry (kubelet gets the new secret)
            reg.stop()
            reg.set_password("second-pw-2")
            reg.start()
            served1 = AccessLog(reg.log)
            image_ref2 = kubelet.pull_image(ref2, username=USER, password=reg.password)
            assert image_ref2.startswith("sha256:") and image_ref2 != image_ref1
            lazy2 = layer_bytes_served(served1, "team/app")
            print(f"lazy pulls: {lazy1} of {size1} and {lazy2} of {size2} layer bytes served")
            assert lazy2 < size2 / 4, (lazy2, size2)
            rows = FuseServerClient(sn.fuse_socket, timeout=10).status()
            mounts = {row["mountpoint"] for row in rows}
            assert len(mounts) >= 2, rows
            mount2 = next(Path(m) for m in mounts if Path(m) != mount1)
            assert (mount2 / "data" / "tag.txt").read_text() == "v2"

            # 3. the first image keeps reading: a file never read before, fetched now
            before = AccessLog(reg.log)
            data = (mount1 / "data" / "blob-07.bin").read_bytes()
            assert data == random.Random(1).randbytes(FILE_SIZE * 8)[FILE_SIZE * 7:]
            fetched = layer_bytes_served(before, "team/app")
            print(f"reading an unread file of the first image fetched {fetched} bytes")
            assert fetched >= FILE_SIZE / 2
            proxy_text = proxy_log.read_text()
            assert proxy_text.count("PullImage") >= 2 and "credentials kept" in proxy_text
            assert "first-pw-1" not in proxy_text and "second-pw-2" not in proxy_text
    finally:
        reg.stop()


def test_cri_runs_a_lazily_pulled_image_in_a_host_network_pod(base: Path) -> None:
    """As kubelet runs a pod: ``PullImage`` (with credentials, through the proxy), then
    ``RunPodSandbox`` (host network: no CNI), ``CreateContainer`` and ``StartContainer`` on
    containerd. The sandbox image is a busybox one from the same password-protected registry
    (registry.k8s.io is out of reach), pulled first through the proxy as kubelet's image
    manager would have it present. The container reads a file of the lazily pulled image; its
    exit code and CRI log show it ran, and the registry served a fraction of the layers."""
    need_tools()
    assert have_busybox(), "busybox-static is not installed (scripts/install.sh installs it)"
    reg = AuthRegistry(base / "reg", "pod-pw-1")
    reg.start()
    pause = f"{reg.host}/k8s/pause:3.9"
    try:
        with reg.client() as client:
            push_image(client, Reference.parse(pause), build_image(
                [busybox_layer()], cmd=("/bin/busybox", "sleep", "2147483647")))
        app, size = make_image(reg, "team/app", "v3", seed=3, busybox=True, files=2 * FILES)
        with reg.client() as client:
            manifest = json.loads(client.get_manifest(Reference.parse(app))[0])
        data_layer = manifest["layers"][-1]       # data/: tag.txt and the 1 MiB blobs
        with node(base, reg, sandbox_image=pause) as n, \
                RuntimeServiceClient(n.cri_sock, timeout=180) as kubelet:
            assert kubelet.pull_image(pause, username=USER, password=reg.password)
            served = AccessLog(reg.log)
            image_id = kubelet.pull_image(app, username=USER, password=reg.password)
            assert image_id.startswith("sha256:")

            logs = base / "pods" / "default_lazy-pod_0"
            pod = kubelet.pod_config("lazy-pod", uid="0", log_directory=str(logs),
                                     host_network=True)
            sandbox = ""
            try:
                try:
                    sandbox = kubelet.run_pod_sandbox(pod)
                except Exception as exc:
                    raise AssertionError(f"RunPodSandbox: {exc}\n--- containerd log:\n"
                                         f"{n.ctd_log.read_text()[-4000:]}") from exc
                cid = kubelet.create_container(
                    sandbox, pod, "app", app, log_path="app/0.log",
                    command=["/bin/busybox", "sh", "-c", "cat /data/tag.txt; echo; echo done"])
                kubelet.start_container(cid)
                status = kubelet.wait_exited(cid, timeout=60)
                log = (logs / "app" / "0.log").read_text()
                assert status.exit_code == 0, (status, log, n.ctd_log.read_text()[-3000:])
                assert status.image_ref.startswith(f"{reg.host}/team/app@sha256:"), status
                assert status.log_path == str(logs / "app" / "0.log")
                # CRI log lines: TIMESTAMP STREAM TAG CONTENT
                lines = [line.split(" ", 3) for line in log.splitlines()]
                assert [(s, t, c) for _, s, t, c in lines] == [
                    ("stdout", "F", "v3"), ("stdout", "F", "done")], log
            finally:
                if sandbox:
                    kubelet.stop_pod_sandbox(sandbox)
                    kubelet.remove_pod_sandbox(sandbox)
            lazy = layer_bytes_served(served, "team/app")
            data_served = served.blob_bytes(data_layer["digest"])
            print(f"pod run: {lazy} of {size} layer bytes served, {data_served} of "
                  f"{data_layer['size']} from the data layer")
            assert lazy < size / 4, (lazy, size)
            assert data_served < data_layer["size"] / 8, (data_served, data_layer)
            assert status.state == cri.CONTAINER_EXITED
    finally:
        reg.stop()
