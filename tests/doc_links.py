"""Relative links of the documentation (README.md, docs/*.md, conf/README.md): each ``[text](target)`` that is
not a URL must name a file of the repository and, with ``#anchor``, a heading of that file as GitHub slugs it.

Invariant: a link is reported with its file and line, so a broken one names where it is.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.readme_commands import ROOT, doc_files

LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def link_files() -> list[Path]:
    """README, docs/*.md and conf/README.md: the files ``readme_commands.doc_files`` reads."""
    return doc_files()


def prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced blocks (a ``[x](y)`` inside code is no link), 1-based."""
    out, fenced = [], False
    for num, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((num, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug in ``path``; a repeated heading gets ``-1``, ``-2`` as GitHub numbers it."""
    counts: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if not m:
            continue
        base = slug(m.group(1))
        found.add(f"{base}-{counts[base]}" if base in counts else base)
        counts[base] = counts.get(base, 0) + 1
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of each non-URL link in ``path``'s prose."""
    return [(num, m.group(1)) for num, line in prose_lines(path.read_text()) for m in LINK.finditer(line)
            if not URL.match(m.group(1))]


def broken(path: Path, target: str) -> str | None:
    """Why ``target`` (written in ``path``) does not resolve, else None."""
    name, _, anchor = target.partition("#")
    dest = (path.parent / name).resolve() if name else path
    if not dest.exists():
        return f"no such file {dest}"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading #{anchor} in {dest.relative_to(ROOT)}"
    return None
