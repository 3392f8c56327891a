"""End-to-end throughput: the engine against naive chunk batching, same model, dtype, device, corpus.

Paths (all produce the same DICE mean-aggregated document vectors):

* ``dice_fast``: the packed engine;
* ``padded``: `dice_fast.baselines.encode_padded` — chunks sorted by length, padded batches of a
  fixed count, the model's SDPA attention (the reference implementation's way);
* ``sentence_transformers``: `dice_fast.baselines.encode_sentence_transformers` — chunk texts
  through ``SentenceTransformer.encode`` with a per-document mean (only for sentence-transformers
  model folders).

Runs are interleaved (round r runs every path once) after a warm-up; the median, p20 and p80 of
the wall time are reported with documents/s, document tokens/s, peak memory (CUDA: max allocated;
CPU: peak resident memory above the level at the start of the run, sampled every 5 ms after freed
heap pages are returned to the OS), the ratio to
the best naive path at the same dtype, and the minimum cosine between each path's vectors and the
engine's. Rows are appended to a CSV with date, device and versions.
"""

from __future__ import annotations

import csv
import ctypes
import datetime
import gc
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .runinfo import device_name, model_label, versions

CORPORA = ("mixed", "short", "long")
RANDOM_MODELS = {
    # BERT-base-size encoder and a 1.5B Qwen2-style decoder (GQA), random weights, for speed only
    "bert-base": ("BertConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                     intermediate_size=3072, max_position_embeddings=512)),
    "qwen2-1.5b": ("Qwen2Config", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                       num_key_value_heads=2, intermediate_size=8960,
                                       max_position_embeddings=32768)),
}


# --------------------------------------------------------------------------------------------
# corpora
# --------------------------------------------------------------------------------------------
def corpus_lengths(kind: str, n_docs: int, seed: int = 0, longest: int = 32768) -> np.ndarray:
    """(n_docs,) target token counts: ``mixed`` (70% 32-512, 25% 512-4k, 5% 4k-``longest``,
    log-uniform in each band), ``short`` (32-256) or ``long`` (4k-``longest``)."""
    if kind not in CORPORA:
        raise ValueError(f"unknown corpus {kind!r}; allowed: {', '.join(CORPORA)}")
    rng = np.random.default_rng(seed)

    def band(lo, hi, n):
        return np.exp(rng.uniform(np.log(lo), np.log(max(hi, lo + 1)), n)).astype(np.int64)

    if kind == "short":
        return band(32, 256, n_docs)
    if kind == "long":
        return band(4096, longest, n_docs)
    pick = rng.choice(3, size=n_docs, p=[0.70, 0.25, 0.05])
    out = np.empty(n_docs, dtype=np.int64)
    for i, (lo, hi) in enumerate(((32, 512), (512, 4096), (4096, longest))):
        out[pick == i] = band(lo, hi, int((pick == i).sum()))
    return out


