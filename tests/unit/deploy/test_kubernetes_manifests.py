"""deploy/kubernetes: every manifest validates offline against Kubernetes' own schemas (the newest
version kubernetes-validate bundles, and 1.30), each kustomization lists every file beside it, the
facts that keep nodes and running pods safe hold, and the shell scripts embedded in the
DaemonSets do what their comments say (run with /bin/sh in a scratch "host")."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate (the test extra) is not installed: the schemas cannot be checked")

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy" / "kubernetes"
UNINSTALL = DEPLOY / "uninstall"
IMAGE = "ghcr.io/coldstart/coldstart"
NSENTER = "nsenter -t 1 -m -u -i -n -p --"

Doc = dict[str, Any]


def _docs(path: Path) -> list[Doc]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def _kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


def _one(path: Path, kind: str) -> Doc:
    found = [d for d in _docs(path) if d["kind"] == kind]
    assert len(found) == 1, f"{path}: expected one {kind}, found {len(found)}"
    return found[0]


def _daemonset() -> Doc:
    return _one(DEPLOY / "daemonset.yaml", "DaemonSet")


def _uninstall() -> Doc:
    return _one(UNINSTALL / "daemonset-uninstall.yaml", "DaemonSet")


def _script(container: Doc) -> str:
    command = container["command"]
    assert command[:2] == ["/bin/sh", "-c"], command
    return str(command[2])


def _env(container: Doc) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _versions() -> list[str]:
    latest = kubernetes_validate.latest_version()
    return sorted({latest, "1.30"})


# --- schemas -------------------------------------------------------------------------------------


def test_the_newest_bundled_kubernetes_is_current() -> None:
    major, minor = (int(x) for x in kubernetes_validate.latest_version().split(".")[:2])
    assert (major, minor) >= (1, 30)


@pytest.mark.parametrize("version", _versions())
@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_validates_strictly(path: Path, version: str) -> None:
    docs = _docs(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        # raises ValidationError (an unknown or misspelt field, strict) or SchemaNotFoundError
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The control: a typo that Kubernetes would silently drop is an error here."""
    ds = _daemonset()
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, kubernetes_validate.latest_version(), strict=True)


def test_every_manifest_has_the_basic_fields() -> None:
    for path in _manifest_files():
        for doc in _docs(path):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            if doc["kind"] not in ("Namespace", "ClusterRole", "RuntimeClass"):
                assert doc["metadata"]["namespace"] == "coldstart-system", path


