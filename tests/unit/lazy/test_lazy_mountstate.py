"""The FUSE server's persisted mount table."""

from __future__ import annotations

import json
from pathlib import Path

from coldstart.lazyfs.mountstate import MountState
from coldstart.lazyfs.spec import LayerSpec


def spec(n: int) -> LayerSpec:
    return LayerSpec(reference=f"127.0.0.1:5000/r{n}:v1", digest="sha256:" + f"{n:x}" * 64,
                     size=100 + n, media_type="application/vnd.oci.image.layer.v1.tar+zstd",
                     manifest_digest="", annotations={"k": str(n)})


def test_save_load_replace_remove(tmp_path: Path) -> None:
    st = MountState(tmp_path / "state")
    st.save("/mnt/a", spec(1))
    st.save("/mnt/b", spec(2))
    st.save("/mnt/a", spec(3))                       # replaces
    recs = {r.mountpoint: r.spec for r in MountState(tmp_path / "state").load()}
    assert recs == {"/mnt/a": spec(3), "/mnt/b": spec(2)}
    st.remove("/mnt/a")
    st.remove("/mnt/never")
    assert [r.mountpoint for r in st.load()] == ["/mnt/b"]
    assert not [p for p in (tmp_path / "state").iterdir() if p.name.startswith(".")]


def test_unreadable_records_are_skipped(tmp_path: Path) -> None:
    st = MountState(tmp_path)
    st.save("/mnt/ok", spec(4))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "wrong.json").write_text('{"mountpoint": 5, "spec": {}}')
    assert [r.mountpoint for r in st.load()] == ["/mnt/ok"]


def test_the_layer_name_and_inodes_are_kept_for_a_takeover(tmp_path: Path) -> None:
    st = MountState(tmp_path)
    st.save("/mnt/a", spec(5), key="abcdef0123456789-3", base=4711, end=4800)
    st.save("/mnt/b", spec(6))                       # an older server's record: no layer
    recs = {r.mountpoint: (r.key, r.base, r.end) for r in st.load()}
    assert recs == {"/mnt/a": ("abcdef0123456789-3", 4711, 4800), "/mnt/b": (None, None, None)}
    for bad in ({"key": "a/x", "base": 9, "end": 20}, {"key": "k-1", "base": True, "end": 20},
                {"key": "k-1", "base": 1, "end": 20}, {"key": "", "base": 9, "end": 20},
                {"key": 3, "base": 9, "end": 20}, {"key": "k-1", "base": 9},
                {"key": "k-1", "base": 9, "end": 9}):
        (tmp_path / "odd.json").write_text(json.dumps(
            {"mountpoint": "/mnt/odd", "spec": json.loads(spec(7).to_json()), "layer": bad}))
        odd = next(r for r in st.load() if r.mountpoint == "/mnt/odd")
        assert (odd.key, odd.base, odd.end) == (None, None, None), bad  # a fresh name instead


def test_the_connection_a_bind_is_from_is_kept(tmp_path: Path) -> None:
    """``plain``: bound from the FUSE connection that answers no getxattr. Such a record keeps
    its layer under a key of its own, so that a server older than that connection (which reads
    only ``layer``) binds the layer afresh instead of keeping a bind it cannot serve; records
    written before that connection existed were all bound from the other one."""
    st = MountState(tmp_path)
    st.save("/mnt/p", spec(8), key="k-1", base=10, end=20, plain=True)
    st.save("/mnt/f", spec(9), key="k-2", base=30, end=40)
    recs = {r.mountpoint: (r.key, r.base, r.end, r.plain) for r in st.load()}
    assert recs == {"/mnt/p": ("k-1", 10, 20, True), "/mnt/f": ("k-2", 30, 40, False)}
    docs = {(d := json.loads(p.read_text()))["mountpoint"]: d for p in tmp_path.glob("*.json")}
    assert "layer" not in docs["/mnt/p"] and "plain_layer" not in docs["/mnt/f"]
    (tmp_path / "odd.json").write_text(json.dumps(
        {"mountpoint": "/mnt/odd", "spec": json.loads(spec(11).to_json()),
         "plain_layer": {"key": "k-4", "base": 70}}))
    odd = next(r for r in st.load() if r.mountpoint == "/mnt/odd")
    assert (odd.key, odd.plain) == (None, True)        # a fresh name; its bind is detached
