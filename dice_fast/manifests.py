"""The manifest of a ``dice-fast encode`` output folder: its format, reading one, and which of a
folder's manifests make one finished job. The corpus jobs write them (`dice_fast.corpus.outputs`);
`load_embeddings` and the index read the shards they list, only when the job is finished."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .errors import InputError, MissingFile

MANIFEST_FORMAT = "dice_fast.embeddings/1"
# the keys every manifest a job writes has and its readers index, with their types
_SHAPE = {"status": str, "rows": int, "split": {"index": int, "count": int}, "model": {"dim": int},
          "shards": [{"file": str, "rows": int, "bytes": int, "sha256": str}]}


def read_manifest(path: Path) -> dict:
    """The manifest at ``path``; InputError naming it when it is unreadable, not ours, or damaged (a key
    its readers need is missing or of another type, or a shard is named by a path, not a file name)."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: malformed JSON, or bytes that are not UTF-8
        raise InputError(f"cannot read {path}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{path} is not a dice_fast manifest (format {MANIFEST_FORMAT})")
    _check_shape(path, manifest, _SHAPE, "")
    for i, shard in enumerate(manifest["shards"]):
        if shard["file"] != Path(shard["file"]).name or shard["file"] in ("", ".", ".."):
            raise InputError(f"{path}: damaged manifest: shards[{i}].file {shard['file']!r} is not a file name")
    return manifest


def _check_shape(path: Path, value, shape, key: str) -> None:
    """InputError naming ``path`` and the key unless ``value`` has ``shape`` (a type, a dict of keys'
    shapes, or a one-item list: a list of items of that shape)."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            raise InputError(f"{path}: damaged manifest: {key} is {type(value).__name__}, expected an object")
        for name, inner in shape.items():
            where = f"{key}.{name}" if key else name
            if name not in value:
                raise InputError(f"{path}: damaged manifest: no key {where!r}")
            _check_shape(path, value[name], inner, where)
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise InputError(f"{path}: damaged manifest: {key} is {type(value).__name__}, expected a list")
        for i, item in enumerate(value):
            _check_shape(path, item, shape[0], f"{key}[{i}]")
    elif isinstance(value, bool) or not isinstance(value, shape):
        raise InputError(f"{path}: damaged manifest: {key} is {type(value).__name__}, expected {shape.__name__}")


def finished_manifests(folder: Path, allow_incomplete: bool = False) -> list[dict]:
    """The manifests of the output folder ``folder`` in split order: ``manifest.json`` alone, or the
    ``manifest-IofN.json`` of every ``--shard I/N`` split. InputError unless every split is there and
    complete (``allow_incomplete``: an unsplit job's may be unfinished)."""
    manifests = sorted(Path(folder).glob("manifest*.json"))
    if not manifests:
        raise InputError(f"no manifest*.json in {folder}: not an output folder of dice-fast encode")
    read = {p.name: read_manifest(p) for p in manifests}
    # a complete manifest that replaced an output of another split layout names its old manifests by
    # name and sha256 (a job killed before removing them leaves them): those are not part of this output;
    # before 0.3 by name alone (a list), honoured from the manifests still standing (a stale one hides nothing)
    replaced = {(name, digest) for m in read.values() if m["status"] == "complete"
                and isinstance(m.get("replaces"), dict) for name, digest in m["replaces"].items()}
    manifests = [p for p in manifests if not replaced or (p.name, file_sha256(p)) not in replaced]
    by_name = {name for p in manifests if read[p.name]["status"] == "complete"
               and isinstance(read[p.name].get("replaces"), list) for name in read[p.name]["replaces"]
               if isinstance(name, str)}
    manifests = [p for p in manifests if p.name not in by_name]
    if not manifests:
        raise InputError(f"{folder}: every manifest*.json there is named replaced by another; encode again with "
                         "--overwrite")
    if len(manifests) == 1 and manifests[0].name == "manifest.json":
        m = read[manifests[0].name]
        if m["status"] != "complete" and not allow_incomplete:
            raise InputError(f"{manifests[0]}: the job is not complete ({m['rows']} rows committed)")
        return [m]
    splits = [read[p.name] for p in manifests]
    count = splits[0]["split"]["count"]
    have = {m["split"]["index"]: m for m in splits if m["split"]["count"] == count}
    if len(have) != len(splits) or sorted(have) != list(range(count)):
        raise InputError(f"{folder}: split manifests {[p.name for p in manifests]} are not the {count} splits of one job")
    first = _vectors_made_by(have[0])
    for i in range(count):
        if have[i]["status"] != "complete":
            raise InputError(f"{folder}: split {i}/{count} is not complete ({have[i]['rows']} rows committed)")
        if (theirs := _vectors_made_by(have[i])) != first:
            differ = sorted(k for k in set(theirs) | set(first) if theirs.get(k) != first.get(k))
            raise InputError(f"{folder}: split {i}/{count} was made with other settings than split 0/{count} "
                             f"({', '.join(differ)}): the splits are not one job's (run them with the same options)")
    return [have[i] for i in range(count)]


def file_sha256(path: Path, fsync: bool = False) -> str:
    """Hex sha256 of the file's bytes (read in 1 MiB blocks); ``fsync``: also flush it to disk."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
        if fsync:
            os.fsync(fh.fileno())
    return h.hexdigest()


def checked_shards(folder: Path, manifest: dict, digest: bool = True) -> list[Path]:
    """The shard files ``manifest`` lists, each checked against what it recorded at commit: there, of
    its size and (``digest``) of its sha256 (a flipped byte in a vector would otherwise read back as a
    wrong value: Parquet pages written without checksums carry none). `MissingFile` / `InputError`
    naming the file."""
    files = []
    for shard in manifest["shards"]:
        f = Path(folder) / shard["file"]
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise MissingFile(f"{f}: missing (its manifest lists it)") from None
        if size != shard["bytes"]:
            raise InputError(f"{f}: {size} bytes, not the {shard['bytes']} recorded when it was committed (truncated "
                             "or replaced)")
        if digest and file_sha256(f) != shard["sha256"]:
            raise InputError(f"{f}: damaged (its sha256 is not the {shard['sha256'][:12]}... recorded when it was "
                             "committed)")
        files.append(f)
    return files


def _vectors_made_by(manifest: dict) -> dict:
    """What shapes a split's vectors: its kind, model and options, less those that change only speed or
    the machine (splits may run with another batch budget or device)."""
    from .config import DiceConfig

    loose = set(DiceConfig.options_of("speed")) | {"device"}
    options = manifest.get("options") if isinstance(manifest.get("options"), dict) else {}
    return {"kind": manifest.get("kind"), "model.dim": manifest["model"]["dim"],
            **{f"options.{k}": v for k, v in options.items() if k not in loose}}


__all__ = ["MANIFEST_FORMAT", "checked_shards", "file_sha256", "finished_manifests", "read_manifest"]
