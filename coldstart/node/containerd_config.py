"""containerd's ``config.toml``: the keys that make containerd use coldstart, put in and taken out
with tomlkit, so that comments, layout and every other setting stay as they are.

What :func:`apply` sets (``S`` is the snapshotter's gRPC socket, ``R`` its root)::

    # both schemas
    [proxy_plugins.coldstart]          type = "snapshot", address = S
    [proxy_plugins.coldstart.exports]  root = "R/"
    # schema 2 (containerd 1.6, 1.7)
    [plugins."io.containerd.grpc.v1.cri".containerd]
        snapshotter = "coldstart", disable_snapshot_annotations = false
    # schema 3 (containerd 2.x: the CRI image service has its own plugin)
    [plugins."io.containerd.cri.v1.images"]
        snapshotter = "coldstart", disable_snapshot_annotations = false

``disable_snapshot_annotations = false`` makes the CRI plugin pass the layer annotations a
remote snapshotter needs; on containerd 2.1+ it also keeps CRI on its own pull (the transfer
service it uses otherwise does not hand remote snapshotters those labels). With a runtime handler
only pods of that RuntimeClass use coldstart: the default snapshotter stays, and
``[...containerd.runtimes.NAME] snapshotter = "coldstart"`` is set (under
``io.containerd.grpc.v1.cri`` in schema 2, ``io.containerd.cri.v1.runtime`` in schema 3), with
``runtime_type = "io.containerd.runc.v2"`` when the runtime had none. A config without ``version``
is schema 1 (containerd before 1.3) and is refused.

Every key changed is an :class:`Edit` (what it held before), every table made is recorded, so
:func:`revert` takes out exactly that from a file the operator edited since.

Example::

    change = apply(text, Target(socket="/run/coldstart/snapshotter.sock",
                                root="/var/lib/coldstart"))
    text2, notes = revert(change.text, change.edits, change.created)   # == text
"""

from __future__ import annotations

import contextlib
import json
import re
import tomllib
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, cast

import tomlkit
import tomlkit.exceptions
from tomlkit.items import Item, Table, Whitespace
from tomlkit.toml_document import TOMLDocument

from coldstart.errors import FailedPrecondition, FormatError, InvalidArgument

__all__ = [
    "SCHEMAS",
    "SNAPSHOTTER",
    "Change",
    "Edit",
    "Setting",
    "Target",
    "apply",
    "dotted",
    "handler_binary",
    "missing",
    "parse",
    "revert",
    "schema_version",
    "settings",
    "tidy",
]

SNAPSHOTTER = "coldstart"
SCHEMAS = (2, 3)
RUNC = "io.containerd.runc.v2"
_CRI_V2 = "io.containerd.grpc.v1.cri"
_IMAGES_V3 = "io.containerd.cri.v1.images"
_RUNTIME_V3 = "io.containerd.cri.v1.runtime"

Scalar = str | bool | int | float | list[str]
TablePath = tuple[str, ...]
#: the OCI annotation a pod sets to be restored from its image's snapshot (coldstart-runc)
SNAPSHOT_ANNOTATION = "dev.coldstart.snapshot"


@dataclass(frozen=True)
class Target:
    """What containerd should reach: the snapshotter's socket and root, and optionally the one
    runtime handler (RuntimeClass) that uses coldstart instead of every pod."""

    socket: str
    root: str
    runtime_handler: str | None = None
    # coldstart-runc's path: that handler's runc is the wrapper, which restores the pods that
    # ask for it (the annotation, passed through to their containers) from snapshots
    restore_binary: str | None = None


@dataclass(frozen=True)
class Setting:
    """``table.key = value``; ``if_absent``: only when the key is not there yet."""

    table: TablePath
    key: str
    value: Scalar
    if_absent: bool = False

    def __str__(self) -> str:
        return f"{dotted((*self.table, self.key))} = {_toml(self.value)}"


