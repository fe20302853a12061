"""Reference parsing follows docker/containerd normalisation and rejects malformed input."""

from __future__ import annotations

import pytest

from coldstart.errors import InvalidArgument
from coldstart.oci.reference import Reference

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("text", "registry", "repo", "tag", "digest"), [
    ("ubuntu", "docker.io", "library/ubuntu", "latest", None),
    ("ubuntu:22.04", "docker.io", "library/ubuntu", "22.04", None),
    ("bitnami/redis", "docker.io", "bitnami/redis", "latest", None),
    ("docker.io/ubuntu", "docker.io", "library/ubuntu", "latest", None),
    ("index.docker.io/library/ubuntu:1", "docker.io", "library/ubuntu", "1", None),
    ("localhost/app", "localhost", "app", "latest", None),
    ("127.0.0.1:5000/a/b/c:v1", "127.0.0.1:5000", "a/b/c", "v1", None),
    (f"127.0.0.1:5000/app@{D}", "127.0.0.1:5000", "app", None, D),
    (f"ghcr.io/o/app:v2@{D}", "ghcr.io", "o/app", "v2", D),
    ("[::1]:5000/app:x", "[::1]:5000", "app", "x", None),
])
def test_parse(text: str, registry: str, repo: str, tag: str | None, digest: str | None) -> None:
    ref = Reference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repo, tag, digest)
    assert Reference.parse(str(ref)) == ref


def test_str_and_helpers() -> None:
    ref = Reference.parse("ubuntu")
    assert str(ref) == "docker.io/library/ubuntu:latest"
    assert ref.api_host == "registry-1.docker.io"
    pinned = ref.with_digest(D)
    assert str(pinned) == f"docker.io/library/ubuntu:latest@{D}"
    assert pinned.reference == D
    assert ref.with_tag("x").reference == "x"
    assert pinned.with_tag("y").digest is None
    assert ref.with_repository("other/app").name == "docker.io/other/app"


@pytest.mark.parametrize("bad", [
    "", " ubuntu", "Ubuntu", "ubuntu:", "ubuntu:-x", "a//b", "https://ghcr.io/a",
    "ubuntu@sha256:123", "127.0.0.1:5000/", "a b", "ghcr.io/o/app:" + "x" * 129,
])
def test_rejects(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        Reference.parse(bad)


def test_with_digest_validates() -> None:
    with pytest.raises(InvalidArgument):
        Reference.parse("a").with_digest("md5:abc")


def test_docker_transport_prefix_is_skopeos_spelling() -> None:
    assert Reference.parse("docker://127.0.0.1:5000/a/b:v1") == \
        Reference.parse("127.0.0.1:5000/a/b:v1")
    assert Reference.parse("docker://ubuntu").name == "docker.io/library/ubuntu"
    with pytest.raises(InvalidArgument, match="drop the URL scheme"):
        Reference.parse("oci://127.0.0.1:5000/a")
