"""The repository speaks to users: no development history in the documents or in code comments.

git log keeps the history. A reader of README, docs/ or a docstring wants what is true now and why,
not which session changed it, which issue asked for it or what an older main measured.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Words of a lab notebook, wherever they appear.
HISTORY = re.compile(
    r"\bsessions? \d+"
    r"|\bissues? #?\d+"
    r"|\(#\d+\)"
    r"|\b(?:merged|previous|old|older) main\b|\bmain of\b|\bon (?:the )?main\b(?!\s+(?:thread|loop|process))"
    r"|\bthe brief\b"
    r"|\bother engineers\b"
    r"|\b(?:before|after|since) (?:issue|the change|this change)\b"
    r"|\b(?:this|the|another|merged) branch's\b|\b(?:this|merged|a helper's) branch\b",
    re.IGNORECASE,
)

#: Documents: prose about the product, so these read as history there in any sense.
DOC_ONLY = re.compile(r"\bbranch(?:es|'s)?\b|\b(?:this|last|previous|next) session\b", re.IGNORECASE)


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _sources() -> list[Path]:
    found: list[Path] = []
    for folder in ("ftlaunch", "scripts", "tests", "components"):
        found += sorted((ROOT / folder).rglob("*.py"))
    return found + sorted((ROOT / "scripts").glob("*.sh"))


def _prose_of_python(path: Path) -> list[tuple[int, str]]:
    """Comments and string literals (docstrings, messages) of a Python file, with their lines."""
    out: list[tuple[int, str]] = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    for tok in tokens:
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((tok.start[0], tok.string))
    return out


def _hits(pattern: re.Pattern[str], lines: list[tuple[int, str]], where: Path) -> list[str]:
    rel = where.relative_to(ROOT)
    return [f"{rel}:{n}: {m.group(0)!r}" for n, text in lines for m in pattern.finditer(text)]


def test_documents_carry_no_development_history() -> None:
    hits: list[str] = []
    for doc in _documents():
        lines = list(enumerate(doc.read_text().splitlines(), 1))
        hits += _hits(HISTORY, lines, doc) + _hits(DOC_ONLY, lines, doc)
    assert not hits, "development history in the documents:\n" + "\n".join(hits)


def test_code_comments_carry_no_development_history() -> None:
    hits: list[str] = []
    for path in _sources():
        if path == Path(__file__).resolve():
            continue
        if path.suffix == ".py":
            lines = _prose_of_python(path)
        else:
            lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if "#" in line]
        hits += _hits(HISTORY, lines, path)
    assert not hits, "development history in code comments and strings:\n" + "\n".join(hits)


def test_the_check_sees_history() -> None:
    """The patterns catch the forms history takes (so the tests above can fail)."""
    for text in (
        "measured in session 24",
        "as issue 17 defines it",
        "0.46 ms on the previous main",
        "this branch's lighthouse",
        "0.41 s on main",
        "the target of the brief",
        "while other engineers worked",
        "was 2.3 s before issue 11",
    ):
        assert HISTORY.search(text), text
    for text in ("a client session", "the pytest session's marker", "issues a request", "on the main thread"):
        assert not HISTORY.search(text), text
