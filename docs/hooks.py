"""mkdocs hook of `make docs`: the home page is the repository's README, its links to `docs/<page>` made
relative to the site (the README is written for the repository's front page; this keeps one copy)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return README.read_text().replace("](docs/", "](")
