"""The README is an entry point (STYLE.md: at most 250 lines; the manuals live in docs/), and the links
of the README and docs/ point at files that exist: sections move between them."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def test_the_readme_is_an_entry_point():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_points_at_a_file(page):
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    missing = [t for t in local if t and not (page.parent / t).exists()]
    assert missing == [], f"{page.relative_to(ROOT)} links to missing files: {missing}"
