"""The FUSE server's persisted mount table."""

from __future__ import annotations

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
