"""The README and docs/*.md link only to what exists, and every docs page can be reached.

Every relative link and image in README.md and docs/*.md must name an existing file, and a link
with ``#anchor`` an existing heading of its target (GitHub's heading ids: the heading's text as
rendered, lower-cased, punctuation other than ``-`` and ``_`` dropped, spaces turned into ``-``,
``-1``, ``-2`` ... for repeats). Every docs/*.md page must be reachable from the README through
such links. Links inside code blocks and inline code are text, not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"""<(?:img|a)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.I)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def rendered_heading(text: str) -> str:
    """A heading's text as GitHub renders it: code spans keep their content, links their text,
    emphasis markers and HTML tags go."""
    text = INLINE_CODE.sub(lambda m: m.group(2).strip(), text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"(\*\*|\*|__)", "", text)


def slug(text: str) -> str:
    """GitHub's id for a heading's rendered text."""
    text = rendered_heading(text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code."""
    out = []
    fenced = False
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = INLINE_CODE.sub("", line)
        out += [(i, m.group(1)) for m in LINK.finditer(line)]
        out += [(i, m.group(1)) for m in HTML_SRC.finditer(line)]
    return out


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)) or target.startswith("//")


def resolve(page: Path, target: str) -> tuple[Path, str]:
    """The file a relative link names and its anchor ('' if none)."""
    file_part, _, anchor = target.partition("#")
    dest = page if not file_part else (page.parent / unquote(file_part)).resolve()
    return dest, unquote(anchor)


def broken_links(page: Path) -> list[str]:
    problems = []
    for line, target in links(page):
        if is_external(target):
            continue
        dest, anchor = resolve(page, target)
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with id '{anchor}' in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_reachable_from_the_readme():
    reached: set[Path] = set()
    todo = [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for _, target in links(page):
            if is_external(target):
                continue
            dest, _ = resolve(page, target)
            if dest.suffix == ".md" and dest.exists():
                todo.append(dest)
    unreached = [str(p.relative_to(ROOT)) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in reached]
    assert not unreached, f"docs pages no link from README.md leads to: {unreached}"


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Two commands", "two-commands"),
        ("`doctor --json` keys", "doctor---json-keys"),
        (
            "A small GPU in software: `--vram-guard-emulate-vram SIZE`",
            "a-small-gpu-in-software---vram-guard-emulate-vram-size",
        ),
        ('If you get "out of memory" at …', "if-you-get-out-of-memory-at-"),
        ("`plan` speed and the estimates (issue 12)", "plan-speed-and-the-estimates-issue-12"),
        ("**Bold** and [a link](x.md)", "bold-and-a-link"),
        ("snake_case stays", "snake_case-stays"),
    ],
)
def test_heading_ids_follow_github(heading, expected):
    assert slug(heading) == expected


def test_the_checker_finds_broken_links(tmp_path):
    """The check itself: a missing file, a missing anchor and a link in code (ignored)."""
    (tmp_path / "a.md").write_text("# Title\n\n## Part two\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#part-two) [gone](missing.md) [bad anchor](a.md#part-three) `[code](nothing.md)`\n"
        "```\n[fenced](nothing.md)\n```\n![img](pic.png) [self](#here)\n\n## Here\n",
        encoding="utf-8",
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = broken_links(page)
    finally:
        ROOT = saved
    assert len(problems) == 3, problems
    assert any("missing.md: no such file" in p for p in problems)
    assert any("part-three" in p for p in problems)
    assert any("pic.png: no such file" in p for p in problems)


def test_the_documented_api_examples_are_found_and_valid():
    """The acceptance run's ``readme`` phase sends docs/api.md's examples as written: they must be
    found there, and their VRAM Guard args must be what VRAM Guard accepts (name-keyed and
    positional give the same options)."""
    import importlib.util

    from lib_vram.webui.options import from_args

    path = ROOT / "tests" / "acceptance" / "webui_acceptance.py"
    spec = importlib.util.spec_from_file_location("webui_acceptance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    examples = module.readme_api_examples()
    assert [label for label, _, _ in examples] == ["docs/api.md curl example", "docs/api.md positional form"]
    parsed = [from_args(payload["alwayson_scripts"]["VRAM Guard"]["args"]) for _, _, payload in examples]
    assert parsed[0] == parsed[1] and parsed[0].enabled and parsed[0].vae_tile == 64
    for _, path_, payload in examples:
        assert path_ == "/sdapi/v1/txt2img" and payload["enable_hr"] and payload["denoising_strength"]
