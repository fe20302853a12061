"""containerd hosts.toml resolution and Docker config credentials."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from coldstart.errors import InvalidArgument
from coldstart.oci.credentials import DockerConfig
from coldstart.oci.hosts import HostsConfig, is_loopback


def test_defaults_and_loopback() -> None:
    cfg = HostsConfig.create(None, ["reg.internal:5000"])
    assert cfg.endpoints("127.0.0.1:5000", "pull")[0].base == "http://127.0.0.1:5000/v2"
    assert cfg.endpoints("localhost", "pull")[0].base == "http://localhost/v2"
    assert cfg.endpoints("reg.internal:5000", "push")[0].base == "http://reg.internal:5000/v2"
    assert cfg.endpoints("ghcr.io", "pull")[0].base == "https://ghcr.io/v2"
    assert cfg.endpoints("docker.io", "pull")[0].base == "https://registry-1.docker.io/v2"
    assert is_loopback("[::1]:5000") and not is_loopback("10.0.0.1")


def test_hosts_toml_mirrors(tmp_path: Path) -> None:
    d = tmp_path / "docker.io"
    d.mkdir()
    (d / "hosts.toml").write_text('''
server = "https://registry-1.docker.io"
[host."https://mirror.local:5000"]
  capabilities = ["pull", "resolve"]
  skip_verify = true
  [host."https://mirror.local:5000".header]
    x-token = "abc"
[host."http://p2p.local/custom/path"]
  capabilities = ["pull"]
  override_path = true
  ca = "ca.pem"
''')
    cfg = HostsConfig.create(tmp_path)
    pull = cfg.endpoints("docker.io", "pull")
    assert [e.base for e in pull] == ["https://mirror.local:5000/v2",
                                      "http://p2p.local/custom/path",
                                      "https://registry-1.docker.io/v2"]
    assert pull[0].verify is False and pull[0].headers == {"x-token": "abc"}
    assert pull[0].mirror_of == "docker.io" and pull[2].mirror_of is None
    assert pull[1].verify == str(d / "ca.pem")
    assert [e.host for e in cfg.endpoints("docker.io", "resolve")] == [
        "mirror.local:5000", "registry-1.docker.io"]
    assert [e.host for e in cfg.endpoints("docker.io", "push")] == ["registry-1.docker.io"]
    # a host without its own directory gets the default endpoint
    assert cfg.endpoints("ghcr.io", "pull")[0].base == "https://ghcr.io/v2"


def test_hosts_toml_errors(tmp_path: Path) -> None:
    d = tmp_path / "bad.io"
    d.mkdir()
    (d / "hosts.toml").write_text('[host."https://m"]\ncapabilities = ["fly"]\n')
    with pytest.raises(InvalidArgument, match="capabilities"):
        HostsConfig.create(tmp_path).endpoints("bad.io", "pull")
    (d / "hosts.toml").write_text("not = toml = really")
    with pytest.raises(InvalidArgument, match="cannot read"):
        HostsConfig.create(tmp_path).endpoints("bad.io", "pull")


def test_docker_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"auths": {
        "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:pw:x").decode()},
        "127.0.0.1:5000": {"username": "u", "password": "p"},
        "ghcr.io": {"identitytoken": "refresh"},
        "bad.io": {"auth": "!!!"},
    }}))
    cfg = DockerConfig(path)
    hub = cfg.lookup("docker.io")
    assert hub is not None and (hub.username, hub.secret) == ("hub", "pw:x")
    assert "pw" not in repr(hub)
    local = cfg.lookup("127.0.0.1:5000")
    assert local is not None and local.username == "u"
    gh = cfg.lookup("ghcr.io")
    assert gh is not None and gh.is_identity_token
    assert cfg.lookup("quay.io") is None
    with pytest.raises(InvalidArgument, match="base64"):
        cfg.lookup("bad.io")
    assert DockerConfig(tmp_path / "missing.json").lookup("x") is None
    path.write_text("{")
    with pytest.raises(InvalidArgument):
        DockerConfig(path)


def test_insecure_host_without_port_means_every_port() -> None:
    # `--insecure HOST[:PORT]` means the same on pull, convert, optimize and weights
    cfg = HostsConfig.create(None, ["reg.internal", "other:5000"])
    assert cfg.endpoints("reg.internal:5000", "pull")[0].base == "http://reg.internal:5000/v2"
    assert cfg.endpoints("reg.internal", "pull")[0].base == "http://reg.internal/v2"
    assert cfg.endpoints("other:5000", "pull")[0].base == "http://other:5000/v2"
    assert cfg.endpoints("other:6000", "pull")[0].base == "https://other:6000/v2"
    assert cfg.endpoints("reg.internal.example:5000", "pull")[0].base.startswith("https://")


def test_tls_verify_false_trusts_any_certificate(tmp_path: Path) -> None:
    assert HostsConfig.create(None).endpoints("ghcr.io", "pull")[0].ssl_verify() is True
    off = HostsConfig.create(None, tls_verify=False)
    assert off.endpoints("ghcr.io", "pull")[0].ssl_verify() is False
    d = tmp_path / "reg.example"
    d.mkdir()
    (d / "hosts.toml").write_text('server = "https://reg.example"\n'
                                  '[host."https://mirror.example"]\n  ca = "ca.pem"\n')
    eps = HostsConfig.create(tmp_path, tls_verify=False).endpoints("reg.example", "pull")
    assert [e.verify for e in eps] == [False, False]
