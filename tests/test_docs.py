"""The README and docs/ link only to files and headings that exist.

Results move between the README and docs/results.md as they age; a link left behind
would point a user at nothing. Anchors follow GitHub's slugs: lower case, punctuation
dropped except '-' and '_', each space a '-'.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_slug(heading: str) -> str:
    """`## Exactness, and how it is checked` -> `exactness-and-how-it-is-checked`."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_'
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The heading slugs of a markdown page (fenced code skipped: '# comment' is no heading)."""
    slugs, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            slugs.add(github_slug(m.group(1)))
    return slugs


def local_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text(encoding="utf-8"))
            if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: are not checked here


def test_slug_of_a_known_heading():
    assert github_slug("Exactness, and how it is checked") == "exactness-and-how-it-is-checked"
    assert github_slug("Adaptive drafting (`specdraft.adaptive`, `--adaptive on|off|refresh`)") == (
        "adaptive-drafting-specdraftadaptive---adaptive-onoffrefresh")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_local_link_resolves(page):
    broken = []
    for target in local_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"
