"""Packaging facts: what pyproject.toml declares, and how scripts/install.sh picks torch.

pyyaml belongs to the ``weights`` extra only (the model repository reads and writes YAML), so the
core install and every command module import without it. ``license = "Apache-2.0"`` is a PEP 639
SPDX expression, which setuptools understands from 77 on: the build requirement must not admit an
older one (76 fails the build on it). install.sh installs the CPU build of torch unless
``TORCH_VARIANT=cuda`` asks for a CUDA one; its torch step is run here against stubs (no apt, no
pip, nothing downloaded) and the pip calls it makes are checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]
INSTALL_SH = ROOT / "scripts" / "install.sh"
BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None,
                                reason="bash is not installed: install.sh cannot be run")


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


# --- pyproject.toml -----------------------------------------------------------------------------

def test_pyyaml_is_in_the_weights_extra_only() -> None:
    project = _pyproject()["project"]
    assert "pyyaml" not in _names(project["dependencies"]), "pyyaml is for the weights extra"
    extras = project["optional-dependencies"]
    assert "pyyaml" in _names(extras["weights"])
    assert "types-pyyaml" in _names(extras["test"])


def test_the_cli_and_its_commands_import_without_yaml() -> None:
    # what a core install (no extras) runs: yaml made unimportable, every command module loads
    code = textwrap.dedent("""
        import importlib, sys
        sys.modules["yaml"] = None  # "import yaml" now raises ImportError
        import coldstart.cli as cli
        for module, _ in cli._COMMANDS.values():
            importlib.import_module(module)
        try:
            cli.main(["--help"])
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_setuptools_requirement_matches_the_license_field() -> None:
    data = _pyproject()
    license_ = data["project"].get("license")
    reqs = {canonicalize_name(r.name): r
            for r in map(Requirement, data["build-system"]["requires"])}
    setuptools = reqs["setuptools"]
    if isinstance(license_, str):  # PEP 639 SPDX expression: setuptools >= 77
        from packaging.licenses import canonicalize_license_expression

        assert canonicalize_license_expression(license_) == license_
        too_old = [v for v in ("61.0", "68.0", "75.9.1", "76.1.0", "76.999")
                   if setuptools.specifier.contains(v, prereleases=True)]
        assert not too_old, f"{setuptools} admits setuptools {too_old}, which reject {license_!r}"
    assert setuptools.specifier.contains("84.0"), f"{setuptools} admits no current setuptools"


# --- scripts/install.sh -------------------------------------------------------------------------