@dataclass(frozen=True)
class Edit:
    """One key install set to ``value``; it held ``old`` before (nothing when ``absent``)."""

    table: TablePath
    key: str
    value: Scalar
    absent: bool
    old: Any = None          # the value before, as JSON (for people reading the state file)
    old_toml: str = ""       # ... as it was written (quotes, comment), for putting it back

    def to_json(self) -> dict[str, Any]:
        return {"table": list(self.table), "key": self.key, "value": self.value,
                "absent": self.absent, "old": self.old, "old_toml": self.old_toml}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Edit:
        return cls(tuple(doc["table"]), doc["key"], doc["value"], bool(doc["absent"]),
                   doc.get("old"), str(doc.get("old_toml", "")))

    def old_item(self) -> Any:
        """The value before, with its quotes and comment where they were recorded."""
        if self.old_toml:
            with contextlib.suppress(tomlkit.exceptions.ParseError, KeyError):
                return tomlkit.parse(f"x = {self.old_toml}\n").item("x")
        return self.old


@dataclass(frozen=True)
class Change:
    """The edited text, its schema, the keys changed and the tables created (outermost
    first)."""

    text: str
    schema: int
    edits: tuple[Edit, ...]
    created: tuple[TablePath, ...]


def dotted(path: Iterable[str]) -> str:
    """``("plugins", "io.containerd.grpc.v1.cri")`` -> ``plugins."io.containerd.grpc.v1.cri"``."""
    return ".".join(p if p.replace("_", "").replace("-", "").isalnum() else f'"{p}"'
                    for p in path)


def _toml(value: Scalar) -> str:
    return tomlkit.item(value).as_string()


def parse(text: str, where: str) -> TOMLDocument:
    """``text`` as a tomlkit document; bad TOML is a :class:`FormatError` naming ``where``."""
    try:
        return tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise FormatError(f"{where}: not valid TOML: {exc} (fix it, then run again)") from None


def schema_version(doc: MutableMapping[str, Any], where: str) -> int:
    """containerd's config schema of ``doc``: 2 or 3; schema 1 (no ``version``) is refused."""
    version = doc.get("version")
    if version is None:
        raise FailedPrecondition(
            f"{where} has no `version` key: containerd reads it as schema 1 (containerd before "
            "1.3), which coldstart does not edit; add `version = 2` (containerd 1.x) or "
            "`version = 3` (containerd 2.x, `containerd config migrate` converts a file) at the "
            "top, then run again")
    if isinstance(version, bool) or version not in SCHEMAS:
        raise InvalidArgument(f"{where}: config version {version} is not one coldstart knows "
                              "(2: containerd 1.6/1.7, 3: containerd 2.x)")
    return int(version)


def handler_binary(text: str, handler: str, where: str = "containerd config") -> str:
    """The ``BinaryName`` runtime handler ``handler`` has in ``text`` ("" for none)."""
    doc = parse(text, where)
    runtimes = (("plugins", _CRI_V2, "containerd", "runtimes")
                if schema_version(doc, where) == 2
                else ("plugins", _RUNTIME_V3, "containerd", "runtimes"))
    cur: Any = doc
    for name in (*runtimes, handler, "options"):
        cur = cur.get(name) if isinstance(cur, MutableMapping) else None
    value = _plain(cur.get("BinaryName")) if isinstance(cur, MutableMapping) else None
    return value if isinstance(value, str) else ""


def _default_name(doc: MutableMapping[str, Any] | None, runtimes: TablePath) -> str:
    """The CRI's ``default_runtime_name`` (``runc`` when unset)."""
    cri: Any = doc
    for name in runtimes[:-1]:
        cri = cri.get(name) if isinstance(cri, MutableMapping) else None
    return str(cri.get("default_runtime_name", "runc")) if isinstance(cri, MutableMapping) \
        else "runc"


