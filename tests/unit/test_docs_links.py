"""The README and docs/ hold together: every relative link resolves (and its #anchor names a
heading of the target, by GitHub's slug rules), every repository path written as code exists,
and the README stays short with the two set-up commands at its top (.ci/run runs the second)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted([README, *(ROOT / "docs").glob("*.md"), ROOT / "bench" / "published" / "README.md"])

SETUP_COMMANDS = (
    "bash scripts/install.sh && .venv/bin/coldstart bench builtin:tiny --embedded --runs 3",
    "bash scripts/install.sh && .venv/bin/python -m pytest -q -ra",
)
README_MAX_LINES = 260

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# repository paths written as code (`bench/bench_fuse.py`); generated, git-ignored trees aside
_REPO_PATH = re.compile(r"^(?:bench|coldstart|deploy|docs|protos|scripts|tests)/[\w./-]*$")
_GENERATED = ("bench/results/", "bench/images/", "coldstart/_proto/")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, every character that is
    not a letter, digit, space, hyphen or underscore dropped, each space a hyphen."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", heading)             # images
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)            # links: their text
    text = _CODE_SPAN.sub(lambda m: m.group(2), text)               # code: its content
    text = re.sub(r"<[^>]+>", "", text)                             # inline HTML
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text (duplicates get -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_targets(text: str) -> list[str]:
    """The targets of inline links, images and reference definitions, outside code."""
    targets: list[str] = []
    for line in _prose_lines(text):
        plain = _CODE_SPAN.sub("CODE", line)
        targets += _LINK.findall(plain)
        m = _REF_DEF.match(plain)
        if m:
            targets.append(m.group(1))
    return targets


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What in ``page`` points nowhere: relative links to missing files, anchors with no such
    heading, and repository paths written as code that do not exist."""
    text = page.read_text(encoding="utf-8")
    problems: list[str] = []
    for target in link_targets(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):     # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{target}: no such file ({dest.relative_to(root)})"
                            if dest.is_relative_to(root) else f"{target}: outside the repo")
            continue
        if (anchor and dest.suffix == ".md" and dest.is_file()
                and anchor not in anchors(dest.read_text(encoding="utf-8"))):
            problems.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    for line in _prose_lines(text):
        for m in _CODE_SPAN.finditer(line):
            code = m.group(2).strip()
            if (_REPO_PATH.match(code) and not code.startswith(_GENERATED)
                    and not (root / code).exists()):
                problems.append(f"`{code}`: no such path in the repository")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert page.exists()
    assert broken_links(page) == []


def test_the_readme_keeps_the_two_set_up_commands_at_its_top() -> None:
    top = README.read_text(encoding="utf-8").splitlines()[:20]
    for command in SETUP_COMMANDS:
        assert command in top, command


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)


def test_the_readme_links_to_every_docs_page_and_the_index() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve()
              for t in link_targets(README.read_text(encoding="utf-8"))}
    for page in [*(ROOT / "docs").glob("*.md"), ROOT / "bench" / "published" / "README.md"]:
        assert page.resolve() in linked, page.relative_to(ROOT)


def test_the_index_names_every_published_folder() -> None:
    index = (ROOT / "bench" / "published" / "README.md").read_text(encoding="utf-8")
    for folder in (ROOT / "bench" / "published").iterdir():
        if folder.is_dir():
            assert f"[{folder.name}](" in index, folder.name


def test_slugs_follow_github() -> None:
    assert slug("Images nobody converted: `coldstart index`") == \
        "images-nobody-converted-coldstart-index"
    assert slug("Installing on Kubernetes nodes: `deploy/kubernetes/`") == \
        "installing-on-kubernetes-nodes-deploykubernetes"
    assert slug("Start-up profiles and the hybrid fill (torch, `bash x.sh`)") == \
        "start-up-profiles-and-the-hybrid-fill-torch-bash-xsh"
    assert slug("fuse.split_xattrs, [the key](x.md)") == "fusesplit_xattrs-the-key"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# Here it is\n\n## Second: `part`\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# T\n\n"
        "[ok](docs/there.md) [ok](docs/there.md#here-it-is) [ok](docs/there.md#second-part)\n"
        "[ok](#t) [web](https://example.com/x) `[not a link](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[gone](docs/missing.md) [bad anchor](docs/there.md#no-such) [self](#nope)\n"
        "[ref]: docs/also-missing.md\n"
        "see `docs/there.md` and `docs/absent.md`\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 5, problems
    assert any("docs/missing.md" in p for p in problems)
    assert any("#no-such" in p for p in problems)
    assert any("#nope" in p for p in problems)
    assert any("also-missing" in p for p in problems)
    assert any("docs/absent.md" in p for p in problems)
