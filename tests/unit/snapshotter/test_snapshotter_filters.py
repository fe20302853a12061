"""containerd's filter language (cases from containerd's own filter tests and the handshake)."""

from __future__ import annotations

import pytest

from coldstart.errors import InvalidArgument
from coldstart.snapshotter.filters import parse, parse_all
from coldstart.snapshotter.store import Info, Kind

REF = "containerd.io/snapshot.ref"


A = Info("sha256:aa", "", Kind.COMMITTED, 1, 1, {REF: "sha256:aa", "team": "ml"})
B = Info("b", "sha256:aa", Kind.ACTIVE, 1, 1, {"team": "infra", "a.b": "dotted"})
V = Info("ns/3/v", "sha256:aa", Kind.VIEW, 1, 1, {})
ALL = [A, B, V]


def names(*filters: str) -> list[str]:
    match = parse_all(filters)
    return [i.name for i in ALL if match(i)]


@pytest.mark.parametrize(("filters", "expected"), [
    ((), ["sha256:aa", "b", "ns/3/v"]),
    (("",), ["sha256:aa", "b", "ns/3/v"]),
    (("kind==committed",), ["sha256:aa"]),
    (("kind==active", "kind==view"), ["b", "ns/3/v"]),
    (('parent=="sha256:aa",kind!=view',), ["b"]),
    (("parent==sha256:aa",), ["b", "ns/3/v"]),
    (('parent==""',), ["sha256:aa"]),
    (("labels.team",), ["sha256:aa", "b"]),
    (("labels.team!=ml",), ["b", "ns/3/v"]),
    (("labels.team~=^in",), ["b"]),
    (("labels.team~=/^(ml|infra)$/",), ["sha256:aa", "b"]),
    (("labels.team~=|fr|",), ["b"]),
    (('labels."containerd.io/snapshot.ref"==sha256:aa,parent==""',), ["sha256:aa"]),
    ((f'labels."{REF}"==sha256:aa,parent=="x"',), []),
    (("labels.a.b==dotted",), ["b"]),
    (('labels."a.b"==dotted',), ["b"]),
    (("name~=ns/",), ["ns/3/v"]),
    ((" name == b ",), ["b"]),
    (('name=="\\x62"',), ["b"]),
    (("nosuchfield",), []),
    (("nosuchfield!=x",), ["sha256:aa", "b", "ns/3/v"]),
])
def test_filters_select_like_containerd(filters: tuple[str, ...], expected: list[str]) -> None:
    assert names(*filters) == expected


@pytest.mark.parametrize("bad", [
    "kind==", "==x", "kind=x", "kind===x", "kind==a b", 'name=="open', "name==/re/",
    "labels.", "a,,b", "name~=/[/", 'name=="\\q"', "kind==x,",
])
def test_bad_filters_are_invalid_arguments(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="filters"):
        parse_all([bad])


def test_selectors_keep_their_parts() -> None:
    (sel,) = parse('labels."k.1"~=/^v$/')
    assert (sel.fieldpath, sel.op, sel.value) == (("labels", "k.1"), "~=", "^v$")
    assert parse("") == []