def _default_runtime(doc: MutableMapping[str, Any] | None,
                     runtimes: TablePath) -> tuple[str, dict[str, Scalar]]:
    """The runtime_type and scalar options of the config's default runtime (``runc`` unless
    ``default_runtime_name`` says otherwise, e.g. ``nvidia`` on GPU Operator nodes)."""
    if doc is None:
        return RUNC, {}
    cri: Any = doc
    for name in runtimes[:-1]:
        cri = cri.get(name) if isinstance(cri, MutableMapping) else None
    if not isinstance(cri, MutableMapping):
        return RUNC, {}
    name = str(cri.get("default_runtime_name", "runc"))
    table = (cri.get("runtimes") or {}).get(name)
    if not isinstance(table, MutableMapping):
        return RUNC, {}
    options = table.get("options")
    scalars = {str(k): _plain(v) for k, v in (options or {}).items()
               if isinstance(_plain(v), bool | int | float | str)}
    return str(table.get("runtime_type", RUNC)), scalars


def settings(schema: int, target: Target,
             doc: MutableMapping[str, Any] | None = None) -> list[Setting]:
    """The keys :func:`apply` sets for ``target`` in a schema-``schema`` config ``doc``.

    A runtime handler that is new gets the default runtime's ``runtime_type`` and options
    (``BinaryName`` of nvidia-container-runtime, ``SystemdCgroup``): the pods that opt in keep
    their GPUs and cgroup driver."""
    proxy = ("proxy_plugins", SNAPSHOTTER)
    out = [Setting(proxy, "type", "snapshot"), Setting(proxy, "address", target.socket),
           Setting((*proxy, "exports"), "root", target.root.rstrip("/") + "/")]
    images = ("plugins", _CRI_V2, "containerd") if schema == 2 else ("plugins", _IMAGES_V3)
    runtimes = (("plugins", _CRI_V2, "containerd", "runtimes") if schema == 2
                else ("plugins", _RUNTIME_V3, "containerd", "runtimes"))
    handler = target.runtime_handler
    if handler is None:
        out.append(Setting(images, "snapshotter", SNAPSHOTTER))
    out.append(Setting(images, "disable_snapshot_annotations", False))
    if handler is not None:
        existing = _default_table(doc, (*runtimes, handler))
        runtime_type, options = (RUNC, {}) if existing else _default_runtime(doc, runtimes)
        default = _default_name(doc, runtimes)
        if default != handler and not _default_table(doc, (*runtimes, default)):
            # containerd fills in its default runtime only while no runtime is configured:
            # the first handler table would leave CRI without it ("no corresponding runtime
            # configured ... default_runtime_name"), so it is written out as containerd had it
            out.append(Setting((*runtimes, default), "runtime_type", RUNC, if_absent=True))
        out += [Setting((*runtimes, handler), "runtime_type", runtime_type, if_absent=True),
                Setting((*runtimes, handler), "snapshotter", SNAPSHOTTER)]
        if target.restore_binary:
            # the wrapper runs the real runc; a runtime binary the default runtime named
            # (nvidia-container-runtime) would be lost without a word: the operator says
            if options.get("BinaryName"):
                raise FailedPrecondition(
                    f"the default runtime runs {options['BinaryName']}: for snapshot restore "
                    f"set `runc = \"{options['BinaryName']}\"` under [snapshot] in coldstart's "
                    f"config and add [{dotted((*runtimes, handler))}] with that runtime's "
                    "options yourself (install then keeps them and sets BinaryName to "
                    "coldstart-runc)")
            out += [Setting((*runtimes, handler, "options"), "BinaryName",
                            target.restore_binary),
                    Setting((*runtimes, handler), "pod_annotations",
                            _with(doc, (*runtimes, handler), "pod_annotations",
                                  SNAPSHOT_ANNOTATION))]
        out += [Setting((*runtimes, handler, "options"), k, v, if_absent=True)
                for k, v in sorted(options.items())]
    return out


def _with(doc: MutableMapping[str, Any] | None, path: TablePath, key: str,
          item: str) -> list[str]:
    """The list ``path.key`` of ``doc`` with ``item`` added (kept in place when there)."""
    cur: Any = doc
    for name in path:
        cur = cur.get(name) if isinstance(cur, MutableMapping) else None
    have = _plain(cur.get(key)) if isinstance(cur, MutableMapping) else None
    values = [str(v) for v in have] if isinstance(have, list) else []
    return values if item in values else [*values, item]


