"""Resuming a corpus job: is this run the interrupted one (`compare_settings`), and reading past the
documents its committed shards hold, checking they are the same (`skip_committed`)."""

from __future__ import annotations

import hashlib
import struct
from itertools import islice
from pathlib import Path


def text_digest(text: str) -> bytes:
    """A digest of one document's text, fed with its id to a shard's input hash (what ``--resume`` checks)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def update_input_hash(h, doc_id: str, digest: bytes) -> None:
    """Add one record (its id and text digest) to a running sha256 ``h``, unambiguously."""
    raw = doc_id.encode("utf-8", "surrogatepass")
    h.update(struct.pack("<Q", len(raw)))
    h.update(raw)
    h.update(digest)


def _flatten(value, prefix: str = "") -> dict:
    """``{"a": {"b": [{"c": 1}]}}`` -> ``{"a.b[0].c": 1}`` (so that a difference names its setting)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value:
        out = {f"{prefix}.length": len(value)}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def compare_settings(before: dict, now: dict, keys: tuple[str, ...], where: Path) -> None:
    """ValueError listing every setting in ``keys`` that differs between a manifest and this run."""
    old = _flatten({k: before.get(k) for k in keys})
    new = _flatten({k: now.get(k) for k in keys})
    diffs = [f"{k} is {new.get(k)!r}, was {old.get(k)!r}" for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k)]
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        raise ValueError(f"cannot resume {where}: this run differs from the interrupted one: {shown} "
                         "(run with the same options and input, or start again with --overwrite)")


def skip_committed(records, shards: list[dict], folder: Path, on_ids):
    """Read past the documents of the committed ``shards`` (not encoding them), checking that they are
    the same documents (ids and texts) as when committed; ``on_ids(ids)`` gets each shard's ids.
    Returns (the rest of the stream, count)."""
    it = iter(records)
    skipped = 0
    for shard in shards:
        h = hashlib.sha256()
        ids = []
        for doc_id, text in islice(it, shard["rows"]):
            update_input_hash(h, doc_id, text_digest(text))
            ids.append(doc_id)
        on_ids(ids)
        n = len(ids)
        skipped += n
        if n < shard["rows"]:
            raise ValueError(f"cannot resume {folder}: the input now has {skipped} documents, fewer than the "
                             f"{sum(s['rows'] for s in shards)} already committed")
        if h.hexdigest() != shard["input_sha256"]:
            raise ValueError(f"cannot resume {folder}: the input changed: the documents of committed shard "
                             f"{shard['file']} (ids {shard['first_id']} .. {shard['last_id']}) differ from the "
                             "input's now; start again with --overwrite")
    return it, skipped
