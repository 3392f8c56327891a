"""The names of the hidden files dice_fast puts beside an output (its lock, its temporaries): each is the
output's name with a few bytes around it, or a digest of that name where they would pass what one file
name holds."""

from __future__ import annotations

import hashlib

NAME_MAX = 255  # bytes of one file name (Linux, macOS)


def side_stem(name: str, extra: int) -> str:
    """``name`` as the stem of a hidden file beside it, ``extra`` bytes longer (a temporary, a lock):
    itself when that fits a file name, else a digest of it (an output named with 239-255 bytes was
    refused, "File name too long", naming a lock file the user never gave)."""
    raw = name.encode("utf-8", "surrogateescape")
    return name if len(raw) + extra <= NAME_MAX else "~" + hashlib.sha256(raw).hexdigest()[:32]
