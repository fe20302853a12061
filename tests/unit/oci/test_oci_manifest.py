"""Manifests, indexes and configs: parsing both dialects, platform choice, diff_id rewrite."""

from __future__ import annotations

import json

import pytest

from coldstart.errors import FormatError, InvalidArgument, NotFound
from coldstart.oci.manifest import (
    DOCKER_MANIFEST,
    DOCKER_MANIFEST_LIST,
    OCI_INDEX,
    OCI_MANIFEST,
    ImageConfig,
    Index,
    Manifest,
    Platform,
    digest_of,
    host_platform,
    parse_any,
    parse_index,
    parse_manifest,
    parse_platforms,
    select_platform,
)

D1, D2, D3 = ("sha256:" + c * 64 for c in "123")


def _manifest(media: str | None = OCI_MANIFEST, **extra: object) -> bytes:
    obj: dict[str, object] = {
        "schemaVersion": 2,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": D1,
                   "size": 10},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": D2,
                    "size": 20, "annotations": {"a": "b"}}],
        **extra,
    }
    if media:
        obj["mediaType"] = media
    return json.dumps(obj).encode()


def test_parse_manifest_oci_docker_and_unlabelled() -> None:
    for media in (OCI_MANIFEST, DOCKER_MANIFEST, None):
        m = parse_manifest(_manifest(media))
        assert m.media_type == (media or OCI_MANIFEST)
        assert m.config.digest == D1 and m.layers[0].size == 20
        assert m.layers[0].annotations == {"a": "b"}


def test_manifest_roundtrip_keeps_unknown_fields() -> None:
    body = _manifest(subject={"mediaType": OCI_MANIFEST, "digest": D3, "size": 1})
    m = parse_manifest(body)
    again = json.loads(m.to_bytes())
    assert again["subject"]["digest"] == D3
    assert parse_manifest(m.to_bytes()) == Manifest(m.media_type, m.config, m.layers,
                                                    m.annotations, again)


@pytest.mark.parametrize("body", [
    b"not json", b"[]", _manifest(schemaVersion=1),
    json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "layers": []}).encode(),
    _manifest(layers=[{"digest": "sha256:short", "size": 1}]),
    _manifest(layers=[{"digest": D2, "size": -1}]),
    _manifest(layers=[{"digest": D2, "size": 1, "annotations": {"a": 1}}]),
])
def test_parse_manifest_rejects(body: bytes) -> None:
    with pytest.raises(FormatError):
        parse_manifest(body)


