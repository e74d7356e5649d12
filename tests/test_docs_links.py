"""The pages for users link to what exists: every relative link (and image)
in README.md, docs/*.md and the benchmark notes in bench/results/ names a
file or folder of this tree, and a #fragment names a heading of the page it
points at (GitHub's anchors). docs/ holds pages only: raw results, plots
and the lab notebook live in bench/results/ (issue 41).

From an unpacked sdist (which holds the docs and the notebook but not the
raw results), links into bench/ are not checked."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: bench/results/README.md is not in the sdist; its absence says we run from one
CHECKOUT = (ROOT / "bench" / "results" / "README.md").exists()

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def pages() -> List[Path]:
    found = [ROOT / "README.md", *sorted(DOCS.glob("*.md")),
             *sorted((ROOT / "bench" / "results").glob("*.md"))]
    return [p for p in found if p.is_file()]


def _prose(text: str) -> str:
    """The page without its fenced code blocks and code spans."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, with
    everything but letters, digits, spaces, hyphens and underscores removed,
    spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(page: Path) -> Set[str]:
    seen: Dict[str, int] = {}
    found: Set[str] = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> Iterator[Tuple[int, str]]:
    text = _prose(page.read_text(encoding="utf-8"))
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        yield text.count("\n", 0, match.start()) + 1, target


def broken(page: Path) -> List[str]:
    bad = []
    for line, target in links(page):
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        try:
            inside = dest.relative_to(ROOT)
        except ValueError:
            bad.append(f"{where} (outside the repository)")
            continue
        if not dest.exists():
            if not CHECKOUT and inside.parts[:1] == ("bench",):
                continue  # an sdist has no raw results
            bad.append(f"{where} (no such file)")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{where} (no heading with that anchor in {inside.as_posix()})")
    return bad


def test_slug_follows_github():
    assert slug("The coordinator's share: below the ring's floor") == \
        "the-coordinators-share-below-the-rings-floor"
    assert slug("DDP across machines: the rank links against gloo (issue 19)") == \
        "ddp-across-machines-the-rank-links-against-gloo-issue-19"
    assert slug("One host: shared memory (issue 12, item 4)") == "one-host-shared-memory-issue-12-item-4"
    assert slug("Kernels against `numpy`") == "kernels-against-numpy"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert not broken(page), "\n".join(broken(page))


def test_docs_holds_only_pages():
    if not DOCS.is_dir():
        pytest.skip("docs/ is not in this tree")
    others = sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*")
                    if p.is_dir() or p.suffix != ".md")
    assert not others, f"docs/ is for pages; move raw results to bench/results/: {others}"


def test_the_results_page_links_raw_results():
    """Every table row of docs/results.md with a figure names its raw result."""
    page = DOCS / "results.md"
    if not page.exists():
        pytest.skip("docs/results.md is not in this tree")
    raw = [t for _, t in links(page) if t.startswith("../bench/results/")]
    assert len(raw) >= 10, raw
