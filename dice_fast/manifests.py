"""The manifest of a ``dice-fast encode`` output folder: its format, reading one, and which of a
folder's manifests make one finished job. The corpus jobs write them (`dice_fast.corpus.outputs`);
`load_embeddings` and the index read the shards they list, only when the job is finished."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError

MANIFEST_FORMAT = "dice_fast.embeddings/1"


def read_manifest(path: Path) -> dict:
    """The manifest at ``path``; InputError naming it when it is unreadable or not ours."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{path} is not a dice_fast manifest (format {MANIFEST_FORMAT})")
    return manifest


def finished_manifests(folder: Path, allow_incomplete: bool = False) -> list[dict]:
    """The manifests of the output folder ``folder`` in split order: ``manifest.json`` alone, or the
    ``manifest-IofN.json`` of every ``--shard I/N`` split. InputError unless every split is there and
    complete (``allow_incomplete``: an unsplit job's may be unfinished)."""
    manifests = sorted(Path(folder).glob("manifest*.json"))
    if not manifests:
        raise InputError(f"no manifest*.json in {folder}: not an output folder of dice-fast encode")
    if len(manifests) == 1 and manifests[0].name == "manifest.json":
        m = read_manifest(manifests[0])
        if m["status"] != "complete" and not allow_incomplete:
            raise InputError(f"{manifests[0]}: the job is not complete ({m['rows']} rows committed)")
        return [m]
    splits = [read_manifest(p) for p in manifests]
    count = splits[0]["split"]["count"]
    have = {m["split"]["index"]: m for m in splits if m["split"]["count"] == count}
    if len(have) != len(splits) or sorted(have) != list(range(count)):
        raise InputError(f"{folder}: split manifests {[p.name for p in manifests]} are not the {count} splits of one job")
    for i in range(count):
        if have[i]["status"] != "complete":
            raise InputError(f"{folder}: split {i}/{count} is not complete ({have[i]['rows']} rows committed)")
    return [have[i] for i in range(count)]


__all__ = ["MANIFEST_FORMAT", "finished_manifests", "read_manifest"]
