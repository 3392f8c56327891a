"""One ``dice-fast encode`` job: read a corpus as a stream, encode it, write it, and survive interruption.

The order of work is chosen so that mistakes cost nothing: the input is opened and checked (type,
Parquet columns), the output is checked (overwrite, resume, writable) and, on ``--resume``, the
options are compared with the interrupted run's manifest, all before the model loads; then the model
loads, the committed documents are skipped (read and hashed, not encoded, and compared with what the
manifest recorded), and encoding streams into the writer.

SIGINT and SIGTERM raise `Interrupted` in the main thread (held off while a commit renames files),
the reader stops, temporary files are removed, committed shards stay, and the command prints one
line and exits 2.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections import deque
from dataclasses import asdict
from pathlib import Path

from .chunk_rows import ChunkRows
from ..errors import InputError, OptionError, WriteError, writing
from ..manifests import MANIFEST_FORMAT, checked_shards, read_manifest
from ..progress import print_done
from ..side_files import NAME_MAX
from .outputs import (NpyWriter, ParquetFileWriter, ShardWriter, file_temps, ids_path_for, manifest_name,
                      our_files, parse_tag, split_tag)
from .ids import DuplicateIds
from .lock import OutputLock
from .model import load_encoder
from .readers import Corpus, ReadProgress, open_corpus
from .resume import compare_settings, skip_committed, text_digest
from .query_blocks import QueryBlocks
from .signals import Interrupted, Signals, one_line_warnings

OUTPUT_TYPES = ".npy (with NAME.ids.txt beside it), .parquet, or a folder of Parquet shards (DIR/)"


def output_type(path: str) -> str:
    """"npy", "parquet" or "folder" for an ``--output`` value (ValueError for anything else)."""
    p = Path(path)
    if path.endswith(("/", os.sep)) or p.is_dir():
        return "folder"
    suffix = p.suffix.lower()
    if suffix in (".npy", ".parquet"):
        return suffix[1:]
    if suffix == "":
        if p.exists():
            raise ValueError(f"--output {path} exists and is not a folder")
        return "folder"
    raise ValueError(f"--output {path}: unknown output type {suffix!r}; known: {OUTPUT_TYPES}")


def parse_split(text: str | None) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N; ``None`` -> (0, 1)."""
    if text is None:
        return 0, 1
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes INDEX/COUNT, e.g. 0/4; got {text!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"--shard {text}: INDEX must be in 0..COUNT-1")
    return index, count


