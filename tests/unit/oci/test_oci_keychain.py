"""The CRI keychain (credentials kubelet passes in PullImage, kept for the FUSE server) and
RegistryClient's choice of credentials: keychain first, then the docker config."""

from __future__ import annotations

import base64
import json
import os
import stat
import time
from pathlib import Path

import pytest

from coldstart.config import Config, RegistryConfig
from coldstart.errors import FailedPrecondition
from coldstart.oci.credentials import Credentials
from coldstart.oci.hosts import Endpoint
from coldstart.oci.keychain import Keychain
from coldstart.oci.registry import RegistryClient


def test_put_get_by_repository(tmp_path: Path) -> None:
    kc = Keychain(tmp_path / "kc")
    assert kc.get("reg.example", "app") is None          # no directory yet
    kc.put("reg.example/app:v1", Credentials("ci", "pw-app"))
    kc.put("reg.example:5000/team/db@sha256:" + "a" * 64, Credentials("db", "pw-db"))
    assert kc.get("reg.example", "app") == Credentials("ci", "pw-app")
    assert kc.get("reg.example:5000", "team/db") == Credentials("db", "pw-db")
    assert kc.get("other.example", "app") is None
    # Docker Hub: "docker.io" in references, "registry-1.docker.io" on the wire
    kc.put("nginx:1.27", Credentials("hub", "pw-hub"))
    assert kc.get("registry-1.docker.io", "library/nginx") == Credentials("hub", "pw-hub")
    assert kc.get("docker.io", "library/nginx") == Credentials("hub", "pw-hub")
    assert "pw-app" not in repr(kc.get("reg.example", "app"))


def test_newest_entry_of_the_host_when_the_repository_has_none(tmp_path: Path) -> None:
    kc = Keychain(tmp_path)
    kc.put("reg.example/a:v1", Credentials("a", "1"))
    time.sleep(0.01)
    kc.put("reg.example/b:v1", Credentials("b", "2"))
    kc.put("elsewhere.example/c:v1", Credentials("c", "3"))
    assert kc.get("reg.example", "unknown") == Credentials("b", "2")
    assert kc.get("reg.example") == Credentials("b", "2")
    assert kc.get("reg.example", "a") == Credentials("a", "1")   # its own entry wins
    assert kc.get("nothing.example", "a") is None


def test_candidates_in_the_order_to_try(tmp_path: Path) -> None:
    kc = Keychain(tmp_path)
    kc.put("reg.example/a:v1", Credentials("ci", "old"))
    time.sleep(0.01)
    kc.put("reg.example/b:v1", Credentials("ci", "new"))
    time.sleep(0.01)
    kc.put("reg.example/c:v1", Credentials("ci", "new"))      # the same pair: listed once
    kc.put("elsewhere.example/a:v1", Credentials("x", "y"))
    assert kc.candidates("reg.example", "a") == [Credentials("ci", "old"),
                                                 Credentials("ci", "new")]
    assert kc.candidates("reg.example", "zzz") == [Credentials("ci", "new"),
                                                   Credentials("ci", "old")]
    assert kc.candidates("nothing.example", "a") == []
    assert Keychain(tmp_path / "absent").candidates("reg.example", "a") == []


