"""The import rules of the package, in one table (CONVENTIONS §1, §2).

``RULES`` places every area of ``coldstart/`` (a subpackage, or a top-level module such as
``errors.py`` or ``cli.py``) and says what it may import: which coldstart areas (or, where a
whole area would be too much, which of its modules: ``lazyfs.spec``), and which third-party
packages beyond the standard library (``LIBS``: a package only some modules of the area may
import is written ``"pyfuse3@lazyfs.fusefs"``). An area missing from the table fails, so a new
package must be placed in it. The layering the table encodes, lowest first::

    errors -> config -> format -> remote -> oci -> cache -> unpack -> lazyfs -> snapshotter
           -> containerd -> benchmark / stack -> commands / cli  (weights, probe stand beside: §2)

Independently of the table, the graph built from the imports actually written must have no
cycle: neither between areas nor between two modules of one area (``oci.registry`` importing
``oci.uploads`` importing ``oci.registry``: one of them wants a lower module both use, or to be
handed what it needs). Every ``import`` counts: at module level, inside functions, under
``TYPE_CHECKING``. Walks the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[3] / "coldstart"
ANY = frozenset({"*"})


@dataclass(frozen=True)
class Rule:
    imports: frozenset[str]             # areas or modules ("lazyfs.spec") it may import
    libs: frozenset[str] = frozenset()  # third-party packages; "pkg@area.module" for some only
    checked: bool = True                # False: generated code (``_proto``)


def rule(imports: str = "", libs: str = "", *, checked: bool = True) -> Rule:
    return Rule(frozenset(imports.split()), frozenset(libs.split()), checked)


_BELOW_BENCH = ("errors config format remote oci cache prefetch unpack lazyfs snapshotter "
                "containerd weights probe unixsock progress _proto")
RULES: dict[str, Rule] = {
    "__init__": rule(),
    "errors": rule(),
    # the byte-progress protocol long operations report to (the CLI draws it)
    "progress": rule(),
    # atomic file writes (a config, a credential): never half a file; private state directories
    "files": rule("errors"),
    "config": rule("errors"),
    "unixsock": rule(),
    # msgspec: the TOC's JSON decode only (pure decoding, no I/O; twice json's speed)
    # isal: ISA-L's inflate of a gzip index's spans
    "format": rule("errors", "zstandard msgspec@format.tocjson isal@format.gzindex"),
    "remote": rule("errors config format", "httpx boto3 botocore"),
    "oci": rule("errors config format remote prefetch progress files",
                "httpx zstandard indexed_gzip@oci.gzindex"),
    "cache": rule("errors config format files"),
    "prefetch": rule("errors config format"),
    "unpack": rule("errors config format oci files", "isal rapidgzip zstandard"),
    "lazyfs": rule("errors config format remote oci cache prefetch unixsock files unpack",
                   "trio prometheus_client"),
    # lazyfs.mountsys: the mount table (which connection a lazily mounted layer is bound from)
    # snapshot.state: the node's restore counters, for the metrics
    "snapshotter": rule("errors config files lazyfs.spec lazyfs.client lazyfs.control "
                        "lazyfs.mountsys unixsock _proto snapshot.state",
                        "grpc google prometheus_client"),
    "containerd": rule("errors config format oci remote lazyfs.spec progress _proto",
                       "grpc google"),
    # lazyfs.filewire, lazyfs.control: the files socket's protocol (a loader in a container
    # reads lazily mounted files through the node), pure, no trio
    "weights": rule("errors config format.readat remote oci progress lazyfs.filewire "
                    "lazyfs.control", "torch numpy yaml"),
    "probe": rule("errors config", "redis grpc httpx@probe.sinks"),
    # `coldstart node`: containerd's config.toml (tomlkit), the unit, the FUSE server's health
    # the CRI proxy in front of containerd: keeps kubelet's pull credentials (oci.keychain)
    # containerd._errors: the one gRPC status -> ColdstartError mapping
    "cri": rule("errors config oci containerd._errors _proto unixsock", "grpc google"),
    "node": rule("errors config files lazyfs.client", "tomlkit"),
    # bcrypt: htpasswd files for the password-protected test registry
    "stack": rule(_BELOW_BENCH, "bcrypt@stack.registry"),
    # httpx@benchmark.ready: the `--ready http://...` condition's GET of the benchmarked app
    # (a probe of the app, as probe.sinks' POST is a report; blobs go through remote and oci)
    # warm-up caches: packed like layers (format), fetched like them (oci, remote, cache);
    # probe.notify: the relay adds the verdict to the app's READY=1
    "warmup": rule("errors config format remote oci cache probe.notify", "torch@warmup"),
    # snapshots: packed and fetched like warm-up artifacts (warmup.artifacts, warmup.keys'
    # CPU and GPU readings); containerd: the container's rootfs mounts, for its changes;
    # lazyfs.client, lazyfs.spec: a lazy restore mounts its bundle through the FUSE server
    "snapshot": rule("errors config format remote oci cache containerd warmup.artifacts "
                     "warmup.keys lazyfs.client lazyfs.spec"),
    "benchmark": rule(_BELOW_BENCH + " stack warmup snapshot",
                      "httpx@benchmark.ready matplotlib@benchmark.results "
                      "numpy@benchmark.imagecontent torch@benchmark.server_app "
                      "torch@benchmark.compile_app "
                      "safetensors@benchmark.server_app"),
    "cli": rule("*", "click"),
    "commands": rule("*", "click rich@commands.bench rich@commands._progress "
                          "torch@commands.weights "
                          "torch@commands.models"),
    "_proto": rule(checked=False),
}


# -- reading the source ------------------------------------------------------------------------

def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _dotted(path: Path) -> str:
    """``coldstart/lazyfs/spec.py`` -> ``lazyfs.spec``; a package's ``__init__`` -> its name."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "__init__"


