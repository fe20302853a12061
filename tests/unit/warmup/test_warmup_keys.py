"""The warm-up key changes exactly when a component it names changes, and never with paths,
host names, users or the working directory."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coldstart.errors import FormatError
from coldstart.format.layer import open_layer
from coldstart.format.readat import FileReadAt
from coldstart.warmup.bundle import evidence, pack, snapshot, unpack
from coldstart.warmup.keys import COMPONENTS, WarmupKey, compute_key, cpu_isa, differences

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme de pse tsc msr sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt aes avx f16c \
rdrand hypervisor lahf_lm abm avx2 bmi1 bmi2 avx512f avx512dq avx512bw avx512vl avx512_bf16 \
arat md_clear flush_l1d smep constant_tsc
bugs\t\t: spectre_v1 spectre_v2

processor\t: 1
flags\t\t: fpu sse sse2
"""


def test_each_component_changes_the_key_and_nothing_else_does() -> None:
    base = compute_key()
    assert set(base.components) == set(COMPONENTS)
    seen = {base.digest}
    for name in COMPONENTS:
        changed = compute_key(overrides={name: base.components[name] + "-other"})
        assert changed.digest not in seen, name
        seen.add(changed.digest)
        assert differences(base, changed) and differences(base, changed)[0].startswith(name)
    assert compute_key().digest == base.digest
    assert differences(base, compute_key()) == []