# --- kustomizations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kustomization", _kustomizations(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomization_lists_every_file_beside_it(kustomization: Path) -> None:
    k = yaml.safe_load(kustomization.read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert k["kind"] == "Kustomization"
    resources = k["resources"]
    assert len(resources) == len(set(resources)), "a resource listed twice"
    beside = {p.name for p in kustomization.parent.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(resources) == beside
    # the images entry names the image every container uses
    images = {i["name"]: i for i in k["images"]}
    assert set(images) == {IMAGE}
    assert images[IMAGE]["newTag"]
    for name in resources:
        for doc in _docs(kustomization.parent / name):
            if doc["kind"] != "DaemonSet":
                continue
            pod = doc["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                repo, _, tag = c["image"].rpartition(":")
                assert repo == IMAGE, c["image"]
                assert tag == images[IMAGE]["newTag"], c["image"]


def test_the_uninstall_is_not_part_of_the_install() -> None:
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert not any("uninstall" in r for r in k["resources"])


# --- the facts that matter -----------------------------------------------------------------------


def test_daemonset_pod_is_privileged_with_host_pid_and_no_host_network() -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork", False)
    for c in pod["initContainers"] + pod["containers"]:
        assert c["securityContext"]["privileged"] is True, c["name"]


def test_daemonset_mounts_fuse_and_the_host_paths() -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    by_path = {v["hostPath"]["path"]: v for v in volumes.values()}
    assert by_path["/dev/fuse"]["hostPath"]["type"] == "CharDevice"
    for path in ("/run/coldstart", "/var/lib/coldstart", "/etc/containerd", "/run/containerd",
                 "/etc/systemd/system", "/opt"):
        assert path in by_path, path
    used = set()
    for c in pod["initContainers"] + pod["containers"]:
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, m
            used.add(m["name"])
            if m.get("mountPropagation") == "Bidirectional":
                pytest.fail(f"{c['name']}: nothing in the pod mounts for the host")
    assert used == set(volumes), "a volume no container mounts (its hostPath type is not checked)"
    install = pod["initContainers"][0]
    mounted = {m["mountPath"]: m["name"] for m in install["volumeMounts"]}
    assert volumes[mounted["/dev/fuse"]]["hostPath"]["path"] == "/dev/fuse"


def test_daemonset_init_runs_node_install_in_the_hosts_namespaces() -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["install"]
    script = _script(pod["initContainers"][0])
    assert NSENTER in script
    assert 'node install --restart-containerd ${COLDSTART_INSTALL_ARGS:-}' in script
    # the main container only reports; nothing in the pod uninstalls (no preStop anywhere)
    for c in pod["initContainers"] + pod["containers"]:
        assert "lifecycle" not in c, c["name"]
        assert "uninstall" not in _script(c), c["name"]
    status = pod["containers"][0]
    assert "node status -o json" in _script(status)
    assert status["readinessProbe"]["exec"]["command"] == ["test", "-e", "/tmp/ready"]


def test_daemonset_runs_on_gpu_nodes() -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        pod["tolerations"])


def test_daemonset_updates_one_node_at_a_time_and_never_two_pods_on_a_node() -> None:
    spec = _daemonset()["spec"]
    assert spec["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    assert spec["minReadySeconds"] >= 10


def test_node_agent_has_no_api_access() -> None:
    sa = _one(DEPLOY / "serviceaccount.yaml", "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    pod = _daemonset()["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False
    for path in _manifest_files():
        for doc in _docs(path):
            assert doc["kind"] not in ("RoleBinding", "ClusterRoleBinding"), path


def test_probe_role_grants_only_the_pod_condition_patch() -> None:
    role = _one(DEPLOY / "probe-rbac.yaml", "ClusterRole")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}]
    from coldstart.probe.sinks import KubernetesSink

    sink = KubernetesSink("ns", "pod", api="http://127.0.0.1:1")
    assert sink.url.endswith("/namespaces/ns/pods/pod/status")


def test_runtime_class_matches_the_install_and_its_nodes() -> None:
    rc = _one(DEPLOY / "runtimeclass.yaml", "RuntimeClass")
    pod = _daemonset()["spec"]["template"]["spec"]
    args = shlex.split(_env(pod["initContainers"][0])["COLDSTART_INSTALL_ARGS"])
    # the default makes coldstart CRI's default snapshotter: a runtime's snapshotter applies to
    # pulls only from containerd 1.7 on and with a pod annotation (or a kubelet gate), so the
    # runtime-handler mode is the operator's choice, with this class ready for it
    assert "--runtime-handler" not in args
    assert rc["handler"] == rc["metadata"]["name"] == "coldstart"
    for key, value in rc["scheduling"]["nodeSelector"].items():
        assert pod["nodeSelector"][key] == value


def test_uninstall_runs_on_the_same_nodes_and_only_uninstalls() -> None:
    pod = _uninstall()["spec"]["template"]["spec"]
    install = _daemonset()["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == install["nodeSelector"]
    assert pod["tolerations"] == install["tolerations"]
    assert pod["hostPID"] is True
    script = _script(pod["initContainers"][0])
    assert NSENTER in script
    assert "node uninstall --restart-containerd" in script
    assert "node install" not in script


# --- the embedded scripts ------------------------------------------------------------------------


def _all_scripts() -> list[tuple[str, str]]:
    out = []
    for name, ds in (("install", _daemonset()), ("uninstall", _uninstall())):
        pod = ds["spec"]["template"]["spec"]
        for c in pod["initContainers"] + pod["containers"]:
            out.append((f"{name}/{c['name']}", _script(c)))
    return out


@pytest.mark.parametrize(("name", "script"), _all_scripts(), ids=[n for n, _ in _all_scripts()])
def test_embedded_scripts_parse_with_posix_sh(name: str, script: str) -> None:
    subprocess.run(["/bin/sh", "-n", "-c", script], check=True)


class Host:
    """A scratch node: SRC is the image's /opt/coldstart, OPT the host's /opt (seen at the same
    path from "container" and "host"), and a fake coldstart that logs its arguments."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp.resolve()
        self.src = self.tmp / "image" / "opt" / "coldstart"
        self.opt = self.tmp / "host" / "opt"
        self.calls = self.tmp / "calls.log"
        self.opt.mkdir(parents=True)
        self.image(version="1")

    def image(self, version: str) -> None:
        shutil.rmtree(self.src, ignore_errors=True)
        (self.src / "bin").mkdir(parents=True)
        fake = self.src / "bin" / "coldstart"
        fake.write_text(f'#!/bin/sh\necho "v{version} $*" >> "{self.calls}"\n'
                        'exit "${FAKE_RC:-0}"\n')
        fake.chmod(0o755)
        (self.src / "lib").mkdir()
        (self.src / "lib" / "python").symlink_to("python3.11")
        shutil.copy2(shutil.which("sleep") or "/bin/sleep", self.src / "bin" / "sleep")

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "COLDSTART_SRC": str(self.src), "COLDSTART_HOST_OPT": str(self.opt),
                "COLDSTART_HOST_PATH": str(self.opt), "COLDSTART_NSENTER": "env", **extra}

    def run(self, script: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["/bin/sh", "-c", script], env=self.env(**extra),
                              capture_output=True, text=True, timeout=60)

    def releases(self) -> set[str]:
        return {p.name for p in (self.opt / "coldstart-releases").iterdir()}

    def current(self) -> str:
        link = self.opt / "coldstart"
        assert link.is_symlink()
        return os.readlink(link)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


@pytest.fixture
def install_script() -> str:
    return _script(_daemonset()["spec"]["template"]["spec"]["initContainers"][0])


def test_install_copies_a_release_links_it_and_runs_node_install(
        host: Host, install_script: str) -> None:
    r = host.run(install_script, COLDSTART_INSTALL_ARGS="--runtime-handler coldstart")
    assert r.returncode == 0, r.stderr
    (release,) = host.releases()
    assert host.current() == f"coldstart-releases/{release}"
    assert (host.opt / "coldstart" / "bin" / "coldstart").read_text() == (
        host.src / "bin" / "coldstart").read_text()
    assert os.readlink(host.opt / "coldstart" / "lib" / "python") == "python3.11"
    assert (host.opt / "coldstart" / ".complete").exists()
    assert host.calls.read_text() == (
        "v1 node install --restart-containerd --runtime-handler coldstart\n")

    # a restarted pod with the same image copies nothing and installs again (idempotent)
    r = host.run(install_script, COLDSTART_INSTALL_ARGS="")
    assert r.returncode == 0, r.stderr
    assert "copying" not in r.stderr
    assert host.releases() == {release}
    assert host.calls.read_text().splitlines()[-1] == "v1 node install --restart-containerd"


def test_install_of_a_new_image_keeps_releases_in_use_and_removes_the_rest(
        host: Host, install_script: str) -> None:
    assert host.run(install_script).returncode == 0
    (v1,) = host.releases()
    # a process (the FUSE server, say) still runs from release 1
    user = subprocess.Popen([str(host.opt / "coldstart" / "bin" / "sleep"), "60"])
    try:
        host.image(version="2")
        r = host.run(install_script)
        assert r.returncode == 0, r.stderr
        v2 = host.current().rpartition("/")[2]
        assert v2 != v1
        assert host.releases() == {v1, v2}
        assert f"keeping {host.opt}/coldstart-releases/{v1}: still in use" in r.stderr
        assert host.calls.read_text().splitlines()[-1] == "v2 node install --restart-containerd"
    finally:
        user.terminate()
        user.wait()
    host.image(version="3")
    r = host.run(install_script)
    assert r.returncode == 0, r.stderr
    v3 = host.current().rpartition("/")[2]
    assert host.releases() == {v3}


def test_install_failure_fails_the_init_container(host: Host, install_script: str) -> None:
    r = host.run(install_script, FAKE_RC="3")
    assert r.returncode == 3
    assert "installed release" not in r.stderr


def test_install_refuses_a_hand_made_opt_coldstart(host: Host, install_script: str) -> None:
    (host.opt / "coldstart").mkdir()
    r = host.run(install_script)
    assert r.returncode == 1
    assert "did not install" in r.stderr
    assert not host.calls.exists()


def test_uninstall_runs_node_uninstall_and_removes_unused_releases(
        host: Host, install_script: str) -> None:
    assert host.run(install_script).returncode == 0
    uninstall = _script(_uninstall()["spec"]["template"]["spec"]["initContainers"][0])
    r = host.run(uninstall)
    assert r.returncode == 0, r.stderr
    assert host.calls.read_text().splitlines()[-1] == "v1 node uninstall --restart-containerd"
    assert not (host.opt / "coldstart").exists()
    assert not (host.opt / "coldstart-releases").exists()
    # a node where nothing is installed is fine
    r = host.run(uninstall)
    assert r.returncode == 0, r.stderr
    assert "nothing to uninstall" in r.stderr


@pytest.fixture
def status_loop(host: Host, install_script: str) -> Iterator[tuple[Host, Path]]:
    assert host.run(install_script).returncode == 0
    state = host.tmp / "state"
    state.mkdir()
    yield host, state


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.05)


def test_status_loop_is_ready_only_while_node_status_succeeds_and_stops_on_sigterm(
        status_loop: tuple[Host, Path]) -> None:
    host, state = status_loop
    script = _script(_daemonset()["spec"]["template"]["spec"]["containers"][0])
    flag = host.tmp / "rc"
    flag.write_text("0")
    # the fake coldstart's exit status comes from a file, so the test can flip it
    fake = host.opt / "coldstart" / "bin" / "coldstart"
    fake.write_text(f'#!/bin/sh\necho "{{\\"args\\": \\"$*\\"}}"\nexit "$(cat {flag})"\n')
    proc = subprocess.Popen(
        ["/bin/sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=host.env(COLDSTART_STATE_DIR=str(state), COLDSTART_STATUS_INTERVAL="0.1"))
    try:
        _wait_for(lambda: (state / "ready").exists())
        flag.write_text("1")
        _wait_for(lambda: not (state / "ready").exists())
        flag.write_text("0")
        _wait_for(lambda: (state / "ready").exists())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert '{"args": "node status -o json"}' in out
    # logged when it changes only: the same document is not printed every period
    assert out.count("node status") < 5
    assert "coldstart node status failed" in err
