"""The docs site: ``mkdocs build --strict`` builds every page of mkdocs.yml's nav from ``docs/``
with nothing fetched from the network, fails on a broken link, and Steep serves the result at
``/docs/`` (or says how to build it)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def nav_pages(config: Path) -> list[str]:
    """Every Markdown file the nav names, nested sections included."""

    def walk(items) -> list[str]:
        pages = []
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            pages += walk(value) if isinstance(value, list) else [value]
        return pages

    return walk(yaml.safe_load(config.read_text())["nav"])


def built_page(site: Path, page: str) -> Path:
    """Where mkdocs (directory URLs) writes ``page``: ``a/b.md`` → ``a/b/index.html``."""
    stem = page.removesuffix(".md")
    if stem == "index" or stem.endswith("/index"):
        return site / stem.removesuffix("index") / "index.html"
    return site / stem / "index.html"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs-site")
    built = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert built.returncode == 0, built.stderr
    return out


def test_every_page_of_the_nav_is_built(site):
    pages = nav_pages(ROOT / "mkdocs.yml")
    assert {"index.md", "concepts.md", "gateway.md", "rest-api.md", "run-settings.md"} <= set(pages)
    for page in pages:
        built = built_page(site, page)
        assert built.is_file(), f"{page} was not built ({built})"
        title = (ROOT / "docs" / page).read_text().splitlines()[0].lstrip("# ").strip()
        assert html.escape(title.split("`")[0], quote=False) in built.read_text(), page


def test_every_markdown_file_of_docs_is_in_the_nav():
    pages = set(nav_pages(ROOT / "mkdocs.yml"))
    files = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert files - pages == set(), "add these to mkdocs.yml's nav"


def test_the_built_site_loads_nothing_from_the_network(site):
    remote = re.compile(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""", re.I)
    for page in site.rglob("*.html"):
        found = remote.findall(page.read_text())
        assert not found, f"{page.relative_to(site)} loads {found}"


@pytest.mark.parametrize(
    "broken",
    [
        "[a page that does not exist](no-such-page.md)",
        "[an anchor that does not exist](concepts.md#no-such-heading)",
        "[a file outside docs/](../webapp/settings.py)",
    ],
    ids=["page", "anchor", "outside"],
)
def test_a_broken_link_fails_the_build(tmp_path, broken):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "gateway.md"
    page.write_text(page.read_text() + f"\nSee {broken}.\n")

    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")

    assert built.returncode != 0, built.stderr
    output = built.stdout + built.stderr
    assert "gateway.md" in output and "strict mode" in output, output


# --- served at /docs/


@pytest.fixture
def served(site, settings) -> Path:
    settings.DOCS_SITE_DIR = site
    return site


def test_docs_serves_the_home_page_and_each_page_under_its_folder(client, served):
    home = client.get("/docs/")
    assert home.status_code == 200 and home["Content-Type"] == "text/html; charset=utf-8"
    assert home.content == (served / "index.html").read_bytes()

    concepts = client.get("/docs/concepts/")
    assert concepts.status_code == 200 and b"Staleness" in concepts.content
    # Without its slash, the page's relative links would resolve one folder up.
    assert client.get("/docs/concepts").url == "/docs/concepts/"

    css = next(served.glob("css/*.css")).name
    style = client.get(f"/docs/css/{css}")
    assert style.status_code == 200 and style["Content-Type"].startswith("text/css")


def test_docs_answers_404_outside_the_site_and_for_what_it_lacks(client, served):
    for path in ("/docs/no-such-page/", "/docs/../webapp/settings.py", "/docs/%2e%2e/mkdocs.yml"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert b"No such page" in response.content and b"SECRET_KEY" not in response.content
    assert client.post("/docs/").status_code == 405


def test_docs_says_how_to_build_the_site_until_it_is_built(client, settings, tmp_path):
    settings.DOCS_SITE_DIR = tmp_path / "site"
    response = client.get("/docs/concepts/")
    assert response.status_code == 404
    assert b"./steep docs" in response.content and b"not built yet" in response.content


@pytest.mark.django_db
def test_the_dashboard_links_to_the_docs(client, owner):
    assert b'href="/docs/"' in client.get("/login/").content
    client.force_login(owner)
    assert b'href="/docs/"' in client.get("/projects/").content
