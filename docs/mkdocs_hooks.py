"""mkdocs hooks: the site is built from the repository as it reads on GitHub.

- `README.md` is the site's home page, `examples/swarm_walkthrough.md` and `CHANGELOG.md` are
  pages of it too: they are read where they live, so there is one copy of each.
- A link between these pages is written as a path in the repository (`docs/cli.md` in the
  README, `../README.md` in `docs/`) and rewritten here to the page's place in the site. A link
  to another file of the repository (a script, a test) keeps its text in the site, which holds
  no code; a link to a file that does not exist stays as written, so `mkdocs build --strict`
  fails on it.
- `starling` is a namespace whose rooms are mapped to root folders (`package-dir` in
  `pyproject.toml`), which mkdocstrings cannot find on its own: it reads them from a folder of
  links, `build/api-src/starling/<room>`, made here from that mapping.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

import tomllib  # Python 3.11+, as the docs build needs
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

# site page -> the repository file it is read from (every docs/X.md is the page X.md as well)
PAGES_FROM_REPO = {
    "index.md": "README.md",
    "walkthrough.md": "examples/swarm_walkthrough.md",
    "changelog.md": "CHANGELOG.md",
}
API_SOURCES = "build/api-src"

# [text](target#anchor), not an image, with a target that is no bare anchor
_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def _root(config) -> Path:
    return Path(config.config_file_path).parent


def _repo_path(site_path: str) -> str:
    return PAGES_FROM_REPO.get(site_path, f"docs/{site_path}")


def _site_path(repo_path: str) -> str | None:
    for site, repo in PAGES_FROM_REPO.items():
        if repo == repo_path:
            return site
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    return None


# before mkdocstrings, which looks for its paths when its handler is made
@event_priority(100)
def on_config(config):
    """Link each room under `build/api-src/starling/` so that mkdocstrings finds `starling.<room>`."""
    root = _root(config)
    with open(root / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        if package.count(".") != 1:
            continue  # a subpackage lies inside its room's folder already
        link = root / API_SOURCES / Path(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(root / folder, target_is_directory=True)
    return config


def on_files(files: Files, config) -> Files:
    root = _root(config)
    for site, repo in PAGES_FROM_REPO.items():
        files.append(File.generated(config, site, abs_src_path=str(root / repo)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Rewrite repository-relative links between pages to the pages' places in the site."""
    root = _root(config)
    here = _repo_path(page.file.src_uri)
    site_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        if ":" in target:  # a URL (https:, mailto:)
            return match.group(0)
        repo = posixpath.normpath(posixpath.join(posixpath.dirname(here), target))
        site = _site_path(repo) if repo.endswith(".md") else None
        if site is not None:
            return f"[{text}]({posixpath.relpath(site, site_dir or '.')}{anchor})"
        if (root / repo).exists() and not repo.startswith(".."):
            return text
        return match.group(0)

    return _LINK.sub(rewrite, markdown)