def make_corpus(tokenizer, lengths: np.ndarray, seed: int = 0) -> list[str]:
    """Documents of real prose cut at token boundaries to ``lengths`` (n_docs,) tokens each."""
    prose = (Path(__file__).parent / "data" / "prose.txt").read_text(encoding="utf-8").replace("\n\n", " ")
    enc = tokenizer(prose, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = np.asarray(enc["offset_mapping"])
    n = len(offsets)
    rng = np.random.default_rng(seed + 1)
    docs = []
    for length in lengths:
        parts, need = [], int(length)
        while need > 0:
            take = min(need, n)
            s = int(rng.integers(0, n - take + 1))
            parts.append(prose[offsets[s][0] : offsets[s + take - 1][1]])
            need -= take
        docs.append(" ".join(parts))
    return docs


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------
def word_tokenizer():
    """A self-contained fast tokenizer (words of the bundled prose, CLS/SEP wrapping) for random models."""
    import re

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    prose = (Path(__file__).parent / "data" / "prose.txt").read_text(encoding="utf-8").lower()
    words = sorted(set(re.findall(r"\w+|[^\w\s]", prose)))
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", model_max_length=10**30)


def random_model(name: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) of a `RANDOM_MODELS` architecture with random weights, built on ``device``."""
    import transformers

    if name not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {name!r}; allowed: {', '.join(RANDOM_MODELS)}")
    tokenizer = word_tokenizer()
    cls_name, kwargs = RANDOM_MODELS[name]
    config = getattr(transformers, cls_name)(vocab_size=len(tokenizer), **kwargs)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.AutoModel.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False), tokenizer


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
@dataclass
class Row:
    date: str
    device: str
    torch: str
    transformers: str
    dice_fast: str
    model: str
    corpus: str
    n_docs: int
    doc_tokens: int
    path: str
    dtype: str
    attention: str
    seconds_median: float
    seconds_p20: float
    seconds_p80: float
    docs_per_s: float
    tokens_per_s: float
    peak_mem_mb: float
    speedup_vs_best_naive: float
    min_cosine_vs_engine: float
    min_cosine_vs_fp32_engine: float
    tflops: float
    mfu: float


class _PeakMemory:
    """Peak memory of a region: CUDA max allocated above the level at entry, or on the CPU the
    sampled resident memory above the level at entry (taken after freed heap pages are returned
    to the OS, so memory a previous run left cached does not hide this run's working set)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0.0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _release_cpu_memory() -> None:
        """Return freed heap pages to the OS so the baseline RSS is the live working set (glibc only)."""
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        self._release_cpu_memory()
        self.base, self.top, self.stop = self._rss(), 0, threading.Event()

        def poll():
            while not self.stop.is_set():
                self.top = max(self.top, self._rss())
                time.sleep(0.005)

        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        else:
            self.stop.set()
            self.thread.join()
            self.peak = max(self.top, self._rss()) / 2**20 - self.base / 2**20


def model_flops(encoder, texts: list[str]) -> float:
    """Forward FLOPs of the engine's chunks: 2 x non-embedding parameters x tokens + attention (QK^T, PV)."""
    from .chunking import plan_chunks, tokenize

    docs = tokenize(encoder.tokenizer, texts)
    cfg = encoder.config
    plan = plan_chunks(docs.lengths, cfg.chunk_size, cfg.overlap, cfg.max_chunks_per_document)
    lengths = (plan.length + encoder.chunk_overhead).astype(np.float64)
    params = sum(p.numel() for n, p in encoder.model.named_parameters() if "embed" not in n)
    mc = encoder.model.config
    causal = encoder.causal if encoder.causal is not None else encoder.spec.is_causal
    attn = 4.0 * mc.num_hidden_layers * mc.hidden_size * float((lengths**2).sum()) * (0.5 if causal else 1.0)
    return 2.0 * params * float(lengths.sum()) + attn


def matmul_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Measured dense matmul rate (TFLOP/s) of ``device`` in ``dtype``: the MFU denominator."""
    n = n if device.type == "cuda" else min(n, 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
        return 2 * n**3 / (ms * 1e-3) / 1e12
    a @ b
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / float(np.median(times)) / 1e12


def run_paths(paths: dict, repeats: int, device: torch.device):
    """Time ``paths`` {name: fn() -> vectors}, interleaved; returns {name: (times, peak_mb, vectors)}."""
    results = {name: ([], 0.0, None) for name in paths}
    for name, fn in paths.items():  # warm-up: kernels, caches, lazy imports
        fn()
    for _ in range(repeats):
        for name, fn in paths.items():
            with _PeakMemory(device) as mem:
                t0 = time.perf_counter()
                vecs = fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
            times, peak, _ = results[name]
            results[name] = (times + [dt], max(peak, mem.peak), vecs)
    return results


def benchmark(encoders: dict, texts: list[str], corpus: str, model_name: str, repeats: int = 3,
              st_model=None, padded_batch: int = 32, peak_tflops: float | None = None) -> list[Row]:
    """Measure every path for each dtype in ``encoders`` {dtype name: DiceEncoder}; returns CSV rows.

    With ``peak_tflops`` (the measured matmul rate) the engine rows also get model TFLOP/s and MFU.
    """
    from .baselines import encode_padded, encode_sentence_transformers

    paths, owner = {}, {}
    for dt, enc in encoders.items():
        paths[f"dice_fast[{dt}]"] = lambda e=enc: e.encode_documents(texts)
        paths[f"padded[{dt}]"] = lambda e=enc: encode_padded(e, texts, padded_batch)
        owner[f"dice_fast[{dt}]"] = owner[f"padded[{dt}]"] = dt
        if st_model is not None and dt == "float32":
            paths[f"sentence_transformers[{dt}]"] = lambda e=enc: encode_sentence_transformers(
                st_model, e.tokenizer, texts, e.config.chunk_size, padded_batch)
            owner[f"sentence_transformers[{dt}]"] = dt
    any_enc = next(iter(encoders.values()))
    device = any_enc.device
    results = run_paths(paths, repeats, device)
    n_tokens = int(sum(len(x) for x in any_enc.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]))
    v, now = versions(), datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    for name, (times, peak, vecs) in results.items():
        dt = owner[name]
        med = float(np.median(times))
        naive = [float(np.median(results[n][0])) for n in results if owner[n] == dt and not n.startswith("dice_fast")]
        engine_vecs = results[f"dice_fast[{dt}]"][2]
        cos = _min_cosine(vecs, engine_vecs)
        fp32 = results.get("dice_fast[float32]")
        cos32 = _min_cosine(vecs, fp32[2]) if fp32 is not None else float("nan")
        engine_row = peak_tflops is not None and name.startswith("dice_fast")
        tflops = model_flops(encoders[dt], texts) / med / 1e12 if engine_row else float("nan")
        rows.append(Row(
            date=now, device=device_name(device), model=model_name, corpus=corpus, n_docs=len(texts),
            doc_tokens=n_tokens, path=name.split("[")[0], dtype=dt, attention=encoders[dt].backend,
            seconds_median=med, seconds_p20=float(np.percentile(times, 20)), seconds_p80=float(np.percentile(times, 80)),
            docs_per_s=len(texts) / med, tokens_per_s=n_tokens / med, peak_mem_mb=peak,
            speedup_vs_best_naive=min(naive) / med if naive else float("nan"), min_cosine_vs_engine=cos,
            min_cosine_vs_fp32_engine=cos32,
            tflops=tflops, mfu=tflops / peak_tflops if engine_row else float("nan"), **v,
        ))
    return rows


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest cosine between matching rows of two (n, dim) matrices of unit vectors (1.0 when n == 0)."""
    return float(np.min(np.sum(a * b, axis=1))) if len(a) else 1.0


def append_csv(rows: list[Row], path: str | os.PathLike) -> None:
    """Append ``rows`` to the CSV at ``path`` (header written when the file is new)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(asdict(rows[0])))
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def format_table(rows: list[Row]) -> str:
    """A short markdown table of ``rows``."""
    head = ("| model | corpus | path | dtype | attention | docs/s | tokens/s | median s | peak MB | vs best naive "
            "| min cos vs engine | min cos vs fp32 engine | TFLOP/s | MFU |")
    lines = [head, "|" + " --- |" * 14]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.corpus} | {r.path} | {r.dtype} | {r.attention if r.path == 'dice_fast' else 'sdpa'} | "
            f"{r.docs_per_s:,.1f} | {r.tokens_per_s:,.0f} | {r.seconds_median:.3f} | {r.peak_mem_mb:,.0f} | "
            f"{r.speedup_vs_best_naive:.2f}x | {r.min_cosine_vs_engine:.5f} | {r.min_cosine_vs_fp32_engine:.5f} | "
            f"{r.tflops:.1f} | {r.mfu:.1%} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# command line: dice-fast bench
# --------------------------------------------------------------------------------------------
def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="throughput of the engine against naive chunk batching",
        description="Time the packed engine against naive chunk batching (padded sorted batches with SDPA, and "
        "sentence-transformers encode on chunk texts for sentence-transformers models) on the same model, dtype, "
        "device and corpus, interleaved; print a table and append rows to a CSV.",
    )
    p.add_argument("--model", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default=None,
                   help="use a random-weight architecture instead of --model (speed only)")
    p.add_argument("--corpus", nargs="+", choices=CORPORA, default=["mixed"], help="corpora to run (default mixed)")
    p.add_argument("--docs", type=int, default=200, help="documents per corpus (default 200)")
    p.add_argument("--longest", type=int, default=32768, help="longest document in tokens (default 32768)")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtypes to compare (default: float32 and bfloat16)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--chunk-size", type=int, default=None, help="DICE chunk size (default: the engine's)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="engine token budget (default: the engine's)")
    p.add_argument("--padded-batch", type=int, default=32, help="chunks per padded batch of the naive paths")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sentence-transformers", action="store_true", help="skip the sentence-transformers path")
    p.add_argument("--flops", action="store_true",
                   help="also report the engine's model TFLOP/s and MFU against the measured matmul rate")
    p.add_argument("--csv", default="benchmarks/results.csv", help="CSV to append rows to")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from .engine import DiceEncoder
    from .models import default_model_path, load_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = args.dtypes or ["float32", "bfloat16"]
    opts = dict(chunk_size=args.chunk_size, max_batch_tokens=args.max_batch_tokens, device=str(device))
    encoders, st_model = {}, None
    for dt in dtypes:
        tdt = getattr(torch, dt)
        if args.random_model:
            model, tok = random_model(args.random_model, device, tdt)
            encoders[dt] = DiceEncoder(model, tok, dtype=dt, **opts)
        else:
            model, tok = load_model(args.model, device, tdt)
            encoders[dt] = DiceEncoder(model, tok, model_path=args.model or default_model_path(), dtype=dt, **opts)
    name = args.random_model or model_label(next(iter(encoders.values())).spec.name)
    if not args.random_model and not args.no_sentence_transformers:
        from sentence_transformers import SentenceTransformer

        st_model = SentenceTransformer(args.model or default_model_path(), device=str(device))
    tok = next(iter(encoders.values())).tokenizer
    peak = matmul_tflops(device, getattr(torch, dtypes[-1])) if args.flops else None
    if peak is not None:
        print(f"measured {dtypes[-1]} matmul rate: {peak:,.1f} TFLOP/s")
    all_rows = []
    for corpus in args.corpus:
        texts = make_corpus(tok, corpus_lengths(corpus, args.docs, args.seed, args.longest), args.seed)
        rows = benchmark(encoders, texts, corpus, name, args.repeats, st_model, args.padded_batch, peak)
        append_csv(rows, args.csv)
        all_rows += rows
    print(format_table(all_rows))
    print(f"{device_name(device)}; torch {torch.__version__}; rows appended to {args.csv}")
    return 0
