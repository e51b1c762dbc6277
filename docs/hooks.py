"""mkdocs hooks: README.md is the site's home page, links to it lead there, and links to the
repository's other files (outside docs/) become plain text, since the site holds only docs/.

The pages keep relative links (`../README.md#exit-codes`, `../examples/custom_model.py`) so that
they work where the repository is browsed as files.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _relink(markdown: str, base: Path) -> str:
    """Links relative to `base`: README.md's to the home page, those into docs/ made relative to
    docs/ (the site's root, where every page is); the others replaced by their text."""
    def fix(m: re.Match) -> str:
        bang, text, target = m.groups()
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target):
            return m.group(0)  # a URL or an anchor on the same page
        path, hash_, anchor = target.partition("#")
        resolved = (base / path).resolve()
        if resolved == ROOT / "README.md":  # the home page
            return f"{bang}[{text}](index.md{hash_}{anchor})"  # every page sits in docs/ itself
        if resolved == DOCS or DOCS in resolved.parents:
            if base == DOCS:
                return m.group(0)
            return f"{bang}[{text}]({resolved.relative_to(DOCS).as_posix()}{hash_}{anchor})"
        return text  # a file of the repository, not of the site

    out, in_code = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            in_code = not in_code
        out.append(line if in_code else LINK.sub(fix, line))
    return "".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "index.md":
        return _relink((ROOT / "README.md").read_text(), ROOT)
    return _relink(markdown, (DOCS / page.file.src_uri).parent)