def test_root_only_modes(tmp_path: Path) -> None:
    d = tmp_path / "kc"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    kc = Keychain(d)
    kc.put("reg.example/app:v1", Credentials("ci", "pw"))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700        # tightened, not trusted as found
    files = list(d.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temporary file left behind
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600


def test_corrupt_or_foreign_files_are_ignored(tmp_path: Path) -> None:
    kc = Keychain(tmp_path)
    kc.put("reg.example/good:v1", Credentials("good", "pw"))
    host = kc._host_prefix("reg.example")      # named as the host's own files are
    (tmp_path / f"{host}-000000000000000000000000.json").write_text("{not json")
    (tmp_path / f"{host}-111111111111111111111111.json").write_text(json.dumps(["a list"]))
    (tmp_path / f"{host}-222222222222222222222222.json").write_text(json.dumps(
        {"host": "reg.example", "username": "x"}))                       # no secret
    (tmp_path / f"{host}-333333333333333333333333.json").write_text(json.dumps(
        {"host": "reg.example", "username": "x", "secret": "y", "updated": "soon"}))
    (tmp_path / f"{host}-444444444444444444444444.json").mkdir()                   # unreadable
    assert kc.get("reg.example", "other") == Credentials("good", "pw")
    # the repository's own file corrupt: as if absent (and no other valid one for the host)
    mine = kc._file("reg.example", "good")
    mine.write_text('{"host": "reg.exa')
    assert kc.get("reg.example", "good") is None


def test_rotation_replaces_and_is_seen_by_a_second_reader(tmp_path: Path) -> None:
    writer, reader = Keychain(tmp_path), Keychain(tmp_path)   # CRI proxy, FUSE server
    writer.put("reg.example/app:v1", Credentials("ci", "old"))
    assert reader.get("reg.example", "app") == Credentials("ci", "old")
    writer.put("reg.example/app:v2", Credentials("ci", "new"))   # another tag, same repo
    assert reader.get("reg.example", "app") == Credentials("ci", "new")
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_unwritable_directory_is_a_failed_precondition(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(FailedPrecondition, match="cannot keep registry credentials"):
        Keychain(blocker / "kc").put("reg.example/app:v1", Credentials("a", "b"))


def _docker_config(path: Path, host: str, user: str, pw: str) -> Path:
    path.write_text(json.dumps({"auths": {host: {
        "auth": base64.b64encode(f"{user}:{pw}".encode()).decode()}}}))
    return path


def test_client_prefers_the_keychain_and_reads_it_every_time(tmp_path: Path) -> None:
    host = "reg.example:5000"
    kc = Keychain(tmp_path / "kc")
    config = _docker_config(tmp_path / "config.json", host, "docker", "pw-docker")
    with RegistryClient(docker_config=config, keychain=kc) as client:
        ep = Endpoint(base=f"https://{host}/v2")
        scope = "repository:team/app:pull"
        assert client._auth.credentials(ep, scope) == Credentials("docker", "pw-docker")
        kc.put(f"{host}/team/app:v1", Credentials("kubelet", "pw1"))
        assert client._auth.credentials(ep, scope) == Credentials("kubelet", "pw1")
        kc.put(f"{host}/team/app:v1", Credentials("kubelet", "pw2"))   # rotated
        assert client._auth.credentials(ep, scope) == Credentials("kubelet", "pw2")
        # a push-and-mount scope names the target repository first
        kc.put(f"{host}/team/other:v1", Credentials("other", "pw3"))
        assert client._auth.credentials(
            ep, "repository:team/app:pull,push repository:team/other:pull") == \
            Credentials("kubelet", "pw2")
        # Basic auth's header is built per request from that lookup
        client._auth._schemes[host] = ("basic", {})
        header = client._auth.header(ep, scope)
        assert header == "Basic " + base64.b64encode(b"kubelet:pw2").decode()


def test_client_mirror_endpoint_order(tmp_path: Path) -> None:
    kc = Keychain(tmp_path / "kc")
    kc.put("upstream.example/app:v1", Credentials("kubelet", "pw-up"))
    mirror = Endpoint(base="https://mirror.example/v2", mirror_of="upstream.example")
    scope = "repository:app:pull"
    none = tmp_path / "none.json"
    with RegistryClient(docker_config=none, keychain=kc) as client:
        # no credentials for the mirror itself: those of the registry it mirrors
        assert client._auth.credentials(mirror, scope) == Credentials("kubelet", "pw-up")
    config = _docker_config(tmp_path / "config.json", "mirror.example", "m", "pw-m")
    with RegistryClient(docker_config=config, keychain=kc) as client:
        # the mirror's own credentials come before those of the registry it stands in for
        assert client._auth.credentials(mirror, scope) == Credentials("m", "pw-m")
    with RegistryClient(docker_config=none) as client:       # no keychain: as before
        assert client._auth.credentials(mirror, scope) is None


def test_config_key_and_default_directory() -> None:
    assert RegistryConfig().cri_keychain == ""
    assert Config(root="/var/lib/cs").cri_keychain_dir == "/var/lib/cs/cri-credentials"
    cfg = Config(root="/var/lib/cs", registry=RegistryConfig(cri_keychain="/etc/cs/creds"))
    assert cfg.cri_keychain_dir == "/etc/cs/creds"
