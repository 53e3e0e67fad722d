"""The documentation's relative links resolve: README -> docs/x.md#anchor, docs -> README and conf/README.md
(``tests/doc_links.py``). README's long history lives in docs/ (session 41), so a renamed heading or a moved file
must not leave a dead link behind."""

from __future__ import annotations

import pytest

from tests.doc_links import anchors, broken, link_files, relative_links, slug
from tests.readme_commands import README, ROOT

LINKS = [(path, line, target) for path in link_files() for line, target in relative_links(path)]


def test_links_are_found():
    """README links each docs/ topic file and conf/README.md (a broken extractor would pass everything)."""
    targets = {target.partition("#")[0] for path, _, target in LINKS if path == README}
    docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert docs | {"conf/README.md"} <= targets, sorted(docs | {"conf/README.md"} - targets)


def test_repeated_headings_are_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## History\n\n```\n## not a heading\n```\n\n## History\n")
    assert anchors(page) == {"top", "history", "history-1"}


def test_slug_follows_github():
    """GitHub's rule on this repository's kinds of headings: code marks and punctuation dropped, each space a ``-``
    (so ``B + W - one`` keeps three hyphens), ``-1`` for a repeat."""
    assert slug("Where issue 26 stands: the planner against published runs") == \
        "where-issue-26-stands-the-planner-against-published-runs"
    assert slug("What `scripts/plan.py` prints, and how far to trust it") == \
        "what-scriptsplanpy-prints-and-how-far-to-trust-it"
    assert slug("Where B + W - one backward goes (session 40)") == "where-b--w---one-backward-goes-session-40"
    assert "long-context-context-parallelism" in anchors(README)


@pytest.mark.parametrize("path,line,target", LINKS,
                         ids=[f"{p.relative_to(ROOT)}:L{line}-{t}" for p, line, t in LINKS])
def test_link_resolves(path, line, target):
    error = broken(path, target)
    assert error is None, f"{path.relative_to(ROOT)}:{line}: ({target}) -> {error}"