def _default_table(doc: MutableMapping[str, Any] | None, path: TablePath) -> bool:
    """Whether ``path`` is already a table of ``doc`` (the handler exists: leave it as is)."""
    cur: Any = doc
    for name in path:
        if not isinstance(cur, MutableMapping) or name not in cur:
            return False
        cur = cur[name]
    return isinstance(cur, MutableMapping)


# -- finding and making tables ------------------------------------------------------------------

def _table(doc: MutableMapping[str, Any], path: TablePath,
           where: str) -> MutableMapping[str, Any] | None:
    cur: Any = doc
    for i, name in enumerate(path):
        cur = cur.get(name)
        if cur is None:
            return None
        if not isinstance(cur, MutableMapping):
            raise FailedPrecondition(f"{where}: {dotted(path[:i + 1])} is not a table; fix it, "
                                     "then run again")
    return cast(MutableMapping[str, Any], cur)


def _ensure_table(doc: TOMLDocument, path: TablePath, where: str,
                  created: list[TablePath]) -> MutableMapping[str, Any]:
    cur: MutableMapping[str, Any] = doc
    for i in range(len(path)):
        found = _table(doc, path[:i + 1], where)
        if found is None:
            leaf = i == len(path) - 1
            before = _indents(cur)
            cur[path[i]] = tomlkit.table(is_super_table=not leaf)
            for it, old in before:   # tomlkit puts a blank line before the next header
                it.trivia.indent = old
            created.append(path[:i + 1])
            found = _table(doc, path[:i + 1], where)
            assert found is not None
        cur = found
    return cur


def _indents(table: MutableMapping[str, Any]) -> list[tuple[Item, str]]:
    """The indent of each item in ``table``'s body (to put back after tomlkit inserted)."""
    if isinstance(table, Table):
        body = table.value.body
    elif isinstance(table, TOMLDocument):
        body = table.body
    else:
        return []
    return [(it, it.trivia.indent) for _, it in body if not isinstance(it, Whitespace)]


def _key_indent(table: MutableMapping[str, Any]) -> str | None:
    """The indent of the table's own keys (``"    "`` in an indented file), None: unknown."""
    if not isinstance(table, Table):
        return None
    for key, it in table.value.body:
        if key is not None and not isinstance(it, Table | Whitespace):
            return it.trivia.indent
    header = table.trivia.indent.rsplit("\n", 1)[-1]
    return header if table.value.body else None


def _set(table: MutableMapping[str, Any], key: str, value: Any) -> None:
    """``table[key] = value``; a new key is indented like its neighbours, and tomlkit may not
    add blank lines or indent around it (it does both by default)."""
    if key in table:
        table[key] = value
        return
    indent, before = _key_indent(table), _indents(table)
    table[key] = value
    for it, old in before:
        it.trivia.indent = old
    item = table.value.item(key) if isinstance(table, Table) else None
    if indent is not None and isinstance(item, Item):
        item.trivia.indent = indent


def _plain(item: Any) -> Any:
    return item.unwrap() if isinstance(item, Item) else item


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


# -- install, uninstall, check -----------------------------------------------------------------

def apply(text: str, target: Target, where: str = "containerd config") -> Change:
    """Set :func:`settings` in ``text``; keys already right are left alone (no edit)."""
    doc = parse(text, where)
    schema = schema_version(doc, where)
    edits: list[Edit] = []
    created: list[TablePath] = []
    wanted = settings(schema, target, parse(text, where))
    for s in wanted:
        table = _ensure_table(doc, s.table, where, created)
        if s.key in table:
            current = _plain(table[s.key])
            if s.if_absent or _same(current, s.value):
                continue
            raw = table[s.key].as_string() if isinstance(table[s.key], Item) else ""
            edits.append(Edit(s.table, s.key, s.value, absent=False,
                              old=json.loads(json.dumps(current, default=str)), old_toml=raw))
        else:
            edits.append(Edit(s.table, s.key, s.value, absent=True))
        _set(table, s.key, s.value)
    if not edits and not created:
        return Change(text, schema, (), ())
    for path in created:
        _end_with_blank_line(doc, path, where)
    out = tidy(tomlkit.dumps(doc), like=text)
    _check_only_ours(text, out, wanted, where)
    return Change(out, schema, tuple(edits), tuple(created))


