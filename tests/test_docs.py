"""The documentation stays true: generated pages are current, every option has its line, the
README's Python example runs, and every relative link in README.md and docs/*.md leads somewhere."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages other branches are writing (issue 23), linked from the README's map before they are merged.
# Each entry must go once its page exists: test_expected_pages_are_still_missing fails until it does.
EXPECTED_LATER = {
    "docs/architecture.md",  # the data flow, file by file (branch core)
    "docs/cpu.md",  # CPU speed (branch cpu)
}


def make_docs():
    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "docs" / "make_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current():
    docs = make_docs()
    stale = [str(p.relative_to(ROOT)) for p, text in docs.generated().items() if not docs.is_current(p, text)]
    assert not stale, f"{stale} stale: run python docs/make_docs.py"


def test_every_option_has_a_line_in_the_options_table():
    from dice_fast.config import DiceConfig

    text = (ROOT / "docs" / "python.md").read_text(encoding="utf-8")
    table = text.split("<!-- options:begin", 1)[1].split("<!-- options:end -->", 1)[0]
    missing = [f.name for f in dataclasses.fields(DiceConfig) if f"| `{f.name}` |" not in table]
    assert not missing, f"options without a line in docs/python.md: {missing} (run python docs/make_docs.py)"


def test_cli_page_has_every_subcommand_and_flag():
    from dice_fast.cli import build_parser

    docs = make_docs()
    page = docs._flags_by_command((ROOT / "docs" / "cli.md").read_text(encoding="utf-8"))
    parser = build_parser()
    for command in docs.subcommands(parser):
        assert f"dice-fast {command}" in page, command
        assert "--chunk-size" in page[f"dice-fast {command}"] or command == "search"


def test_a_stale_cli_page_is_detected(tmp_path):
    docs = make_docs()
    text = docs.cli_markdown()
    page = tmp_path / "cli.md"
    page.write_text(text.replace("--pooling-impl", "--pooling-implementation"), encoding="utf-8")
    assert docs.is_current(page, text) is False
    page.write_text(text, encoding="utf-8")
    assert docs.is_current(page, text)


def test_readme_python_example_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["docs"].shape == (2, scope["enc"].dim)
    assert scope["scores"][0, 0] > scope["scores"][0, 1]  # the pass key's document ranks first


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = _slug(heading)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(page):
    broken = []
    for link in _links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if not path.exists():
            if rel not in EXPECTED_LATER:
                broken.append(f"{link} (no {rel})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no heading #{anchor} in {rel})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_expected_pages_are_still_missing():
    arrived = sorted(p for p in EXPECTED_LATER if (ROOT / p).exists())
    assert not arrived, f"{arrived} exist now: remove them from EXPECTED_LATER in tests/test_docs.py"


def test_pages_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages missing from the README's map: {unlinked}"
