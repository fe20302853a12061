"""No silent fallback: why a layer offered for lazy pulling was pulled normally, in the log, the
metrics, the snapshot's labels (kept through Commit) and the read-only view `status` uses."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from coldstart.errors import (
    AlreadyExists,
    ColdstartError,
    DeadlineExceeded,
    FailedPrecondition,
    FormatError,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.lazyfs.client import FuseServerUnreachable
from coldstart.lazyfs.spec import (
    CRI_IMAGE_REF,
    CRI_LAYER_DIGEST,
    REMOTE_ANNOTATIONS,
    REMOTE_DIGEST,
    REMOTE_REFERENCE,
    TARGET_SNAPSHOT_REF,
    LayerSpec,
)
from coldstart.snapshotter.daemon import FuseServerFailed
from coldstart.snapshotter.service_metrics import LAZY_FALLBACKS, ServiceMetrics
from coldstart.snapshotter.snapshotter import (
    FALLBACK_REASONS,
    IMAGE_LABEL,
    LAYER_LABEL,
    LAZY_LABEL,
    REASON_LABEL,
    Snapshotter,
    fallback_reason,
)
from coldstart.snapshotter.store import Kind, Store, read_infos

LAYER = "sha256:" + "a" * 64


@pytest.mark.parametrize(("exc", "reason"), [
    # what open_layer / the resolver / the client raise, by case
    (FailedPrecondition("layer has no TOC digest annotation: cannot verify its TOC"),
     "no-toc-digest"),
    (FailedPrecondition("layer sha256:1: no TOC digest annotation and no gzip index for "
                        "image sha256:2"), "no-index"),
    (FailedPrecondition("layer sha256:1: gzip index not trusted: sha256:3"), "index-untrusted"),
    (FailedPrecondition("layer sha256:1: its gzip index proved wrong (digest ...)"),
     "index-failed"),
    (FormatError("no eStargz or zstd:chunked footer at the end of the blob"), "not-seekable"),
    (IntegrityError("TOC digest sha256:1 does not match the annotation"), "integrity"),
    (Unavailable("registry answered 503"), "unavailable"),
    (DeadlineExceeded("FUSE server: no answer to mount within 60 s"), "unavailable"),
    (FuseServerUnreachable("FUSE server at /x is not reachable"), "no-fuse-server"),
    (FuseServerFailed("the FUSE server exited with status 2 at start"), "no-fuse-server"),
    (NotFound("manifest sha256:1 has no layer sha256:2"), "not-found"),
    (InvalidArgument("bad reference"), "bad-labels"),
    (FailedPrecondition("the FUSE server is shutting down"), "other"),
    (AlreadyExists("/m already serves layer sha256:3"), "other"),
    (ColdstartError("?"), "other"),
    (RuntimeError("bug"), "other"),
])
def test_each_failure_kind_has_its_reason(exc: BaseException, reason: str) -> None:
    assert fallback_reason(exc) == reason
    assert reason in FALLBACK_REASONS


class FailingMounter:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def mount(self, mountpoint: str, spec: LayerSpec) -> None:
        raise self.exc

    def check(self, mountpoint: str) -> None:
        raise NotFound(mountpoint)

    def unmount(self, mountpoint: str) -> None:
        pass


def _snapshotter(tmp_path: Path, mounter: FailingMounter | None,
                 metrics: ServiceMetrics) -> tuple[Snapshotter, Store]:
    store = Store(tmp_path / "root" / "metadata.db")
    return Snapshotter(tmp_path / "root", store, mounter, index_off=True,
                       on_remote=metrics.remote_layer), store


def _metric(metrics: ServiceMetrics, reason: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(f'{LAZY_FALLBACKS}{{reason="{reason}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"no {LAZY_FALLBACKS} for {reason}")


@pytest.mark.parametrize(("mounter_exc", "labels", "reason"), [
    (IntegrityError("TOC digest sha256:1 does not match"),
     {REMOTE_REFERENCE: "reg.example/app:v1", REMOTE_DIGEST: LAYER}, "integrity"),
    (FailedPrecondition("layer has no TOC digest annotation: cannot verify its TOC"),
     {CRI_IMAGE_REF: "reg.example/cri:v2", CRI_LAYER_DIGEST: LAYER}, "no-toc-digest"),
    (None, {REMOTE_REFERENCE: "reg.example/app:v1", REMOTE_DIGEST: LAYER}, "no-fuse-server"),
    (IntegrityError("never asked"), {REMOTE_REFERENCE: "reg.example/app:v1",
                                     REMOTE_DIGEST: LAYER, REMOTE_ANNOTATIONS: "{not json"},
     "bad-labels"),
])
def test_a_fallback_is_logged_counted_and_labelled_through_commit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, mounter_exc: Exception | None,
        labels: dict[str, str], reason: str) -> None:
    metrics = ServiceMetrics()
    sn, store = _snapshotter(tmp_path, None if mounter_exc is None
                             else FailingMounter(mounter_exc), metrics)
    chain = "sha256:" + "c" * 64
    key = f"default/1/extract-1 {chain}"
    image = labels.get(REMOTE_REFERENCE) or labels[CRI_IMAGE_REF]
    with caplog.at_level(logging.WARNING, logger="coldstart.snapshotter"):
        mounts = sn.prepare(key, "", {TARGET_SNAPSHOT_REF: chain, **labels})
    assert os.listdir(mounts[0].source) == []            # a plain ACTIVE: containerd unpacks
    (line,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = line.getMessage()
    assert LAYER in text and image in text and f"reason {reason}" in text, text
    assert _metric(metrics, reason) == 1
    assert sum(_metric(metrics, r) for r in FALLBACK_REASONS) == 1
    ours = {LAZY_LABEL: "false", REASON_LABEL: reason, LAYER_LABEL: LAYER, IMAGE_LABEL: image}
    assert ours.items() <= sn.stat(key).labels.items()

    # containerd commits with its own labels: ours stay
    sn.commit(f"default/2/{chain}", key, {"containerd.io/gc.root": "x"})
    info = sn.stat(f"default/2/{chain}")
    assert info.kind == Kind.COMMITTED
    assert info.labels == {"containerd.io/gc.root": "x", **ours}

    # what `coldstart snapshotter status` reads, read-only, beside the daemon's store
    (row,) = [i for i in read_infos(tmp_path / "root" / "metadata.db")
              if i.labels.get(LAZY_LABEL) == "false"]
    assert (row.name, row.labels[REASON_LABEL]) == (f"default/2/{chain}", reason)
    store.close()


def test_layers_not_offered_lazily_say_nothing_and_commit_keeps_its_labels(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServiceMetrics()
    sn, store = _snapshotter(tmp_path, FailingMounter(IntegrityError("x")), metrics)
    with caplog.at_level(logging.WARNING, logger="coldstart.snapshotter"):
        sn.prepare("k", "", {TARGET_SNAPSHOT_REF: "sha256:" + "d" * 64})   # no layer named
        sn.prepare("k2", "", {REMOTE_REFERENCE: "r/a:v1", REMOTE_DIGEST: LAYER})  # no target
    assert not caplog.records
    assert sum(_metric(metrics, r) for r in FALLBACK_REASONS) == 0
    sn.commit("c", "k", {"a": "b"})
    assert sn.stat("c").labels == {"a": "b"}
    # the caller's value wins over ours (and "" deletes, as everywhere)
    sn.update("k2", {LAZY_LABEL: "false", REASON_LABEL: "other"}, ["labels"])
    sn.commit("c2", "k2", {REASON_LABEL: "mine", LAZY_LABEL: ""})
    assert sn.stat("c2").labels == {REASON_LABEL: "mine"}
    store.close()


def test_read_infos_of_no_metadata_is_empty(tmp_path: Path) -> None:
    assert read_infos(tmp_path / "none.db") == []
