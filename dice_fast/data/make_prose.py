"""Rebuild ``prose.txt`` from the Python standard library's ``pydoc_data/topics.py``.

    python -m dice_fast.data.make_prose            # writes dice_fast/data/prose.txt

``pydoc_data/topics.py`` is the plain-text rendering of the Python Language Reference that ships
with CPython (PSF License; see README.md). This keeps only its running prose: paragraphs with one
indentation level (code and grammar blocks are indented further), no section headings, no grammar
productions, interactive sessions, comparisons, markup or URLs, mostly letters, at least 100
characters, ending with a full stop. Wrapped lines are joined and runs of spaces collapsed, list
markers dropped, so each paragraph is one line; paragraphs are separated by one blank line,
topics taken in sorted order, duplicates dropped. The output depends only on the ``topics.py`` it
reads (CPython 3.11.7 was used).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_BAD = re.compile(r"::=|>>>|[{}<>|\\]|https?:| = |==")
_LIST_MARKER = re.compile(r"^(\*|\d+\.)\s+")


def _blocks(text: str):
    block: list[str] = []
    for line in text.split("\n") + [""]:
        if line.strip():
            block.append(line)
        elif block:
            yield block
            block = []


def prose_paragraphs(topics: dict) -> list[str]:
    """topics: {name: text} -> the kept paragraphs, one string each, in sorted-topic order."""
    seen: set[str] = set()
    out: list[str] = []
    for key in sorted(topics):
        for block in _blocks(topics[key]):
            indents = {len(line) - len(line.lstrip()) for line in block}
            marker = _LIST_MARKER.match(block[0].lstrip())
            if len(indents) > 1 and not marker:
                continue  # mixed indentation: code, grammar or a table
            if any(set(line.strip()) <= set("*=-~^") for line in block):
                continue  # heading underline
            text = " ".join(line.strip() for line in block)
            text = _LIST_MARKER.sub("", re.sub(r"\s+", " ", text))
            if not text.endswith(".") or len(text) < 100 or _BAD.search(text):
                continue
            if sum(ch.isalpha() or ch == " " for ch in text) < 0.88 * len(text):
                continue
            if text not in seen:
                seen.add(text)
                out.append(text)
    return out


def main() -> int:
    from pydoc_data import topics as t

    paras = prose_paragraphs(t.topics)
    dest = Path(__file__).with_name("prose.txt")
    dest.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    print(f"{len(paras)} paragraphs, {dest.stat().st_size} bytes -> {dest} (Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