# ---------------------------------------------------------------------------------------------
class EncodeJob:
    def __init__(self, args):
        self.args = args
        self.kind = "queries" if args.queries else "documents"
        self.split = parse_split(args.shard)
        self.tag = split_tag(*self.split)
        self.out_type = output_type(args.output)
        self.out = Path(args.output)
        self.created_dirs: list[Path] = []
        self.writer = None
        self.lock: OutputLock | None = None
        self.resume_from: dict | None = None
        self.to_remove: list[Path] = []
        self.stop = threading.Event()
        if args.shard_rows < 1:
            raise ValueError(f"--shard-rows must be at least 1, got {args.shard_rows}")
        if args.resume and args.overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        if args.resume and self.out_type != "folder":
            raise ValueError(f"--resume needs a shard folder output (-o DIR/), not {args.output}")
        self.chunks = bool(getattr(args, "chunks", False))
        if self.chunks and (self.out_type == "npy" or self.kind == "queries"):
            raise ValueError("--chunks needs documents written to a .parquet or a folder output (a .npy holds one "
                             f"vector per row), not {'--queries' if self.kind == 'queries' else args.output}")

    # -----------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job; on SIGINT/SIGTERM clean up, print one line and return 2. Other errors propagate
        (after the same clean-up) for the command to report."""
        import sys

        with Signals(self.stop) as signals, one_line_warnings():
            try:
                return self._run(signals)
            except (Interrupted, KeyboardInterrupt) as exc:
                self._clean_up()
                name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
                print(f"dice-fast: interrupted by {name}; {self._kept()}", file=sys.stderr)
                return 2
            except WriteError as exc:  # a full disk: what is kept, and how to go on, as for an interrupt
                kept = self._kept()
                self._clean_up()
                failed = WriteError(f"{exc}; {kept}")
                failed.errno = exc.errno
                raise failed from exc
            except BaseException:
                self._clean_up()
                raise
            finally:
                self._unlock()

    def _clean_up(self) -> None:
        self.stop.set()
        if self.writer is not None:
            self.writer.abort()
        self._unlock()
        self._remove_created_dirs()

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _kept(self) -> str:
        if self.args.overwrite and (self.to_remove or (self.out_type != "folder" and self.out.exists())):
            return f"no output written; {self.out} still holds the previous output"
        if isinstance(self.writer, ShardWriter):
            shards = self.writer.manifest["shards"]
        else:  # stopped before the writer opened: a resumed output still holds what it committed
            shards = self.resume_from["shards"] if self.resume_from is not None else []
        if shards:
            return (f"{sum(s['rows'] for s in shards):,} rows in {len(shards)} shards are committed in {self.out}; "
                    "continue with --resume")
        return "no output written"

    def _run(self, signals: Signals) -> int:
        args = self.args
        t0 = time.perf_counter()
        outputs = [self.out] + ([ids_path_for(self.out)] if self.out_type == "npy" else [])
        corpus = open_corpus(args.input, args.format, args.field, args.id_field, exclude=outputs)
        corpus.stop = self.stop
        requested = self._requested(corpus)
        self._prepare_output(requested)
        if self.resume_from is not None and self.resume_from.get("status") == "complete":
            print(f"nothing to do: {self.out / manifest_name(self.tag)} is complete ({self.resume_from['rows']} rows)")
            return 0
        enc = load_encoder(args)
        resolved = {**requested, **_resolved(enc)}
        if self.resume_from is not None:
            compare_settings(_pinned(self.resume_from), _pinned(resolved), ("model", "config"),
                             self.out / manifest_name(self.tag))
        records = corpus.records()
        if self.split[1] > 1:
            records = _take_split(records, *self.split)
        skipped = 0
        duplicates = DuplicateIds()
        if self.resume_from is not None:
            records, skipped = skip_committed(records, self.resume_from["shards"], self.out, duplicates.add)
        with writing(self.out):
            self._open_writer(resolved, signals)
        from ..progress import ProgressBar

        stats_before, started = enc.chunk_stats.snapshot(), time.perf_counter()  # rates count from here
        bar = ProgressBar(None, desc=f"encode {self.kind}", show=not args.quiet)
        progress = ReadProgress(bar, corpus)
        pending: deque = deque()
        queries = None

        def texts():
            for doc_id, text in records:
                pending.append((doc_id, text_digest(text)))
                progress.offsets.append(corpus.bytes_read)
                yield text

        try:
            if self.kind == "documents":
                blocks = enc.stream_documents(texts(), return_chunks=self.chunks, progress=progress)
            else:
                blocks = queries = QueryBlocks(enc, texts(), progress)
            rows = 0
            for block in blocks:
                chunks = ChunkRows.of_output(block) if self.chunks else None
                block = block.documents if self.chunks else block
                items = [pending.popleft() for _ in range(len(block))]
                ids = [i for i, _ in items]
                if queries is not None:
                    queries.note(ids)
                duplicates.add(ids)
                with writing(self.out):
                    self.writer.write(ids, [d for _, d in items], block, *([chunks] if self.chunks else []))
                rows += len(block)
        finally:
            bar.close()
        if queries is not None:
            queries.warn()  # after the bar, on a line of its own
        seconds, encoding = (now := time.perf_counter()) - t0, max(1e-6, now - started)  # one clock reading
        summary = {"rows": skipped + rows, "encoded": rows, "tokens": bar.tokens, "seconds": round(seconds, 3),
                   "encode_seconds": round(encoding, 3),
                   "blank_lines": corpus.blank_lines, "duplicate_ids": duplicates.count,
                   **_chunk_summary(stats_before, enc.chunk_stats.snapshot())}
        with signals.critical(), writing(self.out):
            self.writer.finish(enc.dim, summary)
            signals.pending = None  # a signal during the final commit comes too late to stop anything
        self.writer = None
        self._print_summary(enc, rows, skipped, bar.tokens, (seconds, encoding), corpus.blank_lines, summary)
        if duplicates.count:
            warnings.warn(duplicates.message(), UserWarning, stacklevel=1)
        return 0

    # -----------------------------------------------------------------------------------------
    def _requested(self, corpus: Corpus) -> dict:
        """What the user asked for, comparable before the model loads."""
        from .. import __version__
        from ..cliargs import encoder_options

        args = self.args
        model = args.model
        if model is not None and Path(model).expanduser().exists():
            model = str(Path(model).expanduser().resolve())
        options = encoder_options(args)
        options["device"] = None if args.device is None else str(args.device).split(":")[0]
        return {
            "format": MANIFEST_FORMAT,
            "dice_fast": __version__,
            "kind": self.kind,
            "split": {"index": self.split[0], "count": self.split[1]},
            "shard_rows": args.shard_rows,
            "input": {**corpus.fingerprint(), "read_as": args.format, "text_field": args.field,
                      "id_field": args.id_field},
            "options": {"model": model or "(bundled all-MiniLM-L6-v2)", **options,
                        **({"chunks": True} if self.chunks else {})},
        }

    def _prepare_output(self, requested: dict) -> None:
        args, out = self.args, self.out
        if self.out_type != "folder":
            targets = [out] + ([ids_path_for(out)] if self.out_type == "npy" else [])
            for t in targets:
                if len(os.fsencode(t.name)) > NAME_MAX:  # the ids beside an .npy: 4 bytes more than its name
                    raise OptionError(f"--output {out.name!r} is too long a name: its ids go to {t.name!r} beside it, "
                                      f"more than the {NAME_MAX} bytes of a file name; an .npy name holds at most "
                                      f"{NAME_MAX - 4} bytes")
                if t.is_dir():
                    raise ValueError(f"--output {t} is a folder; give a file name or DIR/ for shards")
            self._make_dirs(out.parent)
            _check_writable(out.parent)
            self.lock = OutputLock.for_file(out).acquire()  # a live job on this file: refused naming it
            for stale in (p for t in targets for p in file_temps(t)):  # a killed run's (the lock is ours)
                stale.unlink(missing_ok=True)
            for t in targets:
                if os.path.lexists(t) and not args.overwrite:  # a dangling link too: replaced only when asked
                    raise ValueError(f"{t} exists{' (a link to nothing)' if not t.exists() else ''}; pass "
                                     "--overwrite to replace it")
            return
        self._make_dirs(out)
        _check_writable(out)
        self.lock = OutputLock.for_folder(out, *self.split).acquire()  # before reading what another job writes
        mine = out / manifest_name(self.tag)
        if args.resume and mine.exists():
            self.resume_from = read_manifest(mine)
            compare_settings(_pinned(self.resume_from), _pinned(requested), ("format", "dice_fast", "kind", "split",
                                                                        "shard_rows", "input", "options"), mine)
            try:
                checked_shards(out, self.resume_from)
            except InputError as exc:
                raise InputError(f"cannot resume {mine}: committed shard {exc}; start again with --overwrite") from None
            committed = {s["file"] for s in self.resume_from["shards"]} | {mine.name}
            for p in our_files(out):
                if parse_tag(p.name) == (None if not self.tag else self.split) and p.name not in committed:
                    p.unlink()  # a temporary or uncommitted shard of the interrupted run
            return
        conflicts = [p for p in our_files(out) if self._conflicts(p.name)]
        if args.resume:  # nothing committed yet: start afresh, dropping only this split's uncommitted files
            own = None if not self.tag else self.split
            self.to_remove = [p for p in conflicts if parse_tag(p.name) == own]
            conflicts = [p for p in conflicts if parse_tag(p.name) != own]
        if conflicts and not args.overwrite:
            names = ", ".join(p.name for p in conflicts[:4]) + (" ..." if len(conflicts) > 4 else "")
            raise ValueError(f"{out} already holds output of dice-fast encode ({names}); pass --resume to continue "
                             "it or --overwrite to replace it")
        self.to_remove += conflicts

    def _conflicts(self, name: str) -> bool:
        """Whether a file of ours in the output folder belongs to (or contradicts) this job's split."""
        tag = parse_tag(name)
        if self.split[1] == 1 or tag is None:
            return True
        return tag == self.split or tag[1] != self.split[1]

    def _open_writer(self, resolved: dict, signals: Signals) -> None:
        if self.out_type == "npy":
            self.writer = NpyWriter(self.out)
        elif self.out_type == "parquet":
            self.writer = ParquetFileWriter(self.out, resolved, chunks=self.chunks)
        else:
            if not self.args.overwrite:  # --resume of nothing: its leftovers go now
                for p in self.to_remove:
                    p.unlink(missing_ok=True)
            manifest = dict(resolved)
            if self.resume_from is not None:
                manifest["shards"] = list(self.resume_from["shards"])
            replace = self.to_remove if self.args.overwrite and self.to_remove else None  # kept until finish
            self.writer = ShardWriter(self.out, self.tag, self.args.shard_rows, manifest, guard=signals.critical,
                                      chunks=self.chunks, replace=replace)

    def _make_dirs(self, folder: Path) -> None:
        missing = []
        p = folder.resolve()
        while not p.exists():
            missing.append(p)
            p = p.parent
        folder.mkdir(parents=True, exist_ok=True)
        self.created_dirs = missing  # deepest first

    def _remove_created_dirs(self) -> None:
        for d in self.created_dirs:
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: committed shards keep their folder

    def _print_summary(self, enc, rows, skipped, tokens, times, blank_lines, summary) -> None:
        """Rates over the encoding (``times``: the job's seconds, the encoding's); tokens the model ran."""
        from ..runinfo import model_label

        c = enc.config
        where = self.out if self.out_type != "folder" else self.out / manifest_name(self.tag)
        extra = f"; {skipped:,} already committed (resumed)" if skipped else ""
        if blank_lines:
            extra += f"; skipped {blank_lines:,} blank line{'s' if blank_lines > 1 else ''}"
        if self.split[1] > 1:
            extra += f"; split {self.split[0]}/{self.split[1]}"
        if enc.cache is not None or summary["chunks_deduplicated"]:
            extra += (f"; chunks: {summary['chunks_computed']:,} computed, {summary['chunks_from_cache']:,} from "
                      f"cache, {summary['chunks_deduplicated']:,} duplicates")
        print_done(
            f"encoded {rows:,} {self.kind if rows != 1 else {'documents': 'document', 'queries': 'query'}[self.kind]} "
            f"in {times[0]:.2f} s ({times[0] - times[1]:.2f} s opening the model and input, then "
            f"{rows / times[1]:,.1f} docs/s, {tokens / times[1]:,.0f} tokens/s; {tokens:,} tokens run incl. special "
            f"tokens) -> {where} "
            f"({skipped + rows} x {enc.dim} float32){extra} [{model_label(enc.spec.name)}, {enc.device}, "
            f"{enc.precision}, attention={enc.backend}, strategy={c.strategy}, "
            f"chunk_size={c.chunk_size}, aggregation={c.aggregation}]"
        )