def test_paths_hosts_users_and_cwd_do_not_enter_the_key(tmp_path: Path) -> None:
    code = "from coldstart.warmup.keys import compute_key; print(compute_key().digest)"
    env = {k: v for k, v in os.environ.items() if k != "COLDSTART_MODEL_VERSION"}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout
    other = {**env, "HOME": str(tmp_path), "HOSTNAME": "pod-10-1-2-3", "USER": "nobody",
             "POD_IP": "10.1.2.3", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c"),
             "XDG_CACHE_HOME": str(tmp_path / "x")}
    second = subprocess.run([sys.executable, "-c", code], env=other, cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout
    assert first == second


def test_the_model_version_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLDSTART_MODEL_VERSION", raising=False)
    assert compute_key().components["model"] == "none"
    monkeypatch.setenv("COLDSTART_MODEL_VERSION", "llama-3-8b@7")
    assert compute_key().components["model"] == "llama-3-8b@7"
    assert compute_key("v8").components["model"] == "v8"


def test_a_rebuilt_torch_changes_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch component follows the installed files' RECORD (what a rebuilt or patched
    torch changes), read with importlib.metadata: a fake distribution shows it."""
    from coldstart.warmup.keys import _dist

    info = tmp_path / "fakecc-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakecc\nVersion: 1.0\n")
    (info / "RECORD").write_text("fakecc/__init__.py,sha256=aaaa,10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = _dist("fakecc")
    (info / "RECORD").write_text("fakecc/__init__.py,sha256=bbbb,10\n")
    second = _dist("fakecc")
    assert first.startswith("1.0 record:") and second.startswith("1.0 record:")
    assert first != second
    assert _dist("no-such-distribution-here") == "none"


def test_cpu_isa_keeps_instruction_set_flags_only(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    isa = cpu_isa(str(info))
    _, _, flags = isa.partition(":")
    got = set(flags.split())
    assert {"avx2", "avx512f", "avx512_bf16", "fma", "sse4_2", "bmi2", "aes"} <= got
    assert not got & {"hypervisor", "md_clear", "flush_l1d", "smep", "constant_tsc", "fpu",
                      "arat"}
    assert cpu_isa(str(tmp_path / "missing")).endswith(":unknown")


def test_an_isa_difference_says_what_this_cpu_lacks() -> None:
    here = compute_key(overrides={"isa": "x86_64:avx avx2 fma"})
    art = compute_key(overrides={"isa": "x86_64:avx avx2 avx512_bf16 avx512f fma"})
    why = differences(here, art)
    assert why == ["isa: this CPU lacks avx512_bf16 avx512f"]


def test_a_key_round_trips_and_refuses_bad_documents() -> None:
    k = compute_key()
    assert WarmupKey.parse(k.canonical()) == k
    for bad in (b"not json", b'{"version": 99, "components": {}}', b'{"version": 1}',
                b'{"version": 1, "components": {"torch": "x"}}'):
        with pytest.raises(FormatError):
            WarmupKey.parse(bad)


def test_pack_leaves_locks_and_temporaries_out_and_unpack_restores_the_rest(
        tmp_path: Path) -> None:
    files = {"inductor/fxgraph/ab/entry": b"graph" * 1000, "inductor/ab/cab.so": b"\x7fELF" * 99,
             "inductor/ab/cab.so.lock": b"", "inductor/tmpx1y2/partial": b"half",
             "triton/k/k.cubin": b"cubin"}
    src = tmp_path / "src"
    for rel, data in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    buf = io.BytesIO()
    packed = pack({"inductor": src / "inductor", "triton": src / "triton"}, buf)
    assert packed.files == 3 and packed.roles == {"inductor": 2, "triton": 1}
    blob = tmp_path / "bundle"
    blob.write_bytes(buf.getvalue())
    layer = open_layer(FileReadAt(str(blob)), annotations=packed.layer.annotations)
    dst = {"inductor": tmp_path / "dst/i", "triton": tmp_path / "dst/t"}
    before = snapshot(dst)
    done = unpack(layer, dst)
    assert done.files == 3 and done.kept == 0
    assert (tmp_path / "dst/i/ab/cab.so").read_bytes() == files["inductor/ab/cab.so"]
    assert (tmp_path / "dst/t/k/k.cubin").read_bytes() == b"cubin"
    assert not (tmp_path / "dst/i/ab/cab.so.lock").exists()
    assert not list((tmp_path / "dst/i").glob(".tmp-coldstart-*"))   # staging removed
    ev = evidence(before, dst)            # what a restore wrote counts as compiles here
    assert ev.compiled == 2 and ev.graphs == 1
    again = unpack(layer, dst)            # files already there are kept
    assert again.files == 0 and again.kept == 3
    assert evidence(snapshot(dst), dst).new_files == 0


def test_entries_that_escape_or_name_no_role_are_refused(tmp_path: Path) -> None:
    import tarfile

    refused_by_unpack = 0
    for name in ("../etc/passwd", "/etc/passwd", "inductor/../../x", "weights/model.bin"):
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
        raw.seek(0)
        out = io.BytesIO()
        from coldstart.format.writer import convert_layer

        try:
            result = convert_layer(raw, out, format="zstd:chunked")
        except FormatError:
            continue        # the writer refused it already
        blob = tmp_path / "b"
        blob.write_bytes(out.getvalue())
        layer = open_layer(FileReadAt(str(blob)), annotations=result.annotations)
        dst = {"inductor": tmp_path / "i", "triton": tmp_path / "t"}
        with pytest.raises(FormatError):
            unpack(layer, dst)
        refused_by_unpack += 1
        assert not any(tmp_path.rglob("passwd")) and not (tmp_path / "x").exists()
    assert refused_by_unpack >= 1


def test_the_torch_component_ignores_where_and_how_torch_was_installed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same wheel installed by pip into a venv (scripts naming that venv's python, .pyc
    lines) or with --target --no-compile (no .pyc lines, scripts elsewhere) has one key."""
    from coldstart.warmup.keys import _dist

    files = ["fakecc/__init__.py,sha256=aaaa,10", "fakecc/lib/x.so,sha256=bbbb,99"]
    venv = tmp_path / "venv"
    target = tmp_path / "target"
    for root, extra in ((venv, ["../../../bin/fakecc,sha256=scriptvenv,50",
                                "fakecc/__pycache__/__init__.cpython-311.pyc,,",
                                "fakecc-1.0.dist-info/INSTALLER,sha256=pip,4",
                                "fakecc-1.0.dist-info/RECORD,,"]),
                        (target, ["bin/fakecc,sha256=scripttarget,50",
                                  "fakecc-1.0.dist-info/INSTALLER,sha256=uv,3",
                                  "fakecc-1.0.dist-info/direct_url.json,sha256=x,9"])):
        info = root / "fakecc-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakecc\nVersion: 1.0\n")
        (info / "RECORD").write_text("\n".join(extra[:1] + files + extra[1:]) + "\n")
    with monkeypatch.context() as m:
        m.syspath_prepend(str(venv))
        a = _dist("fakecc")
    with monkeypatch.context() as m:
        m.syspath_prepend(str(target))
        b = _dist("fakecc")
    assert a == b != "none"
