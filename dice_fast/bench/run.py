"""The benchmark: the engine against the naive paths, same model, dtype, device and corpus.

Paths (all give the same DICE document vectors; see `dice_fast.bench.baselines`):
``dice_fast`` (the packed engine), ``padded_sorted`` (chunks sorted by length, padded batches: the
paper's code), ``padded_naive`` (chunks in corpus order, padded batches: what users write) and
``sentence_transformers`` (chunk texts through ``SentenceTransformer.encode``; float32, for
sentence-transformers model folders only; it tokenizes the chunk texts itself, inside its time).

Every path runs every chunk: the engine's paths without reuse (a corpus that repeats a passage would
otherwise time the engine on fewer chunks than the padded paths; `benchmarks/bench_cache.py` measures
reuse). Tokenization is measured apart from the model: the corpus is tokenized and planned once per dtype
before the timed paths, which start from that plan (so on a GPU the comparison is the model's work,
not the CPU tokenizer's). The engine row also carries the end-to-end time of
``encode_documents(texts)`` (which tokenizes the next window in a worker thread while the model
runs), the tokenizer's own time and rate, and the share of the tokenizer's time hidden under the
model's work: ``tokenize_overlap = (tokenize + model - end_to_end) / tokenize``, clipped to [0, 1].

Runs are interleaved (round r runs every path once) after a warm-up; each row has the median, p20
and p80 wall time, documents/s, document tokens/s, peak memory, the speed ratio of the path to
padded_sorted, to padded_naive and to the best naive path at the same dtype, the minimum cosine
between the path's vectors and the engine's (same dtype, and float32), and the median cosine between
different documents' vectors (agreement near 1 means little when unrelated documents are that close
too). Engine rows add model FLOPs per token, achieved TFLOP/s and MFU against the matmul rate of the
same dtype measured in the same run.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import asdict, dataclass

import numpy as np

from ..runinfo import append_csv, device_name, versions
from .baselines import encode_padded_naive, encode_padded_sorted, encode_sentence_transformers
from .measure import model_flops, run_paths

ENGINE = "dice_fast"
NAIVE = ("padded_sorted", "padded_naive", "sentence_transformers")
_E2E, _TOKENIZE = "end_to_end", "tokenize"  # timed beside the paths, reported on the engine row


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
    max_batch_tokens: int
    padded_batch: int
    seconds_median: float
    seconds_p20: float
    seconds_p80: float
    docs_per_s: float
    tokens_per_s: float
    peak_mem_mb: float
    speedup_vs_best_naive: float
    speedup_vs_padded_sorted: float
    speedup_vs_padded_naive: float
    min_cosine_vs_engine: float
    min_cosine_vs_fp32_engine: float
    tflops: float
    mfu: float
    flops_per_token: float = float("nan")
    matmul_tflops: float = float("nan")
    e2e_seconds: float = float("nan")
    e2e_tokens_per_s: float = float("nan")
    tokenize_seconds: float = float("nan")
    tokenizer_tokens_per_s: float = float("nan")
    tokenize_overlap: float = float("nan")
    cosine_between_docs: float = float("nan")


FIELDS = [f.name for f in dataclasses.fields(Row)]


def benchmark(encoders: dict, texts: list[str], corpus: str, model_name: str, repeats: int = 3,
              st_model=None, padded_batch: int = 32, peak_tflops=None, on_time=None,
              budget_s: float | None = None, on_rows=None) -> list[Row]:
    """Measure every path for each dtype in ``encoders`` {dtype name: DiceEncoder}; one `Row` per path.

    Dtypes are measured one after the other (float32 first, whose engine vectors the others are
    compared with), paths interleaved within each; ``on_rows(rows)`` gets each dtype's rows as soon
    as they are measured (so a run killed later keeps them). ``speedup_vs_X`` of a row is X's median
    time over the row's (same dtype). ``peak_tflops``: the measured matmul rate, one number or
    {dtype name: rate}; with it the engine rows also get model TFLOP/s and MFU. ``on_time(name,
    round, seconds)`` sees each timing as it is taken; ``budget_s`` caps the timed rounds of all
    dtypes together, shared equally (see `run_paths`).
    """
    order = sorted(encoders, key=lambda dt: dt != "float32")
    fp32, rows = None, []
    for dt in order:
        dt_rows, vecs = _benchmark_dtype(dt, encoders[dt], texts, corpus, model_name, repeats, st_model, padded_batch,
                                         peak_tflops, on_time, None if budget_s is None else budget_s / len(order),
                                         fp32)
        fp32 = vecs if dt == "float32" else fp32
        if on_rows is not None:
            on_rows(dt_rows)
        rows += dt_rows
    return rows


def _benchmark_dtype(dt, enc, texts, corpus, model_name, repeats, st_model, padded_batch, peak_tflops, on_time,
                     budget_s, fp32_vectors):
    """(rows of one dtype, its engine's vectors)."""
    plan = enc.plan(texts)
    planned = _Planned(enc, plan)
    fns = {
        ENGINE: lambda: encode_plan(enc, plan),
        "padded_sorted": lambda: encode_padded_sorted(planned, texts, padded_batch),
        "padded_naive": lambda: encode_padded_naive(planned, texts, padded_batch),
    }
    if st_model is not None and dt == "float32":
        fns["sentence_transformers"] = lambda: encode_sentence_transformers(st_model, planned, texts, padded_batch)
    fns[_E2E] = lambda: enc.encode_documents(texts)
    fns[_TOKENIZE] = lambda: enc.plan(texts)
    results = run_paths({f"{path}[{dt}]": fn for path, fn in fns.items()}, repeats, enc.device, on_time=on_time,
                        budget_s=budget_s)
    results = {name.split("[")[0]: res for name, res in results.items()}
    median = {path: float(np.median(times)) for path, (times, _, _) in results.items()}
    n_tokens = int(plan.tokens.lengths.sum())
    v, now = versions(), datetime.datetime.now().isoformat(timespec="seconds")
    engine_vecs = results[ENGINE][2]
    fp32_vectors = engine_vecs if dt == "float32" else fp32_vectors
    naive = [median[p] for p in results if p in NAIVE]
    rows = []
    for path, (times, peak, vecs) in results.items():
        if path in (_E2E, _TOKENIZE):
            continue
        med = median[path]
        extra = {}
        if path == ENGINE:
            extra = _engine_extras(enc, plan, med, median[_E2E], median[_TOKENIZE], n_tokens, peak_tflops, dt)
        rows.append(Row(
            date=now, device=device_name(enc.device), model=model_name, corpus=corpus, n_docs=len(texts),
            doc_tokens=n_tokens, path=path, dtype=dt, attention=_attention_label(enc) if path == ENGINE else "sdpa",
            max_batch_tokens=enc.max_batch_tokens, padded_batch=padded_batch,
            seconds_median=med, seconds_p20=float(np.percentile(times, 20)), seconds_p80=float(np.percentile(times, 80)),
            docs_per_s=len(texts) / med, tokens_per_s=n_tokens / med, peak_mem_mb=peak,
            speedup_vs_best_naive=min(naive) / med if naive else float("nan"),
            speedup_vs_padded_sorted=median["padded_sorted"] / med, speedup_vs_padded_naive=median["padded_naive"] / med,
            min_cosine_vs_engine=_min_cosine(vecs, engine_vecs),
            min_cosine_vs_fp32_engine=_min_cosine(vecs, fp32_vectors) if fp32_vectors is not None else float("nan"),
            tflops=extra.pop("tflops", float("nan")), mfu=extra.pop("mfu", float("nan")),
            cosine_between_docs=_cosine_between(vecs), **extra, **v,
        ))
    return rows, engine_vecs


def padded_fallback(encoder) -> str | None:
    """Why ``encoder`` runs chunks on the padded path instead of packed, or None when it does not (the
    GPU check fails on it: a padded engine's speed says nothing about the packed one)."""
    if encoder.runner.uses_packed(encoder.config.chunk_size + encoder.chunk_overhead):  # what the engine decides
        return None
    if encoder.backend == "padded":
        return f"the engine runs on the padded path ({encoder.runner.fallback_reason or 'attention_backend=padded'})"
    return (f"chunks over the {encoder.runner.packed_limit}-token sliding window run on the padded path "
            f"({encoder.backend} cannot band them)")


def _attention_label(encoder) -> str:
    """The engine's attention backend, and on the CPU how its attention computed (`dice_fast.cpu_attention`)."""
    from .. import cpu_attention

    how = cpu_attention.describe(encoder.dtype) if encoder.device.type == "cpu" else ""
    return f"{encoder.backend} ({how})" if how else encoder.backend


def encode_plan(encoder, plan) -> np.ndarray:
    """(n_docs, dim) float32 document vectors of an already tokenized ``plan``: the engine's batching
    (`dice_fast.chunk_queue.ChunkQueue`, the encoder's token budget) without its tokenizer, and
    without reuse: every chunk runs, as on the padded paths."""
    queue = encoder.chunk_queue(dedup=False)
    job = queue.submit(plan)
    while (batch := queue.next_batch()) is not None:
        if failed := queue.run(batch)[1]:  # the forward and the model's head; a chunk out of memory alone
            raise failed[0].error
    return job.documents


class _Planned:
    """``encoder`` whose ``plan(texts)`` returns a plan made beforehand (the baselines start from the
    same tokenized corpus as the engine); everything else is the encoder's."""

    def __init__(self, encoder, plan):
        self._encoder, self._plan = encoder, plan

    def plan(self, texts, kind: str = "documents"):
        return self._plan

    def __getattr__(self, name):
        return getattr(self._encoder, name)


def _engine_extras(encoder, plan, model_s: float, e2e_s: float, tokenize_s: float, n_tokens: int,
                   peak_tflops, dt: str) -> dict:
    flops = model_flops(encoder, plan=plan)
    peak = peak_tflops.get(dt) if isinstance(peak_tflops, dict) else peak_tflops
    out = dict(flops_per_token=flops / max(1.0, float(plan.chunk_lengths.sum())), e2e_seconds=e2e_s,
               e2e_tokens_per_s=n_tokens / e2e_s, tokenize_seconds=tokenize_s,
               tokenizer_tokens_per_s=n_tokens / tokenize_s if tokenize_s > 0 else float("nan"),
               tokenize_overlap=float(np.clip((tokenize_s + model_s - e2e_s) / tokenize_s, 0.0, 1.0))
               if tokenize_s > 0 else float("nan"))
    if peak is not None:
        out.update(tflops=flops / model_s / 1e12, mfu=flops / model_s / 1e12 / peak, matmul_tflops=peak)
    return out


def _cosine_between(vecs: np.ndarray, most: int = 2000) -> float:
    """Median cosine between different rows of (n, dim) unit vectors (the first ``most`` rows); NaN when n < 2."""
    x = np.asarray(vecs[:most], dtype=np.float64)
    if len(x) < 2:
        return float("nan")
    sims = x @ x.T
    return float(np.median(sims[~np.eye(len(x), dtype=bool)]))


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest cosine between matching rows of two (n, dim) matrices of unit vectors (1.0 when n == 0)."""
    return float(np.min(np.sum(a * b, axis=1))) if len(a) else 1.0


def save_rows(rows: list[Row], path: str | os.PathLike) -> int:
    """Append ``rows`` to the CSV at ``path`` (`runinfo.append_csv`: a file written by an older
    version with other columns is widened, old columns first; one whose rows do not match its own
    header raises ValueError); returns the number written."""
    return append_csv([asdict(r) for r in rows], path, fieldnames=FIELDS)


def format_table(rows: list[Row]) -> str:
    """A short markdown table of ``rows``."""
    head = ("| model | corpus | path | dtype | attention | docs/s | tokens/s | median s | peak MB | vs padded_sorted "
            "| vs padded_naive | vs best naive | min cos vs engine | min cos vs fp32 engine | cos between docs "
            "| GFLOP/token | TFLOP/s | MFU | end-to-end tokens/s | tokenizer tokens/s | tokenize overlap |")
    lines = [head, "|" + " --- |" * 21]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.corpus} | {r.path} | {r.dtype} | {r.attention} | "
            f"{r.docs_per_s:,.1f} | {r.tokens_per_s:,.0f} | {r.seconds_median:.3f} | {r.peak_mem_mb:,.0f} | "
            f"{r.speedup_vs_padded_sorted:.2f}x | {r.speedup_vs_padded_naive:.2f}x | {r.speedup_vs_best_naive:.2f}x | "
            f"{r.min_cosine_vs_engine:.5f} | {r.min_cosine_vs_fp32_engine:.5f} | {r.cosine_between_docs:.3f} | "
            f"{_num(r.flops_per_token / 1e9, '.3f')} | {_num(r.tflops, '.3g')} | {_num(r.mfu, '.1%')} | "
            f"{_num(r.e2e_tokens_per_s, ',.0f')} | {_num(r.tokenizer_tokens_per_s, ',.0f')} | {_num(r.tokenize_overlap, '.0%')} |"
        )
    return "\n".join(lines)


def _num(x: float, fmt: str) -> str:
    return "" if x != x else format(x, fmt)