# ---------------------------------------------------------------------------------------------
def _resolved(enc) -> dict:
    from ..runinfo import model_label

    config = asdict(enc.config)
    config["device"] = enc.device.type
    return {"model": {"name": enc.spec.name, "label": model_label(enc.spec.name), "dim": enc.dim}, "config": config}


def _pinned(manifest: dict) -> dict:
    """``manifest`` (or this run's settings) without the options a resumed job may change: those that
    change only how fast the vectors come (`DiceConfig.options_of("speed")`: a job that ran out of
    memory resumes with a smaller ``--max-batch-tokens``). Precision options stay pinned."""
    from ..config import DiceConfig

    speed = set(DiceConfig.options_of("speed"))
    pinned = dict(manifest)
    for key in ("options", "config"):
        if isinstance(manifest.get(key), dict):
            pinned[key] = {k: v for k, v in manifest[key].items() if k not in speed}
    return pinned


def _chunk_summary(before: dict, after: dict) -> dict:
    """Chunks the job computed, took from the persistent cache, and shared with an identical chunk
    (queued at once, or met earlier in the same window stream)."""
    d = {k: after[k] - before[k] for k in after}
    return {"chunks_computed": d["computed"], "chunks_from_cache": d["disk_hits"],
            "chunks_deduplicated": d["deduplicated"] + d["memory_hits"]}


def _take_split(records, index: int, count: int):
    """Documents ``index, index + count, index + 2 count`` ... of the stream."""
    for d, record in enumerate(records):
        if d % count == index:
            yield record


def _check_writable(folder: Path) -> None:
    import tempfile

    with writing(folder):
        fd, probe = tempfile.mkstemp(prefix=".dice-fast-probe.", dir=folder)
    os.close(fd)
    os.unlink(probe)
