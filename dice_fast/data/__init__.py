"""Data shipped with the package: real English prose (CPython's reference text, PSF licence) used by
the needle task and by the benchmark corpora."""

from pathlib import Path

PROSE_PATH = Path(__file__).with_name("prose.txt")


def prose() -> str:
    """The bundled prose: paragraphs separated by one blank line."""
    return PROSE_PATH.read_text(encoding="utf-8")
