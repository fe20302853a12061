"""Our keys in containerd's config.toml: put in and taken out, nothing else touched."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from coldstart.errors import FailedPrecondition, FormatError, InvalidArgument
from coldstart.node.containerd_config import Target, apply, missing, revert

CONFIGS = Path(__file__).parent / "configs"
SAMPLES = sorted(CONFIGS.glob("*.toml"))
T = Target(socket="/run/coldstart/snapshotter.sock", root="/var/lib/coldstart")
CRI2 = "io.containerd.grpc.v1.cri"


def _get(doc: dict, *path: str) -> object:
    for p in path:
        doc = doc[p]
    return doc


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("handler", [None, "coldstart-rc"])
def test_apply_sets_our_keys_and_revert_gives_the_same_settings(sample: Path,
                                                                handler: str | None) -> None:
    text = sample.read_text()
    target = Target(T.socket, T.root, handler)
    change = apply(text, target)
    doc = tomllib.loads(change.text)
    assert _get(doc, "proxy_plugins", "coldstart") == {
        "type": "snapshot", "address": T.socket, "exports": {"root": "/var/lib/coldstart/"}}
    assert missing(change.text, target) == []
    assert missing(text, target) != []
    # every comment of the original is still there
    for line in text.splitlines():
        if "#" in line:
            assert "#" + line.split("#", 1)[1] in change.text
    # idempotent: a second apply changes nothing
    again = apply(change.text, target)
    assert again.text == change.text and again.edits == () and again.created == ()
    # what containerd reads after revert is what it read before
    back, notes = revert(change.text, change.edits, change.created)
    assert tomllib.loads(back) == tomllib.loads(text) and notes == []


def test_schema_2_sets_the_cri_plugin_and_keeps_the_rest() -> None:
    text = (CONFIGS / "containerd-1.6.toml").read_text()
    doc = tomllib.loads(apply(text, T).text)
    ctd = _get(doc, "plugins", CRI2, "containerd")
    assert ctd["snapshotter"] == "coldstart" and ctd["disable_snapshot_annotations"] is False
    assert ctd["runtimes"]["nvidia"]["options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"
    assert doc["oom_score"] == -999 and doc["metrics"]["address"] == "127.0.0.1:1338"


def test_schema_3_sets_the_cri_image_plugin() -> None:
    text = (CONFIGS / "containerd-2.x.toml").read_text()
    change = apply(text, T)
    doc = tomllib.loads(change.text)
    images = _get(doc, "plugins", "io.containerd.cri.v1.images")
    assert images["snapshotter"] == "coldstart" and images["disable_snapshot_annotations"] is False
    assert images["pinned_images"] == {"sandbox": "registry.k8s.io/pause:3.10"}
    assert CRI2 not in doc["plugins"]
    # a key we changed keeps its line (indent, comment); the one we added is indented alike
    assert "    disable_snapshot_annotations = false   # upstream default\n" in change.text


def test_a_config_without_a_cri_section_gets_one() -> None:
    change = apply((CONFIGS / "no-cri.toml").read_text(), T)
    ctd = _get(tomllib.loads(change.text), "plugins", CRI2, "containerd")
    assert ctd == {"snapshotter": "coldstart", "disable_snapshot_annotations": False}
    assert ("plugins", CRI2, "containerd") in change.created


@pytest.mark.parametrize(("sample", "runtimes"), [
    ("containerd-1.6.toml", ("plugins", CRI2, "containerd", "runtimes")),
    ("containerd-2.x.toml", ("plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes")),
])
def test_a_runtime_handler_uses_coldstart_and_the_default_stays(sample: str,
                                                                runtimes: tuple[str, ...]) -> None:
    text = (CONFIGS / sample).read_text()
    doc = tomllib.loads(apply(text, Target(T.socket, T.root, "gpu-lazy")).text)
    want: dict[str, object] = {"runtime_type": "io.containerd.runc.v2", "snapshotter": "coldstart"}
    if "1.6" in sample:
        # the default runtime is nvidia (GPU Operator nodes): the new handler takes its
        # options, so the pods that opt in keep their GPUs and cgroup driver
        want["options"] = {"BinaryName": "/usr/bin/nvidia-container-runtime",
                           "SystemdCgroup": True}
    assert _get(doc, *runtimes, "gpu-lazy") == want
    before = tomllib.loads(text)
    images = ("plugins", CRI2, "containerd") if "1.6" in sample else \
        ("plugins", "io.containerd.cri.v1.images")
    assert _get(doc, *images, "snapshotter") == _get(before, *images, "snapshotter")
    assert _get(doc, *images, "disable_snapshot_annotations") is False
    # an existing runtime keeps its runtime_type and options
    doc = tomllib.loads(apply(text, Target(T.socket, T.root, "runc")).text)
    assert _get(doc, *runtimes, "runc", "runtime_type") == "io.containerd.runc.v2"
    assert _get(doc, *runtimes, "runc", "snapshotter") == "coldstart"


@pytest.mark.parametrize(("sample", "runtimes"), [
    ("containerd-1.6.toml", ("plugins", CRI2, "containerd", "runtimes")),
    ("containerd-2.x.toml", ("plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes")),
])
def test_snapshot_restore_makes_the_handlers_runc_the_wrapper_and_passes_the_annotation(
        sample: str, runtimes: tuple[str, ...]) -> None:
    text = (CONFIGS / sample).read_text()
    target = Target(T.socket, T.root, "restore", "/usr/local/bin/coldstart-runc")
    if "1.6" in sample:
        # the default runtime is nvidia-container-runtime: a new handler would lose it under
        # the wrapper without a word; the operator makes the handler (install keeps it)
        with pytest.raises(FailedPrecondition, match="nvidia-container-runtime"):
            apply(text, target)
        text += ('\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.restore]\n'
                 '  runtime_type = "io.containerd.runc.v2"\n')
    change = apply(text, target)
    doc = tomllib.loads(change.text)
    handler = _get(doc, *runtimes, "restore")
    assert isinstance(handler, dict)
    assert handler["options"]["BinaryName"] == "/usr/local/bin/coldstart-runc"
    assert handler["pod_annotations"] == ["dev.coldstart.snapshot"]
    assert missing(change.text, target) == []
    # the default runtime is left as it is, and revert takes all of it out
    assert _get(doc, *runtimes).keys() >= _get(tomllib.loads(text), *runtimes).keys()
    back, notes = revert(change.text, change.edits, change.created, like=text)
    assert tomllib.loads(back) == tomllib.loads(text) and notes == []
    # a handler that passes other annotations keeps them
    other = apply(text, Target(T.socket, T.root, "restore")).text.replace(
        'snapshotter = "coldstart"', 'snapshotter = "coldstart"\npod_annotations = ["a.b/c"]', 1)
    doc = tomllib.loads(apply(other, target).text)
    assert _get(doc, *runtimes, "restore", "pod_annotations") == ["a.b/c",
                                                                   "dev.coldstart.snapshot"]


def test_a_handler_in_a_config_without_runtimes_keeps_the_default_runtime() -> None:
    """containerd fills in its ``runc`` runtime only while none is configured: the handler's
    table must not leave the CRI without its default (it would not load at all)."""
    text = ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
            '  snapshotter = "overlayfs"\n')
    change = apply(text, Target(T.socket, T.root, "restore"))
    runtimes = _get(tomllib.loads(change.text), "plugins", CRI2, "containerd", "runtimes")
    assert isinstance(runtimes, dict)
    assert runtimes["runc"] == {"runtime_type": "io.containerd.runc.v2"}
    assert runtimes["restore"]["snapshotter"] == "coldstart"
    back, notes = revert(change.text, change.edits, change.created, like=text)
    assert tomllib.loads(back) == tomllib.loads(text) and notes == []


def test_revert_after_an_operator_edit_keeps_the_edit_and_names_what_it_left() -> None:
    text = (CONFIGS / "containerd-1.6.toml").read_text()
    change = apply(text, T)
    edited = change.text.replace('level = "info"', 'level = "debug"  # operator')
    edited = edited.replace('disable_snapshot_annotations = false',
                            'disable_snapshot_annotations = true')
    back, notes = revert(edited, change.edits, change.created, like=text)
    doc = tomllib.loads(back)
    assert doc["debug"]["level"] == "debug" and "# operator" in back
    assert "proxy_plugins" not in doc
    ctd = _get(doc, "plugins", CRI2, "containerd")
    assert ctd["snapshotter"] == "overlayfs"                   # put back as it was
    assert '      snapshotter = "overlayfs"   # the default until coldstart\n' in back
    assert ctd["disable_snapshot_annotations"] is True         # the operator's: left
    assert len(notes) == 1 and "disable_snapshot_annotations" in notes[0]


def test_revert_keeps_a_table_we_made_when_the_operator_added_to_it() -> None:
    text = (CONFIGS / "no-cri.toml").read_text()
    change = apply(text, T)
    header = "[proxy_plugins.coldstart.exports]\n"
    edited = change.text.replace(header, header + 'enable_remote_snapshot_annotations = "true"\n')
    doc = tomllib.loads(revert(edited, change.edits, change.created)[0])
    assert doc["proxy_plugins"] == {
        "coldstart": {"exports": {"enable_remote_snapshot_annotations": "true"}}}


def test_schema_1_and_bad_files_are_refused_with_what_to_do() -> None:
    with pytest.raises(FailedPrecondition, match=r"no `version` key.*schema 1.*version = 2"):
        apply('root = "/var/lib/containerd"\n[plugins.cri]\n  sandbox_image = "x"\n', T)
    with pytest.raises(FailedPrecondition, match="no `version`"):
        apply("# only comments\n", T)
    with pytest.raises(InvalidArgument, match="config version 4"):
        apply("version = 4\n", T)
    with pytest.raises(FormatError, match="not valid TOML"):
        apply("version = 2\n[plugins\n", T)
    with pytest.raises(FailedPrecondition, match="proxy_plugins is not a table"):
        apply('version = 2\nproxy_plugins = "x"\n', T)
