"""The README stays a front page and docs/ stays findable (issue 43).

Budgets: README.md at most 1,200 words (as ``wc -w`` counts them: pictures, tables and code count
by their words), no README table line over 160 characters, no README paragraph over 6 lines;
docs/ at most 3,500 lines of Markdown in all (subfolders included), docs/webui-acceptance.md at
most 800. Every picture under docs/ is shown by the README or a docs page (an unlinked picture is
deleted, not kept), every claim row of docs/evidence.md names the command that reruns it, and
every "Works with" row of the README says yes, no or partial. That every relative link resolves
is checked by ``test_docs_links.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs_links import DOCS, FENCE, README, ROOT, is_external, links, resolve

README_WORDS = 1200
TABLE_LINE_CHARS = 160
PARAGRAPH_LINES = 6
DOCS_LINES = 3500
ACCEPTANCE_LINES = 800
PICTURES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s")


def words(text: str) -> int:
    """``wc -w``: runs of non-blank characters."""
    return len(text.split())


def table_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every table row outside code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and line.lstrip().startswith("|"):
            out.append((i, line))
    return out


def paragraphs(text: str) -> list[list[str]]:
    """Prose paragraphs: runs of lines split at blank lines, headings, tables, code blocks (whose
    lines are no prose) and list items (each list item starts its own paragraph)."""
    out: list[list[str]] = []
    current: list[str] = []
    fenced = False

    def close() -> None:
        nonlocal current
        if current:
            out.append(current)
        current = []

    for line in text.splitlines():
        stripped = line.strip()
        if FENCE.match(stripped):
            fenced = not fenced
            close()
            continue
        if fenced or not stripped or stripped.startswith(("#", "|")):
            close()
            continue
        if LIST_ITEM.match(line):
            close()
        current.append(line)
    close()
    return out


def markdown_lines() -> dict[Path, int]:
    return {p: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted(DOCS.rglob("*.md"))}


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first table under ``heading`` (a ``## `` heading)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def test_the_readme_is_at_most_1200_words():
    n = words(README.read_text(encoding="utf-8"))
    assert n <= README_WORDS, f"README.md has {n} words (wc -w); the budget is {README_WORDS}"


def test_no_readme_table_line_is_over_160_characters():
    rows = table_lines(README.read_text(encoding="utf-8"))
    long = [(i, len(line)) for i, line in rows if len(line) > TABLE_LINE_CHARS]
    assert not long, f"README.md table lines over {TABLE_LINE_CHARS} characters (line, length): {long}"


def test_no_readme_paragraph_is_over_6_lines():
    long = [p[0][:60] for p in paragraphs(README.read_text(encoding="utf-8")) if len(p) > PARAGRAPH_LINES]
    assert not long, f"README.md paragraphs over {PARAGRAPH_LINES} lines, starting: {long}"


def test_docs_are_at_most_3500_lines():
    counts = markdown_lines()
    total = sum(counts.values())
    biggest = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    assert total <= DOCS_LINES, (
        f"docs/ has {total} lines of Markdown; the budget is {DOCS_LINES}. Largest: "
        + ", ".join(f"{p.relative_to(ROOT)} {n}" for p, n in biggest)
    )


def test_the_acceptance_record_is_at_most_800_lines():
    n = len((DOCS / "webui-acceptance.md").read_text(encoding="utf-8").splitlines())
    assert n <= ACCEPTANCE_LINES, f"docs/webui-acceptance.md has {n} lines; the budget is {ACCEPTANCE_LINES}"


def test_every_picture_under_docs_is_shown_somewhere():
    shown: set[Path] = set()
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        for _, target in links(page):
            if not is_external(target):
                shown.add(resolve(page, target)[0])
    pictures = [p for p in sorted(DOCS.rglob("*")) if p.suffix.lower() in PICTURES]
    unlinked = [str(p.relative_to(ROOT)) for p in pictures if p.resolve() not in shown]
    assert not unlinked, f"pictures no page shows (delete them or link them): {unlinked}"


def test_every_evidence_row_names_the_command_that_reruns_it():
    text = (DOCS / "evidence.md").read_text(encoding="utf-8")
    header = "| claim | where | result | rerun | when |"
    rows, in_table = [], False
    for _, line in table_lines(text):
        if line.strip() == header:
            in_table = True
        elif in_table and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert len(rows) >= 40, f"docs/evidence.md: {len(rows)} claim rows under {header!r}"
    missing = [r[0] for r in rows if len(r) != 5 or "`" not in r[3] or not r[4]]
    assert not missing, f"docs/evidence.md rows without a rerun command or a date: {missing}"


def test_every_works_with_row_says_yes_no_or_partial_and_links_its_evidence():
    rows = table_rows(README.read_text(encoding="utf-8"), "## Works with")
    assert rows, "README.md: no 'Works with' table"
    bad = [r[0] for r in rows if len(r) != 3 or r[1] not in ("yes", "no", "partial")]
    assert not bad, f"'Works with' rows without yes/no/partial: {bad}"
    unlinked = [r[0] for r in rows if r[1] != "no" and "](" not in r[2]]
    assert not unlinked, f"'Works with' rows that link no evidence: {unlinked}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("one\ntwo\n\nthree\n", [2, 1]),
        ("- a\n  b\n- c\n", [2, 1]),
        ("para\n| x |\n| y |\nmore\n", [1, 1]),
        ("# h\ntext\n```\n1\n2\n3\n4\n5\n6\n7\n```\nafter\n", [1, 1]),
    ],
)
def test_paragraphs_are_split_at_blank_lines_headings_tables_list_items_and_code(text, expected):
    assert [len(p) for p in paragraphs(text)] == expected


def test_the_budget_checks_fail_on_what_they_guard():
    """The checks themselves: a long table line, a long paragraph, too many words."""
    text = "word " * (README_WORDS + 1) + "\n\n| " + "x" * TABLE_LINE_CHARS + " |\n\n" + "line\n" * 7
    assert words(text) > README_WORDS
    assert any(len(line) > TABLE_LINE_CHARS for _, line in table_lines(text))
    assert any(len(p) > PARAGRAPH_LINES for p in paragraphs(text))
