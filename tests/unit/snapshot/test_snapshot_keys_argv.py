"""The snapshot key (what makes two starts the same), runc's command line as the wrapper reads
it, the after-restore signal and hook, and the node's counters."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from coldstart.config import from_dict
from coldstart.errors import FormatError, InvalidArgument
from coldstart.snapshot import after_restore, restores
from coldstart.snapshot.invocation import parse_argv, real_runc
from coldstart.snapshot.keys import SnapshotKey, compute_key, differences, process_digest
from coldstart.snapshot.signals import signal_number as after_restore_signal
from coldstart.snapshot.state import NodeState


def _spec(**process: object) -> dict[str, object]:
    proc: dict[str, object] = {"args": ["python3", "serve.py"], "cwd": "/app",
                               "env": ["PATH=/bin", "MODEL=a"], "user": {"uid": 0, "gid": 0}}
    proc.update(process)
    return {"process": proc}


def test_the_process_digest_ignores_what_a_node_or_pod_sets_on_its_own() -> None:
    base = process_digest(_spec())
    pod = process_digest(_spec(env=["PATH=/bin", "MODEL=a", "HOSTNAME=pod-7",
                                    "KUBERNETES_SERVICE_HOST=10.0.0.1",
                                    "REDIS_SERVICE_PORT=6379", "REDIS_PORT_6379_TCP=tcp://x"]))
    assert pod == base
    assert process_digest(_spec(env=["MODEL=a", "PATH=/bin"])) == base     # order
    for other in (_spec(env=["PATH=/bin", "MODEL=b"]), _spec(args=["python3", "other.py"]),
                  _spec(cwd="/"), _spec(user={"uid": 1000, "gid": 0}), _spec(terminal=True)):
        assert process_digest(other) != base


def test_a_spec_without_a_process_is_refused() -> None:
    with pytest.raises(FormatError):
        process_digest({})
    with pytest.raises(FormatError):
        process_digest({"process": {"env": "PATH=/bin"}})


def test_keys_round_trip_and_say_how_they_differ() -> None:
    comps = {"isa": "x86_64:avx2 avx512f sse4_2", "kernel": "6.18.1", "criu": "4.1.1",
             "gpu": "none", "driver": "none"}
    a = compute_key("sha256:" + "a" * 64, _spec(), "4.1.1", overrides=comps)
    assert SnapshotKey.parse(a.canonical()) == a
    b = compute_key("sha256:" + "a" * 64, _spec(env=["MODEL=b"]), "4.1.1",
                    overrides={**comps, "isa": "x86_64:avx2 sse4_2", "kernel": "6.19.0"})
    said = "; ".join(differences(b, a))
    assert "this CPU lacks avx512f" in said and "process:" in said and "kernel:" in said
    assert a.digest != b.digest
    with pytest.raises(FormatError):
        SnapshotKey.parse(b'{"version": 9, "components": {}}')
    with pytest.raises(FormatError):
        SnapshotKey({**a.components, "extra": "x"})


def test_the_shims_create_line_is_read_as_runc_reads_it() -> None:
    inv = parse_argv(["--root", "/run/containerd/runc/k8s.io", "--log", "/b/log.json",
                      "--log-format", "json", "create", "--bundle", "/b", "--pid-file",
                      "/b/init.pid", "--no-pivot", "ctr-1"])
    assert inv.command == "create" and inv.cid == "ctr-1"
    assert inv.flags["--bundle"] == "/b" and inv.flags["--pid-file"] == "/b/init.pid"
    assert inv.flags["--no-pivot"] is True
    assert inv.global_value("--root") == "/run/containerd/runc/k8s.io"
    assert inv.global_value("--log") == "/b/log.json"
    eq = parse_argv(["--root=/r", "delete", "--force", "c"])
    assert eq.command == "delete" and eq.cid == "c" and "--force" in eq.flags
    assert eq.global_value("--root") == "/r"
    assert parse_argv(["--version"]).command == ""
    assert parse_argv(["state", "c"]).args == ["c"]


def test_the_real_runc_is_never_the_wrapper_itself(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    me = tmp_path / "bin" / "coldstart-runc"
    me.parent.mkdir()
    me.write_text("#!/bin/sh\n")
    me.chmod(0o755)
    (tmp_path / "bin" / "runc").symlink_to(me)        # runc on PATH is the wrapper
    real = tmp_path / "real" / "runc"
    real.parent.mkdir()
    real.write_text("#!/bin/sh\n")
    real.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{tmp_path / 'real'}")
    monkeypatch.setattr("sys.argv", [str(tmp_path / "bin" / "runc")])
    assert real_runc("") == str(real)
    assert real_runc("/opt/runc") == "/opt/runc"


def test_after_restore_signals_parse() -> None:
    assert after_restore_signal("SIGUSR2") == signal.SIGUSR2
    assert after_restore_signal("usr2") == signal.SIGUSR2
    assert after_restore_signal("SIGRTMIN+6") == signal.SIGRTMIN + 6
    assert after_restore_signal("40") == 40
    assert after_restore_signal("") is None


def test_the_hook_runs_once_per_restore_signal() -> None:
    calls: list[int] = []
    old = signal.getsignal(signal.SIGRTMIN + 6)
    try:
        @after_restore
        def hook() -> None:
            calls.append(1)

        before = restores()
        os.kill(os.getpid(), signal.SIGRTMIN + 6)
        assert calls == [1] and restores() == before + 1
    finally:
        signal.signal(signal.SIGRTMIN + 6, old)


def test_node_state_counts_and_starts_a_restored_container_once(tmp_path: Path) -> None:
    st = NodeState(tmp_path / "state")
    st.ensure()
    st.record({"outcome": "restored", "container": "a"})
    st.record({"outcome": "fallback", "kind": "integrity", "container": "b"})
    st.record({"outcome": "fallback", "kind": "integrity", "container": "c"})
    assert st.counters() == {"restored": 1, "fallbacks": {"integrity": 2}}
    assert [e["container"] for e in st.events()] == ["a", "b", "c"]
    assert not st.take_start("/run/runc", "a")         # never restored: runc starts it
    st.mark_restored("/run/runc", "a", {"snapshot": "sha256:x"})
    assert st.take_start("/run/runc", "a") and not st.take_start("/run/runc", "a")
    assert not st.take_start("/other/root", "a")       # another runc root, another container
    st.work("/run/runc", "a").mkdir(parents=True)
    st.forget("/run/runc", "a")
    assert not st.container("/run/runc", "a").exists()
    assert not st.work("/run/runc", "a").exists()


def test_the_snapshot_table_of_the_config() -> None:
    from coldstart.config import Config

    cfg = from_dict(Config, {"root": "/var/lib/cs", "snapshot": {"timeout": 30,
                                                                  "chunk_max_bytes": "2G"}})
    assert cfg.snapshot.timeout == 30.0 and cfg.snapshot.chunk_max_bytes == 2 << 30
    assert cfg.snapshot_chunk_dir == "/var/lib/cs/snapshots"
    with pytest.raises(InvalidArgument):
        from_dict(Config, {"snapshot": {"timeout": 0}})
    with pytest.raises(InvalidArgument):
        from_dict(Config, {"snapshot": {"restore": True}})


def test_a_restored_process_may_not_do_more_than_the_spec_lets_it() -> None:
    """CRIU restores the dumped credentials and capabilities, not the new spec's: a process
    whose masks exceed the spec's (a forged snapshot key) is caught."""
    import subprocess

    from coldstart.snapshot.restore import CAPABILITIES, check_privileges

    child = subprocess.Popen(["sleep", "30"])
    try:
        with open(f"/proc/{child.pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        uid = int(fields["Uid"].split()[0])
        gid = int(fields["Gid"].split()[0])
        have = int(fields["CapEff"].strip(), 16)
        names = [f"CAP_{c}" for i, c in enumerate(CAPABILITIES) if have >> i & 1]
        caps = {"effective": names, "permitted": names, "bounding": names}
        spec = {"process": {"user": {"uid": uid, "gid": gid}, "capabilities": caps}}
        assert check_privileges(child.pid, spec) == ""
        wrong_user = {"process": {"user": {"uid": uid + 1, "gid": gid}, "capabilities": caps}}
        assert "runs as uid" in check_privileges(child.pid, wrong_user)
        if names:       # as root: a spec with fewer capabilities than the process has
            fewer = {k: v[1:] for k, v in caps.items()}
            spec = {"process": {"user": {"uid": uid, "gid": gid}, "capabilities": fewer}}
            assert names[0] in check_privileges(child.pid, spec)
        nnp = {"process": {"user": {"uid": uid, "gid": gid}, "capabilities": caps,
                           "noNewPrivileges": True}}
        assert "no_new_privs" in check_privileges(child.pid, nnp)
    finally:
        child.kill()
        child.wait()


def test_the_key_holds_what_the_process_may_do() -> None:
    base = process_digest(_spec())
    assert process_digest(_spec(capabilities={"bounding": ["CAP_SYS_ADMIN"]})) != base
    assert process_digest(_spec(noNewPrivileges=True)) != base
    seccomp = {**_spec(), "linux": {"seccomp": {"defaultAction": "SCMP_ACT_ERRNO"}}}
    assert process_digest(seccomp) != base
    # an app's own port stays in the key; a service link's does not
    assert process_digest(_spec(env=["PATH=/bin", "MODEL=a", "APP_PORT=9090"])) != base
    assert process_digest(_spec(env=["PATH=/bin", "MODEL=a",
                                     "DB_PORT=tcp://10.0.0.9:5432"])) == base