def _area(module: str) -> str:
    return module.split(".")[0]


@cache
def _known() -> frozenset[str]:
    return frozenset(_dotted(p) for p in _modules())


def _internal(name: str) -> str:
    """An absolute ``coldstart.x.y`` name -> the module it loads (``x.y``), or ``__init__``."""
    rest = name.split(".", 1)[1] if "." in name else ""
    return rest or "__init__"


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (or in ``source``, read as if
    it were that file's); ``from a import b`` names ``a.b`` when that is a coldstart module."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    here = ["coldstart", *path.relative_to(PKG).parts[:-1]]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: against this module's package
                base = here[: len(here) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.split(".")[0] != "coldstart":
                out.append((node.lineno, module))
                continue
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.append((node.lineno, sub if _internal(sub) in _known() else module))
    return out


def _lib_allowed(rule_: Rule, module: str, top: str) -> bool:
    for entry in rule_.libs:
        lib, _, only = entry.partition("@")
        if lib == top and (not only or module == only or module.startswith(only + ".")):
            return True
    return False


def _target_allowed(rule_: Rule, target: str) -> bool:
    if rule_.imports == ANY:
        return True
    return any(target == e or target.startswith(e + ".") for e in rule_.imports)


def violations(path: Path, source: str | None = None) -> list[str]:
    """What ``path`` (or ``source`` in its place) imports that its area's rule does not allow
    (empty when it keeps them)."""
    module = _dotted(path)
    area = _area(module)
    rel = path.relative_to(PKG)
    if area not in RULES:
        return [f"{rel}: area {area!r} is not in RULES (place it in the layering)"]
    rule_ = RULES[area]
    if not rule_.checked:
        return []
    bad: list[str] = []
    for line, name in imports(path, source):
        top = name.split(".")[0]
        if top == "coldstart":
            target = _internal(name)
            if _area(target) != area and not _target_allowed(rule_, target):
                bad.append(f"{rel}:{line} imports coldstart.{target}: {area} may not")
        elif top not in sys.stdlib_module_names and top != "__future__" \
                and not _lib_allowed(rule_, module, top):
            bad.append(f"{rel}:{line} imports {name}: {module} may not")
    return bad


def area_graph() -> dict[str, set[str]]:
    """Area -> the other areas its modules import (as written, whatever the table says)."""
    graph: dict[str, set[str]] = {}
    for path in _modules():
        area = _area(_dotted(path))
        edges = graph.setdefault(area, set())
        for _, name in imports(path):
            if name.split(".")[0] == "coldstart":
                target = _area(_internal(name))
                if target not in (area, "__init__"):
                    edges.add(target)
    return graph


def module_graph(sources: Mapping[Path, str] | None = None) -> dict[str, set[str]]:
    """Module -> the other coldstart modules it imports (a package's ``__init__`` is the
    package's name). ``sources``: the modules to read, with the text to read in place of each
    file (a test's own); else every module of the package, from its file."""
    graph: dict[str, set[str]] = {}
    for path in (sources if sources is not None else _modules()):
        module = _dotted(path)
        edges = graph.setdefault(module, set())
        text = sources[path] if sources is not None else None
        for _, name in imports(path, text):
            if name.split(".")[0] == "coldstart" and (target := _internal(name)) != module:
                edges.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a path (first node repeated at the end), or [] when acyclic."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


# -- the tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_module_imports_only_what_its_area_may(path: Path) -> None:
    bad = violations(path)
    assert not bad, "\n".join(bad)


def test_areas_import_each_other_without_cycles() -> None:
    cycle = find_cycle(area_graph())
    assert cycle == [], "import cycle between areas: " + " -> ".join(cycle)


def test_modules_import_each_other_without_cycles() -> None:
    cycle = find_cycle(module_graph())
    assert cycle == [], "import cycle between modules: " + " -> ".join(cycle)


def test_every_rule_names_a_real_area() -> None:
    # a stale or misspelt entry would silently allow nothing or everything
    areas = {_area(_dotted(p)) for p in _modules()}
    assert set(RULES) <= areas, set(RULES) - areas
    for name, r in RULES.items():
        for target in r.imports - ANY:
            assert _area(target) in RULES, f"{name} may import unknown {target}"


def test_the_walk_sees_the_package_and_resolves_names(tmp_path: Path) -> None:
    # guards the tests above against silently walking nothing or misreading imports
    assert len(_modules()) >= 50
    assert (PKG / "cli.py").exists() and _dotted(PKG / "lazyfs" / "__init__.py") == "lazyfs"
    assert any(n == "coldstart.errors" for _, n in imports(PKG / "cli.py"))
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
    r = RULES["snapshotter"]
    assert _target_allowed(r, "lazyfs.spec") and not _target_allowed(r, "lazyfs.server")
    assert not _target_allowed(r, "lazyfs")   # the package itself is not its spec module
    assert _lib_allowed(RULES["commands"], "commands.weights", "torch")
    assert not _lib_allowed(RULES["commands"], "commands.pull", "torch")


def test_the_rules_fail_a_forbidden_import() -> None:
    # each check fails on a module that breaks it (synthetic source read as a real file's)
    runner, ready = PKG / "benchmark" / "runner.py", PKG / "benchmark" / "ready.py"
    assert violations(ready, "import httpx\n") == []
    assert violations(runner, "import httpx\n") == [
        "benchmark/runner.py:1 imports httpx: benchmark.runner may not"]
    assert violations(runner, "def f():\n    from coldstart.cli import main\n") == [
        "benchmark/runner.py:2 imports coldstart.cli: benchmark may not"]
    assert violations(PKG / "snapshotter" / "service.py",
                      "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from coldstart.lazyfs import reader\n") == [
        "snapshotter/service.py:3 imports coldstart.lazyfs.reader: snapshotter may not"]
    # a cycle of two modules of one area, one import of it only for typing
    toc, columns = PKG / "format" / "toc.py", PKG / "format" / "toccolumns.py"
    graph = module_graph({
        toc: "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
             "    from coldstart.format.toccolumns import TOCColumns\n",
        columns: "from coldstart.format import toc\n"})
    assert graph == {"format.toc": {"format.toccolumns"}, "format.toccolumns": {"format.toc"}}
    assert find_cycle(graph) == ["format.toc", "format.toccolumns", "format.toc"]
    # and the real graph is read: the registry client wires its transport
    assert "oci.transport" in module_graph()["oci.registry"]
