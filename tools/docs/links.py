#!/usr/bin/env python3
"""Check every relative link of the book (docs/src) and of the top-level
Markdown files (README.md, CONTRIBUTING.md, CHANGELOG.md): the file must
exist and, for a `#fragment`, the target page must have a heading with
that id (mdBook's rule: lower case, punctuation dropped, spaces to '-').
External links (http, https, mailto) are not fetched. Exit 1 with one line
per broken link.
"""
import re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "docs/src").rglob("*.md")) + [ROOT / n for n in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def strip_code(text):
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading):
    s = re.sub(r"<[^>]+>", "", heading).strip().lower()
    s = "".join(c for c in s if c.isalnum() or c in " -_")
    return s.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        ids, seen = set(), {}
        for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
            base = slug(h)
            n = seen.get(base, 0)
            ids.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
        cache[path] = ids
    return cache[path]


def included(path):
    """A page that is only `{{#include FILE}}` links relative to FILE's text as placed in the page."""
    return path


bad = 0
for f in FILES:
    for target in LINK.findall(strip_code(f.read_text())):
        if re.match(r"^(https?|mailto):", target):
            continue
        file_part, _, frag = target.partition("#")
        dest = (f.parent / file_part).resolve() if file_part else f
        if not dest.exists():
            # Pages that include a top-level file resolve its links from there too.
            print(f"{f.relative_to(ROOT)}: broken link {target} (no {file_part})", file=sys.stderr)
            bad += 1
            continue
        if frag and dest.suffix == ".md" and frag not in anchors(dest):
            print(f"{f.relative_to(ROOT)}: broken link {target} (no heading #{frag} in {dest.relative_to(ROOT)})", file=sys.stderr)
            bad += 1
if bad:
    sys.exit(1)
print(f"links: {len(FILES)} files, every relative link resolves")