def _end_with_blank_line(doc: TOMLDocument, path: TablePath, where: str) -> None:
    """A table we made ends with a blank line, so the next header stands apart (as in
    ``containerd config default``); :func:`tidy` drops the surplus."""
    table = _table(doc, path, where)
    if isinstance(table, Table) and not table.is_super_table() and table.value.body \
            and not isinstance(table.value.body[-1][1], Whitespace):
        table.add(tomlkit.nl())


def tidy(text: str, like: str) -> str:
    """Blank lines as ``like`` has them: no run of more blank lines than ``like`` has anywhere,
    its number of newlines at the end. Only blank lines between our tables and keys change
    (none of our values spans lines, and no run longer than ``like``'s can lie inside one of
    its multi-line strings)."""
    longest = max((len(m) for m in re.findall(r"\n+", like)), default=1)
    most = max(longest, 2)
    out = re.sub("\n{" + str(most + 1) + ",}", "\n" * most, text)
    ending = len(like) - len(like.rstrip("\n"))
    return out.rstrip("\n") + "\n" * ending if ending else out


def _check_only_ours(before: str, after: str, wanted: list[Setting], where: str) -> None:
    """What containerd will read from ``after`` is ``before`` plus ``wanted``, nothing else."""
    expect = tomllib.loads(before)
    for s in wanted:
        table = expect
        for name in s.table:
            table = table.setdefault(name, {})
        if not (s.if_absent and s.key in table):
            table[s.key] = s.value
    try:
        got = tomllib.loads(after)
    except tomllib.TOMLDecodeError as exc:
        got = {"<invalid>": str(exc)}
    if got != expect:
        raise FailedPrecondition(f"{where}: editing it would change more than coldstart's keys "
                                 "(a layout tomlkit does not handle): add the keys by hand (see "
                                 "`coldstart node install --dry-run` on a copy without them)")


def revert(text: str, edits: Iterable[Edit], created: Iterable[TablePath],
           where: str = "containerd config", like: str | None = None) -> tuple[str, list[str]]:
    """Take ``edits`` out of ``text`` (a key the operator changed since stays, and is named in
    the notes), then remove the ``created`` tables left empty; blank lines as in ``like`` (the
    original, when known). Returns the text and notes."""
    doc = parse(text, where)
    notes: list[str] = []
    for e in reversed(list(edits)):
        table = _table(doc, e.table, where)
        if table is None or e.key not in table:
            continue
        current = _plain(table[e.key])
        if not _same(current, e.value):
            notes.append(f"{dotted((*e.table, e.key))} is {_toml(current)} now, not what "
                         "install set: left as it is")
            continue
        if e.absent:
            del table[e.key]
        else:
            table[e.key] = e.old_item()
    for path in sorted(created, key=len, reverse=True):
        table = _table(doc, path, where)
        parent = _table(doc, path[:-1], where) if len(path) > 1 else doc
        if table is not None and parent is not None and _is_empty(table):
            del parent[path[-1]]
    return tidy(tomlkit.dumps(doc), like=text if like is None else like), notes


def _is_empty(table: MutableMapping[str, Any]) -> bool:
    return len(table) == 0


def missing(text: str, target: Target, where: str = "containerd config") -> list[str]:
    """The settings ``text`` lacks for ``target`` (as ``table.key = value``); [] when installed."""
    doc = parse(text, where)
    out = []
    for s in settings(schema_version(doc, where), target, doc):
        table = _table(doc, s.table, where)
        if table is None or s.key not in table or \
                not (s.if_absent or _same(_plain(table[s.key]), s.value)):
            out.append(str(s))
    return out
