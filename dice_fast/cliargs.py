"""The model and DICE options every command shares: one argument group, one way to build the encoder."""

from __future__ import annotations

import argparse

from .config import AGGREGATIONS, ATTENTION_BACKENDS, ATTENTION_MODES, DTYPES, POOLINGS, POSITIONS, STRATEGIES


def encoder_options(args) -> dict:
    """The `DiceConfig` options named by the arguments of `add_encoder_arguments`."""
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
        "truncate_dim": args.truncate_dim,
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
    if getattr(args, "calibration", None) is not None:  # absent otherwise: job manifests stay as they were
        opts["calibration"] = args.calibration
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
    g.add_argument("--truncate-dim", type=int, default=None, metavar="N",
                   help="keep the first N components of every vector (Matryoshka), re-normalised (default: all)")
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
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="model precision (default: bfloat16 on CUDA, float32 on CPU); int8: static int8 on "
                        "a CPU with VNNI/AMX (the int8 extra), agreement stated in docs/int8.md")
    g.add_argument("--calibration", default=None, metavar="FILE",
                   help="--dtype int8: a text sample of your corpus to calibrate on (default: bundled prose)")


def add_cache_arguments(p: argparse.ArgumentParser):
    """``--cache DIR`` and ``--cache-max-gb N``; returns their argument group (for a command's own cache flags)."""
    g = p.add_argument_group("chunk cache (a chunk's vector depends only on its tokens, the model and options)")
    g.add_argument("--cache", metavar="DIR", default=None,
                   help="persistent chunk cache folder (created if missing; shareable by processes): chunks "
                   "found there are not encoded again, new ones are added")
    g.add_argument("--cache-max-gb", type=float, default=None, metavar="N",
                   help="bound the cache to N GB; least recently used chunks are evicted (default: unbounded)")
    return g


def make_encoder(args):
    """A `DiceEncoder` for ``--model`` with the options of `add_encoder_arguments` (and of
    `add_cache_arguments` where the command has them)."""
    from .engine import DiceEncoder

    cache = {"cache": args.cache, "cache_max_gb": args.cache_max_gb} if getattr(args, "cache", None) else {}
    if getattr(args, "cache_max_gb", None) is not None and not cache:
        raise ValueError("--cache-max-gb needs --cache DIR")
    return DiceEncoder.from_pretrained(args.model, **cache, **encoder_options(args))
