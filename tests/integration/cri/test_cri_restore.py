"""Snapshot restore on the kubelet path: containerd 1.6 with its CRI plugin, configured by
``coldstart node install --runtime-handler restore --snapshot-restore`` (that handler's runc is
coldstart-runc, the pod annotation ``dev.coldstart.snapshot`` reaches its containers), a
password-protected registry whose credentials only kubelet's ``PullImage`` brings (the CRI
proxy keeps them; the wrapper reads them as the FUSE server does), CRIU 4.2.

A pod of that handler, annotated ``dev.coldstart.snapshot=auto`` (the CRI's image name), runs
an app that draws a random number and prints it every 50 ms; there is no snapshot yet, so it
starts normally. It is checkpointed (``coldstart snapshot create`` on containerd's k8s.io
namespace) and pushed. A second pod, as kubelet makes it (RunPodSandbox, CreateContainer,
StartContainer), is restored: its CRI log goes on with the first pod's number, its pause
container is never restored, and ``coldstart snapshot status`` counts the restore.
"""

from __future__ import annotations

import base64
import json
import random
import time
from pathlib import Path

import pytest

from coldstart.cri import RuntimeServiceClient
from coldstart.oci.reference import Reference
from coldstart.snapshot.criu import find_criu
from tests.integration.cri.test_cri_pull import (
    USER,
    AuthRegistry,
    base,  # noqa: F401  (the fixture)
    busybox_layer,
    coldstart,
    need_tools,
    node,
)
from tests.integration.oci.oci_testimages import TarBuilder, build_image, have_busybox, push_image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

APP = ("x=$(/bin/busybox head -c 4096 /dev/urandom | /bin/busybox sha256sum | "
       "/bin/busybox head -c 16); trap 'echo hook $x' USR2; "
       "while true; do echo tick $x; /bin/busybox sleep 0.05; done")


def _ticks(log: Path) -> list[str]:
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [ln.split(" ", 3)[3] for ln in lines if len(ln.split(" ", 3)) == 4]


def _wait_for(log: Path, pred: object, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        got = _ticks(log)
        if callable(pred) and pred(got):
            return got
        assert time.monotonic() < deadline, got[-5:]
        time.sleep(0.05)


def test_a_pod_is_restored_from_its_images_snapshot_through_the_cri(base: Path) -> None:  # noqa: F811
    need_tools()
    assert have_busybox(), "busybox-static is not installed (scripts/install.sh installs it)"
    criu = find_criu(check=True)
    assert criu.usable, f"CRIU cannot restore here: {criu.problems} (scripts/install.sh)"
    reg = AuthRegistry(base / "reg", "restore-pw-1")
    reg.start()
    pause = f"{reg.host}/k8s/pause:3.9"
    app = f"{reg.host}/team/app:v1"
    state = base / "snap-state"
    try:
        with reg.client() as client:
            push_image(client, Reference.parse(pause), build_image(
                [busybox_layer()], cmd=("/bin/busybox", "sleep", "2147483647")))
            data = TarBuilder().dir("data").file("data/x", random.randbytes(1000)).bytes()
            push_image(client, Reference.parse(app), build_image([busybox_layer(), data]))
        extra = (f'[snapshot]\nstate_dir = "{state}"\nchunk_dir = "{base / "snap-chunks"}"\n'
                 f'work_dir = "{base / "snap-work"}"\nsignal = "SIGUSR2"\n')
        with node(base, reg, sandbox_image=pause, config=extra,
                  install=("--runtime-handler", "restore", "--snapshot-restore")) as n, \
                RuntimeServiceClient(n.cri_sock, timeout=180) as kubelet:
            installed = (base / "containerd.toml").read_text()
            assert "coldstart-runc" in installed and "dev.coldstart.snapshot" in installed
            # the wrapper's config is coldstart's own: containerd's environment names it
            conf = n.sn.config
            try:
                assert kubelet.pull_image(pause, username=USER, password=reg.password)
            except Exception as exc:
                raise AssertionError(f"PullImage: {exc}\n--- containerd log:\n"
                                     f"{n.ctd_log.read_text()[-3000:]}\n--- config:\n"
                                     f"{installed[-1500:]}") from exc
            assert kubelet.pull_image(app, username=USER, password=reg.password)

            def run_pod(name: str) -> tuple[str, str, Path]:
                logs = base / "pods" / name
                pod = kubelet.pod_config(name, uid=name, log_directory=str(logs),
                                         host_network=True,
                                         annotations={"dev.coldstart.snapshot": "auto"})
                sandbox = kubelet.run_pod_sandbox(pod, runtime_handler="restore")
                cid = kubelet.create_container(sandbox, pod, "app", app, log_path="app/0.log",
                                               command=["/bin/busybox", "sh", "-c", APP])
                kubelet.start_container(cid)
                return sandbox, cid, logs / "app" / "0.log"

            sb1, c1, log1 = run_pod("first")
            first = _wait_for(log1, lambda t: len(t) >= 3)
            x = first[0].split()[1]
            assert all(t == f"tick {x}" for t in first)
            auth = base / "auth.json"
            token = base64.b64encode(f"{USER}:{reg.password}".encode()).decode()
            auth.write_text(json.dumps({"auths": {reg.host: {"auth": token}}}))
            out = coldstart("snapshot", "create", c1, "--address", str(n.ctd_sock),
                            "--namespace", "k8s.io", "--image", app, "--push", "--config",
                            str(conf), "--authfile", str(auth), "-o", "json", timeout=300)
            assert out.returncode == 0, out.stderr
            kubelet.stop_pod_sandbox(sb1)
            kubelet.remove_pod_sandbox(sb1)

            sb2, c2, log2 = run_pod("second")
            try:
                got = _wait_for(log2, lambda t: len(t) >= 5)
                # the first pod's number: its memory, not a new start
                assert f"hook {x}" in got, (got[:5], n.ctd_log.read_text()[-3000:])
                assert all(t in (f"tick {x}", f"hook {x}") for t in got), got[:8]
                events = [json.loads(ln) for ln in
                          (state / "events.jsonl").read_text().splitlines()]
                mine = [e for e in events if e["container"] == c2]
                assert [e["outcome"] for e in mine] == ["restored"], mine
                # the sandboxes (pause containers) were never tried
                assert {e["container"] for e in events} <= {c1, c2}
                status = coldstart("snapshot", "status", "--config", str(conf), "-o", "json")
                assert json.loads(status.stdout)["counters"]["restored"] == 1
            finally:
                kubelet.stop_pod_sandbox(sb2)
                kubelet.remove_pod_sandbox(sb2)
    finally:
        reg.stop()
