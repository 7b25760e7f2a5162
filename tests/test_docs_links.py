"""Every relative link in README.md, CHANGELOG.md and docs/*.md resolves: the file exists, and a
``#anchor`` into a Markdown file names one of its headings (GitHub's slugs). Text only."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(["README.md", "CHANGELOG.md"]
               + [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))])
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+(?:\([^()\s]*\))?[^()\s]*)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _prose(text):
    """The text without fenced code blocks (links and headings there are not Markdown)."""
    return FENCE.sub("", text)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{1,2}(?=\S)|(?<=\S)[`*_]{1,2}", lambda m: m.group(0).replace("*", "")
                  .replace("`", ""), heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = text.lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    text = open(path, encoding="utf-8").read()
    for match in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", _prose(text), re.M):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return out


def links(page):
    text = _prose(open(os.path.join(ROOT, page), encoding="utf-8").read())
    text = CODE_SPAN.sub(lambda m: "" if "](" not in m.group(0) else m.group(0), text)
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        yield target


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    if not os.path.exists(os.path.join(ROOT, page)):
        pytest.skip(f"no {page}")
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path \
            else os.path.join(ROOT, page)
        if not os.path.exists(full):
            broken.append(f"{target} (no file)")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page}: " + "; ".join(broken)


def test_slug_follows_github():
    assert slug("Seconds, side by side: a fourth run, with Newton–Schulz's result (issue 33)") \
        == "seconds-side-by-side-a-fourth-run-with-newtonschulzs-result-issue-33"
    assert slug("Why `frequency=10` by default") == "why-frequency10-by-default"
