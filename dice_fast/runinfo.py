"""What a benchmark or evaluation row records about where it ran: device, versions, model label."""

from __future__ import annotations

import os
import platform
from .errors import InputError, writing
from .side_files import replace_file


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name with its family and model numbers (``cpuinfo``: "AMD EPYC, family
    26 model 2"; a virtual machine often names no generation, which these tell: 25/1 Zen 3, 25/17
    Zen 4, 26/2 Zen 5); else what ``platform`` says."""
    try:
        with open(cpuinfo, encoding="utf-8") as fh:
            fields = {}
            for line in fh:
                if not line.strip():  # the first processor's block is enough
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        name = fields["model name"]
    except (OSError, KeyError):
        return platform.processor() or platform.machine() or "cpu"
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    return name


def device_name(device) -> str:
    """A readable name of ``device``: the GPU's name, or the CPU model with core and thread counts."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def versions() -> dict:
    """Versions of torch, transformers and dice_fast."""
    import torch
    import transformers

    from . import __version__

    return {"torch": torch.__version__, "transformers": transformers.__version__, "dice_fast": __version__}


def minor_versions() -> dict:
    """{"torch": "2.13", "transformers": "5.24"}: the minor versions of the libraries whose code traces and
    runs the model (a model exported or a vector cached under one may differ under another)."""
    import torch
    import transformers

    minor = lambda v: ".".join(v.split("+")[0].split(".")[:2])  # noqa: E731
    return {"torch": minor(torch.__version__), "transformers": minor(transformers.__version__)}


def model_label(name_or_path: str) -> str:
    """A short label of a model path: its folder name, or the package name for a folder called "model"."""
    parts = str(name_or_path).rstrip("/").split("/")
    return parts[-2] if parts[-1] == "model" and len(parts) > 1 else parts[-1]


def check_csv(path) -> list[str] | None:
    """The header of the CSV at ``path`` (None when there is no such file or it is empty); ValueError
    naming the line when a row has more values than the header (rows appended by a version with more
    columns), since appending to or widening such a file would put values under the wrong names."""
    import csv
    from pathlib import Path

    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, [])
        for i, row in enumerate(reader, start=2):
            if len(row) > len(header):
                raise InputError(f"{path}:{i}: {len(row)} values under a header of {len(header)} columns; "
                                 "fix the file or write to another CSV")
    with open(path, "rb") as fh:
        fh.seek(-1, 2)
        if fh.read(1) != b"\n":  # the next row would continue it, its values under other columns
            raise InputError(f"{path}: its last line has no line end (a write cut off, the disk full?); remove "
                             "that line or write to another CSV")
    return header


def append_csv(rows: list[dict], path, fieldnames=None) -> int:
    """Append ``rows`` (dicts) to the CSV at ``path``. A new file gets the header ``fieldnames``
    (default: the first row's keys, then any new keys of later rows). An existing file keeps its
    header and column order; when the rows bring columns it lacks, the file is rewritten (to a
    temporary name, then renamed) with those columns added at the end and left empty in its old rows,
    so no value ever lands under another column's name (a file whose rows are already wider than
    its header is refused: `check_csv`, as is one whose last row was cut off). Appends run one at a
    time across processes (a flock on the folder), a failed one leaves the file as it was, and an
    OSError is a `WriteError` naming the file. Keys outside an explicit ``fieldnames`` are ignored.
    Returns the number of rows written."""
    from pathlib import Path

    from .folder_guard import folder_guard

    if not rows:
        return 0
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # appends by other processes wait (none is lost to a rewrite); unlocked where flock is refused (NFS)
        with folder_guard(path.parent, best_effort=True):
            _append_csv(rows, path, fieldnames)
    return len(rows)


def _append_csv(rows: list[dict], path, fieldnames) -> None:
    import csv
    import io
    import os

    wanted = list(fieldnames) if fieldnames else list(dict.fromkeys(k for r in rows for k in r))
    header = check_csv(path) or []
    missing = [k for k in wanted if k not in header]
    if header and not missing:
        text = io.StringIO(newline="")
        csv.DictWriter(text, fieldnames=header, extrasaction="ignore").writerows(rows)
        data = memoryview(text.getvalue().encode("utf-8"))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            try:
                while data:
                    data = data[os.write(fd, data):]
            except BaseException:  # a full disk: no partial row stays behind to merge with the next one
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
        return
    old_rows: list[dict] = []
    if header:
        with open(path, newline="", encoding="utf-8") as fh:
            old_rows = list(csv.DictReader(fh))
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=header + missing, extrasaction="ignore")
    w.writeheader()
    w.writerows(old_rows)
    w.writerows(rows)
    replace_file(path, text.getvalue().encode("utf-8"))
