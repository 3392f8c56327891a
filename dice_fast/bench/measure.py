"""What the benchmark measures besides wall time: peak memory, the model's FLOPs, the device's
matmul rate (the MFU denominator), and the interleaved timing loop."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import torch

from ..cpu_heap import release_freed_memory


class PeakMemory:
    """Peak memory (MB) of a region, in ``.peak`` after exit: CUDA max allocated above the level at
    entry, or on the CPU the resident memory sampled every 5 ms above the level at entry (taken after
    freed heap pages are returned to the OS, so memory a previous run left cached does not hide this
    run's working set)."""

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
        release_freed_memory()

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


def model_flops(encoder, texts: list[str] | None = None, plan=None) -> float:
    """Forward FLOPs of the engine's chunks (``encoder.plan(texts)``, or ``plan``): 2 x the parameters
    every token passes through x tokens + attention (QK^T and PV: 4 x layers x attention width x
    length^2 per chunk, half when causal; the width is `attention_width`, not hidden_size: Qwen3-0.6B
    attends 16 x 128 = 2048 wide at hidden size 1024). Embedding tables (a lookup) and BERT's pooler
    (one token per forward) are not counted."""
    plan = plan if plan is not None else encoder.plan(texts)
    lengths = plan.chunk_lengths.astype(np.float64)
    params = sum(p.numel() for n, p in encoder.model.named_parameters() if "embed" not in n and "pooler" not in n)
    mc = encoder.model.config
    causal = encoder.causal if encoder.causal is not None else encoder.spec.is_causal
    attn = 4.0 * mc.num_hidden_layers * attention_width(mc) * float((lengths**2).sum()) * (0.5 if causal else 1.0)
    return 2.0 * params * float(lengths.sum()) + attn


def attention_width(config) -> int:
    """Width of the queries (and of the attention output) of a transformers ``config``: heads x
    head_dim. ``head_dim`` is read where the config sets it (Qwen3, Gemma: 128 at any hidden size),
    else hidden_size / heads (BERT, Llama, Qwen2: equal to hidden_size)."""
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if not heads:
        return int(config.hidden_size)
    return int(heads) * int(head_dim or config.hidden_size // heads)


def matmul_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192,
                  min_seconds: float = 0.05) -> float:
    """Measured dense matmul rate (TFLOP/s) of ``device`` in ``dtype``: the MFU denominator.

    CUDA: an n x n x n product timed with CUDA events (``triton.testing.do_bench``, median). CPU: the
    size grows from 256 (doubling, at most 2048 and ``n``) until one product takes ``min_seconds``,
    so a dtype the CPU has no instructions for (bf16 without avx512_bf16/AMX: ~1 GFLOP/s) costs a
    fraction of a second, not minutes; median of 3 timed products after a warm-up.
    """
    if device.type == "cuda":
        import triton.testing

        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
        return 2 * n**3 / (ms * 1e-3) / 1e12
    size = 256
    while True:
        a = torch.randn(size, size, dtype=torch.float32).to(dtype)
        b = torch.randn(size, size, dtype=torch.float32).to(dtype)
        t0 = time.perf_counter()
        a @ b
        first = time.perf_counter() - t0
        if first >= min_seconds or size >= min(n, 2048):
            break
        size *= 2
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / float(np.median(times)) / 1e12


def run_paths(paths: dict, repeats: int, device: torch.device, on_time=None, budget_s: float | None = None) -> dict:
    """Time ``paths`` {name: fn() -> vectors} after one warm-up call each, interleaved (round r runs
    every path once); returns {name: (seconds per round, peak MB, vectors of the last round)}.

    on_time(name, round, seconds), when given, is called as each timing is taken (so a caller can
    flush it before a kill). budget_s: wall-clock seconds for the timed rounds; a round is started
    only when the time the slowest round took so far still fits (at least one always runs).
    """
    results = {name: ([], 0.0, None) for name in paths}
    for fn in paths.values():  # warm-up: kernels, caches, lazy imports
        fn()
    start, longest = time.perf_counter(), 0.0
    for r in range(repeats):
        if r and budget_s is not None and time.perf_counter() - start + longest > budget_s:
            break
        t_round = time.perf_counter()
        for name, fn in paths.items():
            with PeakMemory(device) as mem:
                t0 = time.perf_counter()
                vecs = fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
            times, peak, _ = results[name]
            results[name] = (times + [dt], max(peak, mem.peak), vecs)
            if on_time is not None:
                on_time(name, r, dt)
        longest = max(longest, time.perf_counter() - t_round)
    return results
