"""Command line: ``dice-fast encode INPUT --output OUT.npy`` (and the evaluation tools).

Input is read and checked in full before any encoding starts, so a malformed line is reported by its
number and no output file is written; the output is written to a temporary file in the target folder
and renamed into place only when every document has been encoded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from .config import AGGREGATIONS, ATTENTION_BACKENDS, ATTENTION_MODES, POOLINGS, POSITIONS, STRATEGIES
from .runinfo import model_label
from .textio import read_json_objects, read_lines


def read_documents(path: str, fmt: str = "auto", field: str = "text") -> list[str]:
    """Documents from a .txt file (one per line) or a .jsonl file (``field`` of each object).

    In .jsonl, blank lines are skipped; any other line must be a JSON object whose ``field`` is a
    string. In .txt every line is a document (an empty line is an empty document). A malformed line
    raises ValueError naming the file and line.
    """
    if fmt == "auto":
        fmt = "jsonl" if path.endswith((".jsonl", ".ndjson")) else "txt"
    if fmt == "txt":
        return [line for _, line in read_lines(path)]
    if fmt != "jsonl":
        raise ValueError(f"unknown input format {fmt!r}; allowed: auto, txt, jsonl")
    docs: list[str] = []
    for where, record in read_json_objects(path):
        if field not in record:
            raise ValueError(f"{where}: no field {field!r} (fields: {', '.join(map(str, record)) or 'none'})")
        if not isinstance(record[field], str):
            raise ValueError(f"{where}: field {field!r} is {type(record[field]).__name__}, expected a string")
        docs.append(record[field])
    return docs


def _encoder_options(args) -> dict:
    opts = {
        "chunk_size": args.chunk_size,
        "overlap": args.overlap,
        "positions": args.positions,
        "pooling": args.pooling,
        "aggregation": args.aggregation,
        "top_k": args.top_k,
        "temperature": args.temperature,
        "normalize_chunks": args.normalize_chunks,
        "normalize": not args.no_normalize,
        "strategy": args.strategy,
        "attention": args.attention,
        "attention_backend": args.attention_backend,
        "document_prefix": args.document_prefix,
        "query_prefix": args.query_prefix,
        "max_chunks_per_document": args.max_chunks_per_document,
        "max_length": args.max_length,
        "max_batch_tokens": args.max_batch_tokens,
        "device": args.device,
        "dtype": args.dtype,
    }
    return opts


def add_encoder_arguments(p: argparse.ArgumentParser) -> None:
    """The model and DICE options shared by every sub-command."""
    g = p.add_argument_group("model and DICE options")
    g.add_argument("--model", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    g.add_argument("--chunk-size", type=int, default=None,
                   help="tokens of document text per chunk (default: min(256, model window - special tokens))")
    g.add_argument("--overlap", type=int, default=0, help="tokens shared by consecutive chunks (default 0)")
    g.add_argument("--positions", choices=POSITIONS, default="local",
                   help="local: restart per chunk (DICE); global: chunk offset in the document (ablation)")
    g.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="token -> chunk pooling (default: the model's sentence-transformers setting, else mean)")
    g.add_argument("--aggregation", choices=AGGREGATIONS, default="mean", help="chunk -> document (default mean)")
    g.add_argument("--top-k", type=int, default=2, help="chunks kept by topk_norm (default 2)")
    g.add_argument("--temperature", type=float, default=1.0, help="temperature of softmax_norm (default 1.0)")
    g.add_argument("--normalize-chunks", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise chunk vectors before aggregating (default: when the model ends in Normalize)")
    g.add_argument("--no-normalize", action="store_true", help="do not L2-normalise the output vectors")
    g.add_argument("--strategy", choices=STRATEGIES, default="dice",
                   help="dice, or single: the single-vector baseline (first window of each document)")
    g.add_argument("--attention", choices=ATTENTION_MODES, default="model default",
                   help="causal or bidirectional attention (default: the model's own)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="varlen attention implementation (default: best available)")
    g.add_argument("--document-prefix", default="", help='text put in every chunk, e.g. "passage: "')
    g.add_argument("--query-prefix", default="", help='text put before every query, e.g. "query: "')
    g.add_argument("--max-chunks-per-document", type=int, default=None, help="keep only the first N chunks")
    g.add_argument("--max-length", type=int, default=None, help="model window in tokens, specials included")
    g.add_argument("--max-batch-tokens", type=int, default=None,
                   help="tokens per packed forward (default 4096 on CPU, 65536 on CUDA)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="model precision (default: bfloat16 on CUDA, float32 on CPU)")


def make_encoder(args):
    from .engine import DiceEncoder

    return DiceEncoder.from_pretrained(args.model, **_encoder_options(args))


def cmd_encode(args) -> int:
    import numpy as np

    from .engine import ProgressBar

    docs = read_documents(args.input, args.format, args.field)
    out_path = Path(args.output)
    if out_path.suffix != ".npy":
        raise ValueError(f"--output must end in .npy, got {args.output}")
    enc = make_encoder(args)
    out_dir = out_path.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp.npy", dir=out_dir)
    os.close(fd)
    t0 = time.perf_counter()
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(docs), enc.dim))
        bar = ProgressBar(len(docs), desc="encode", show=not args.quiet)
        try:
            for lo in range(0, len(docs), args.block_documents):
                hi = min(lo + args.block_documents, len(docs))
                out[lo:hi] = enc.encode_documents(docs[lo:hi], progress=bar)
        finally:
            bar.close()
        out.flush()
        del out
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    seconds = time.perf_counter() - t0
    print(
        f"encoded {len(docs):,} documents ({bar.tokens:,} tokens incl. special tokens) in {seconds:.2f} s: "
        f"{len(docs) / seconds:,.1f} docs/s, {bar.tokens / seconds:,.0f} tokens/s -> {out_path} "
        f"({len(docs)} x {enc.dim} float32) [{model_label(enc.spec.name)}, {enc.device}, "
        f"{str(enc.dtype).replace('torch.', '')}, attention={enc.backend}, strategy={enc.config.strategy}, "
        f"chunk_size={enc.config.chunk_size}, aggregation={enc.config.aggregation}]"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dice-fast",
        description="Exact, packed DICE embeddings of long documents: every document is split into token "
        "chunks, each chunk is encoded on its own by a frozen Hugging Face model (positions restarting per "
        "chunk), and chunk vectors are aggregated into one vector per document.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    enc = sub.add_parser("encode", help="encode documents into an .npy matrix (one row per document)",
                         description="Encode every document of INPUT into one row of OUT.npy (float32).")
    enc.add_argument("input", help=".txt (one document per line) or .jsonl (one JSON object per line)")
    enc.add_argument("--output", "-o", required=True, help="output .npy file, written only when complete")
    enc.add_argument("--format", choices=("auto", "txt", "jsonl"), default="auto",
                     help="input format (default: from the extension; .jsonl/.ndjson are JSON lines)")
    enc.add_argument("--field", default="text", help='the JSON field holding the text (default "text")')
    enc.add_argument("--block-documents", type=int, default=4096,
                     help="documents encoded per engine call; bounds memory on huge inputs (default 4096)")
    enc.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_encoder_arguments(enc)
    enc.set_defaults(func=cmd_encode)
    from .bench import register_cli as register_bench
    from .evaluate import register_cli as register_eval

    register_eval(sub, add_encoder_arguments)
    register_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "block_documents", 1) < 1:
        parser.error("--block-documents must be >= 1")
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"dice-fast: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