# A stand-in for .venv/bin/python: answers install.sh's "which torch is installed" question from
# $STUB/torch (absent: none), records each "-m pip ..." call in $STUB/calls, and, when pip installs
# a torch, records what it would then be. Stand-ins for apt and dpkg too: nothing real runs.
_PY_STUB = r"""#!/usr/bin/env bash
if [ "${1:-}" = - ]; then cat >/dev/null; cat "$STUB/torch" 2>/dev/null || echo none; exit 0; fi
if [ "${1:-}" = -m ] && [ "${2:-}" = pip ]; then
  shift 2; echo "pip $*" >>"$STUB/calls"
  for a in "$@"; do
    case "$a" in
      torch==*,*) v=${a#torch==}; echo "${v%%,*} cuda" >"$STUB/torch" ;;
      torch==*) echo "${a#torch==} cpu" >"$STUB/torch" ;;
    esac
  done
  exit 0
fi
exit 0
"""
_DPKG_STUB = "#!/usr/bin/env bash\nprintf 'install ok installed'\n"
_APT_STUB = "#!/usr/bin/env bash\necho \"apt-get $*\" >>\"$STUB/calls\"\nexit 1\n"


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """A copy of install.sh in an empty tree whose .venv, apt and dpkg are stubs."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(INSTALL_SH, tmp_path / "scripts" / "install.sh")
    stubs = {tmp_path / "scripts" / "install-criu.sh": "#!/usr/bin/env bash\nexit 0\n",
             tmp_path / ".venv" / "bin" / "python": _PY_STUB,
             tmp_path / "bin" / "dpkg-query": _DPKG_STUB,
             tmp_path / "bin" / "apt-get": _APT_STUB,
             tmp_path / "bin" / "python3": _APT_STUB.replace("apt-get", "python3")}
    for path, text in stubs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    (tmp_path / "stub").mkdir()
    return tmp_path


def _run(sandbox: Path, *args: str, torch: str | None = None,
         **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    if torch is not None:
        (sandbox / "stub" / "torch").write_text(torch + "\n")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")}
    full_env.update(PATH=f"{sandbox / 'bin'}:{full_env.get('PATH', '/usr/bin:/bin')}",
                    STUB=str(sandbox / "stub"), PYTHON=str(sandbox / "bin" / "python3"), **env)
    assert BASH is not None
    out = subprocess.run([BASH, str(sandbox / "scripts" / "install.sh"), *args],
                         capture_output=True, text=True, timeout=60, env=full_env,
                         stdin=subprocess.DEVNULL)
    calls_file = sandbox / "stub" / "calls"
    calls = calls_file.read_text().splitlines() if calls_file.exists() else []
    return out, calls


def _torch_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("pip install torch==")]


@needs_bash
def test_help_lists_the_torch_switch_and_installs_nothing(sandbox: Path) -> None:
    out, calls = _run(sandbox, "--help")
    assert out.returncode == 0, out.stderr
    for word in ("TORCH_VARIANT", "cpu", "cuda", "TORCH_VERSION", "TORCH_INDEX"):
        assert word in out.stdout
    assert calls == []


@needs_bash
@pytest.mark.parametrize(("args", "env"), [(("--bogus",), {}), ((), {"TORCH_VARIANT": "gpu"})])
def test_bad_arguments_are_refused_before_anything_runs(
        sandbox: Path, args: tuple[str, ...], env: dict[str, str]) -> None:
    out, calls = _run(sandbox, *args, **env)
    assert out.returncode == 2
    assert calls == []


@needs_bash
def test_default_is_the_cpu_build_pinned_by_its_label(sandbox: Path) -> None:
    out, calls = _run(sandbox)
    assert out.returncode == 0, out.stderr
    # +cpu: no CUDA build can satisfy it, so pip never fetches one for the tests
    assert _torch_installs(calls) == ["pip install torch==2.13.0+cpu"]
    assert "TORCH_VARIANT=cpu" in out.stderr
    assert not any(c.startswith("apt-get") for c in calls)


@needs_bash
def test_cuda_variant_excludes_the_cpu_build(sandbox: Path) -> None:
    out, calls = _run(sandbox, TORCH_VARIANT="cuda", TORCH_VERSION="2.14.1")
    assert out.returncode == 0, out.stderr
    assert _torch_installs(calls) == ["pip install torch==2.14.1,!=2.14.1+cpu"]


@needs_bash
def test_torch_index_is_passed_to_pip(sandbox: Path) -> None:
    index = "https://example.invalid/whl/cpu"
    out, calls = _run(sandbox, TORCH_INDEX=index)
    assert out.returncode == 0, out.stderr
    assert _torch_installs(calls) == [f"pip install torch==2.13.0+cpu --extra-index-url {index}"]


@needs_bash
@pytest.mark.parametrize("installed", ["2.13.0+cpu cpu", "2.13.0 cpu"])
def test_the_asked_torch_is_kept(sandbox: Path, installed: str) -> None:
    out, calls = _run(sandbox, torch=installed)
    assert out.returncode == 0, out.stderr
    assert _torch_installs(calls) == []
    assert "kept" in out.stderr


@needs_bash
@pytest.mark.parametrize(("installed", "env"), [
    ("2.13.0 cuda", {}),                                   # a CUDA build, the CPU one asked for
    ("2.14.1+cpu cpu", {}),                                # another version
    ("2.13.0+cpu cpu", {"TORCH_VARIANT": "cuda"}),         # the CPU build on a GPU node
])
def test_another_torch_is_named_and_replaced(
        sandbox: Path, installed: str, env: dict[str, str]) -> None:
    out, calls = _run(sandbox, torch=installed, **env)
    assert out.returncode == 0, out.stderr
    assert "replacing it" in out.stderr
    assert installed.split()[0] in out.stderr
    assert len(_torch_installs(calls)) == 1