def _index(media: str = OCI_INDEX) -> bytes:
    return json.dumps({
        "schemaVersion": 2, "mediaType": media,
        "manifests": [
            {"mediaType": OCI_MANIFEST, "digest": D1, "size": 1,
             "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
            {"mediaType": OCI_MANIFEST, "digest": D2, "size": 2,
             "platform": {"os": "linux", "architecture": "amd64"}},
            {"mediaType": OCI_MANIFEST, "digest": D3, "size": 3,
             "platform": {"os": "unknown", "architecture": "unknown"},
             "annotations": {"vnd.docker.reference.type": "attestation-manifest"}},
        ]}).encode()


def test_index_and_platform_selection() -> None:
    for media in (OCI_INDEX, DOCKER_MANIFEST_LIST):
        idx = parse_index(_index(media))
        assert isinstance(parse_any(_index(media)), Index)
        assert select_platform(idx, Platform.parse("linux/amd64")).digest == D2
        assert select_platform(idx, Platform.parse("linux/aarch64")).digest == D1
        assert select_platform(idx, Platform.parse("linux/arm64/8")).digest == D1
        with pytest.raises(NotFound, match="linux/s390x"):
            select_platform(idx, Platform.parse("linux/s390x"))
    assert isinstance(parse_any(_manifest()), Manifest)
    with pytest.raises(FormatError):
        parse_index(_manifest())
    with pytest.raises(FormatError):
        parse_manifest(_index())


def test_platform_parse() -> None:
    assert str(Platform.parse("linux/x86_64")) == "linux/amd64"
    for bad in ("linux//v7", "a/b/c/d", "nosuchos", "linux/amd64,linux/arm64", "",
                "linux/amd 64"):
        with pytest.raises(InvalidArgument):
            Platform.parse(bad)


@pytest.mark.parametrize(("text", "want"), [
    # as containerd's platforms.Parse normalises them
    ("Linux/AMD64", ("linux", "amd64", None)),
    ("linux/aarch64", ("linux", "arm64", None)),
    ("linux/arm64/v8", ("linux", "arm64", "v8")),
    ("linux/arm64/8", ("linux", "arm64", "v8")),
    ("linux/armhf", ("linux", "arm", "v7")),
    ("linux/arm", ("linux", "arm", "v7")),
    ("linux/x86_64/v3", ("linux", "amd64", "v3")),
    ("linux/amd64/v1", ("linux", "amd64", None)),
    ("linux/armel", ("linux", "arm", "v6")),
    ("linux/arm/7", ("linux", "arm", "v7")),
    ("linux/i386", ("linux", "386", None)),
    ("macos/x86_64", ("darwin", "amd64", None)),
    ("arm64", ("linux", "arm64", None)),
])
def test_platform_parse_normalises_like_containerd(text: str,
                                                   want: tuple[str, str, str | None]) -> None:
    p = Platform.parse(text)
    assert (p.os, p.architecture, p.variant) == want


def test_platform_parse_one_word_os_takes_this_machines_arch() -> None:
    p = Platform.parse("linux")
    assert p.os == "linux" and p.architecture == host_platform().architecture


def test_arm_without_a_variant_is_v7_when_matching() -> None:
    # an index with arm/v5, v6, v7 (as busybox's): `--platform linux/arm` is v7, not "any"
    images = [Platform("linux", "arm", v) for v in ("v5", "v6", "v7")]
    for text in ("linux/arm", "linux/armhf", "armhf"):
        want = Platform.parse(text)
        assert [str(p) for p in images if p.matches(want)] == ["linux/arm/v7"], text


def test_platform_comma_lists() -> None:
    # the new-user review's bug: "linux/amd64,linux/arm64" became arch "amd64,linux", variant
    # "arm64"; a comma list is several platforms where several make sense, refused where not
    assert [str(p) for p in parse_platforms(["linux/amd64,linux/arm64", "Linux/AMD64"])] == [
        "linux/amd64", "linux/arm64"]
    with pytest.raises(InvalidArgument, match="several platforms"):
        Platform.parse("linux/amd64,linux/arm64")
    with pytest.raises(InvalidArgument, match="empty entry"):
        parse_platforms(["linux/amd64,"])


def test_config_diff_id_rewrite_keeps_everything_else() -> None:
    raw = {"architecture": "amd64", "os": "linux", "config": {"Env": ["A=1"]},
           "rootfs": {"type": "layers", "diff_ids": [D1, D2]}, "history": [{"x": 1}]}
    cfg = ImageConfig.parse(json.dumps(raw).encode())
    assert cfg.diff_ids == (D1, D2)
    assert str(cfg.platform) == "linux/amd64"
    new = ImageConfig.parse(cfg.with_diff_ids([D3, D1]).to_bytes())
    assert new.diff_ids == (D3, D1)
    assert new.raw["config"] == raw["config"] and new.raw["history"] == raw["history"]
    assert cfg.diff_ids == (D1, D2)  # the original is untouched
    with pytest.raises(InvalidArgument):
        cfg.with_diff_ids([D1])
    with pytest.raises(FormatError):
        ImageConfig.parse(b'{"rootfs": {}}')


def test_digest_of() -> None:
    assert digest_of(b"") == ("sha256:e3b0c44298fc1c149afbf4c8996fb924"
                              "27ae41e4649b934ca495991b7852b855")
