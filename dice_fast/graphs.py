"""CUDA graphs for small packed batches (serving, queries): one graph per token-count bucket.

A 1-4k-token batch of a small encoder is ~1.5 ms of kernel launches for ~0.2 ms of GPU work. A CUDA
graph replays a forward's launches at once, but it fixes every shape and every host argument. So
batches are rounded up to a few **buckets** (`Bucket`: a token count, a number of chunk slots and
one ``max_seqlen``), and a batch smaller than its bucket is padded (`pad_batch`):

* after the real chunks come **dummy chunks** of pad tokens (positions restarting like any chunk),
  none longer than the bucket's ``max_seqlen``, filling the bucket's tokens exactly;
* the remaining chunk slots are **empty** (cu_seqlens repeats the last offset), so cu_seqlens has
  the bucket's fixed length;
* attention is block-diagonal, so no real token sees a dummy one: the real chunks' hidden states
  are those of the unpadded batch; the forward's output is cut to the real tokens and pooled with
  the batch's own cu_seqlens (outside the graph), so padding never reaches a chunk vector.

`GraphedRunner` wraps a `dice_fast.runner.ModelRunner`: a batch that fits a bucket runs padded,
through the bucket's graph on CUDA (captured on first use, all graphs in one memory pool, so they
cost the largest bucket's working set, not their sum) or eagerly elsewhere (the CPU tests check the
padding path exact against the unpadded one); any other batch runs as before. Graphs need a backend
whose chunk boundaries live on the device (``flash_attn``, ``torch_varlen``) and a forward without
host syncs (`dice_fast.nosync`). Off by default: `use_cuda_graphs(encoder)` switches it on.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .errors import OptionError
from .nosync import sync_free_kwargs
from .ops import pool_chunks
from .packing import PackedBatch
from .runner import to_device
from .settings import GRAPH_BACKENDS, check_graphable

DEFAULT_BUCKETS = (256, 512, 1024, 2048, 4096)  # tokens per replayed batch (serving and query batches)
DEFAULT_MEMORY_MB = 2048  # the graphs' shared pool may not grow past this (larger buckets then run eagerly)


@dataclass(frozen=True)
class Bucket:
    """Shapes of every batch replayed in one graph.

    tokens: T, the padded batch's tokens; chunks: C, chunk slots (cu_seqlens has C + 1 entries);
    max_seqlen: the longest chunk passed to attention (a host int fixed in the graph)."""

    tokens: int
    chunks: int
    max_seqlen: int


def make_buckets(sizes, longest_chunk: int, shortest_chunk: int = 1) -> tuple[Bucket, ...]:
    """Buckets of ``sizes`` tokens (ascending) for chunks of ``shortest_chunk``..``longest_chunk``
    tokens: ``max_seqlen = min(tokens, longest_chunk)``, chunk slots for a batch of the shortest
    chunks plus its dummies. Raises ValueError on a size < 1 or a repeated size."""
    sizes = sorted(int(s) for s in sizes)
    if not sizes or sizes[0] < 1 or len(set(sizes)) != len(sizes):
        raise OptionError(f"bucket sizes must be distinct integers >= 1, got {sizes}")
    if longest_chunk < 1 or shortest_chunk < 1:
        raise OptionError(f"chunk lengths must be >= 1, got {shortest_chunk}..{longest_chunk}")
    out = []
    for t in sizes:
        seq = min(t, longest_chunk)
        out.append(Bucket(t, t // shortest_chunk + 1, seq))
    return tuple(out)


def n_dummies(pad_tokens: int, max_seqlen: int) -> int:
    """Dummy chunks that fill ``pad_tokens`` with none longer than ``max_seqlen``."""
    return -(-pad_tokens // max_seqlen) if pad_tokens > 0 else 0


def choose_bucket(buckets, n_tokens: int, n_chunks: int, max_seqlen: int) -> Bucket | None:
    """The smallest bucket a batch (``n_tokens`` tokens, ``n_chunks`` chunks, longest ``max_seqlen``)
    fits with its dummy chunks, or None (the batch runs unpadded)."""
    for b in buckets:
        if (b.tokens >= n_tokens and max_seqlen <= b.max_seqlen
                and n_chunks + n_dummies(b.tokens - n_tokens, b.max_seqlen) <= b.chunks):
            return b
    return None


def pad_batch(batch: PackedBatch, bucket: Bucket, pad_id: int, first_position: int) -> PackedBatch:
    """``batch`` padded to ``bucket`` (see the module docstring): input_ids and position_ids (T,),
    cu_seqlens (C + 1,) int32, ``lengths`` (C,) with the dummies' lengths and zeros for empty slots,
    ``chunk_ids`` -1 past the real chunks, ``max_seqlen`` the bucket's. Raises ValueError when the
    batch does not fit (`choose_bucket` said None)."""
    n, t = len(batch.lengths), batch.n_tokens
    pad = bucket.tokens - t
    d = n_dummies(pad, bucket.max_seqlen)
    if pad < 0 or batch.max_seqlen > bucket.max_seqlen or n + d > bucket.chunks:
        raise OptionError(f"a batch of {t} tokens, {n} chunks (longest {batch.max_seqlen}) does not fit {bucket}")
    dummy = np.full(d, bucket.max_seqlen, dtype=np.int64)
    if d:
        dummy[-1] = pad - bucket.max_seqlen * (d - 1)
    lengths = np.zeros(bucket.chunks, dtype=np.int64)
    lengths[:n] = batch.lengths
    lengths[n:n + d] = dummy
    cu = np.zeros(bucket.chunks + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    starts = np.repeat(cu[n:n + d], dummy)
    positions = np.concatenate([batch.position_ids, np.arange(pad, dtype=np.int64) - starts + t + first_position])
    ids = np.concatenate([batch.input_ids, np.full(pad, pad_id, dtype=np.int64)])
    chunk_ids = np.concatenate([batch.chunk_ids, np.full(bucket.chunks - n, -1, dtype=np.int64)])
    return PackedBatch(input_ids=ids, position_ids=positions, cu_seqlens=cu.astype(np.int32),
                       max_seqlen=bucket.max_seqlen, chunk_ids=chunk_ids, lengths=lengths)


def graph_bytes_per_token(config, dtype: torch.dtype) -> int:
    """A bound on one forward's working set per token (bytes): the residual stream, Q/K/V and the
    attention output, the MLP's hidden (twice for gated MLPs), in ``dtype``, plus fp32 norm upcasts.
    Layers run one after the other, so one layer's tensors bound the graph's pool."""
    h = int(config.hidden_size)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    a = heads * int(getattr(config, "head_dim", None) or h // heads)
    inter = int(getattr(config, "intermediate_size", 4 * h) or 4 * h)
    elem = torch.empty((), dtype=dtype).element_size()
    return (4 * h + 4 * a + 3 * inter) * elem + 2 * 4 * h


def buckets_within(buckets, budget_bytes: int, bytes_per_token: int) -> tuple[Bucket, ...]:
    """The buckets whose working set (tokens x ``bytes_per_token``) fits ``budget_bytes``: with one
    shared pool, the largest kept bucket bounds the graphs' memory."""
    return tuple(b for b in buckets if b.tokens * bytes_per_token <= budget_bytes)


class _Graph:
    """One bucket's captured forward: static inputs, the graph, its (T, H) output."""

    def __init__(self, bucket: Bucket, device):
        self.bucket = bucket
        self.ids = torch.zeros((1, bucket.tokens), dtype=torch.long, device=device)
        self.pos = torch.zeros((1, bucket.tokens), dtype=torch.long, device=device)
        self.cu = torch.zeros(bucket.chunks + 1, dtype=torch.int32, device=device)
        self.graph = None
        self.hidden = None

    def load(self, padded: PackedBatch) -> None:
        self.ids[0].copy_(to_device(padded.input_ids, self.ids.device), non_blocking=True)
        self.pos[0].copy_(to_device(padded.position_ids, self.pos.device), non_blocking=True)
        self.cu.copy_(to_device(padded.cu_seqlens, self.cu.device), non_blocking=True)


class GraphedRunner:
    """A `ModelRunner` whose batches that fit a bucket run padded, as CUDA graphs where it can.

    runner: the `dice_fast.runner.ModelRunner` to wrap (everything else is delegated to it).
    longest_chunk / shortest_chunk: the longest and shortest wrapped chunk the encoder makes (the
    buckets' ``max_seqlen`` and chunk slots). buckets: token counts (default `DEFAULT_BUCKETS`).
    capture: replay CUDA graphs (default: on CUDA with a `GRAPH_BACKENDS` backend); False pads and
    runs eagerly (the CPU path of the tests). memory_mb: cap of the graphs' shared pool; buckets
    whose estimated working set (`graph_bytes_per_token`) is over it are dropped, and a capture that
    grows the pool past it drops its bucket and the larger ones (they then run unpadded).
    """

    def __init__(self, runner, longest_chunk: int, buckets=None, capture: bool | None = None,
                 memory_mb: float = DEFAULT_MEMORY_MB, shortest_chunk: int = 1):
        self.runner = runner
        if capture is None:
            capture = runner.device.type == "cuda" and runner.backend in GRAPH_BACKENDS
        if capture:
            check_graphable(runner.device, runner.backend)
        buckets = make_buckets(DEFAULT_BUCKETS if buckets is None else buckets, longest_chunk, shortest_chunk)
        dtype = next(runner.model.parameters()).dtype
        self.budget = int(memory_mb * 2**20)
        self.buckets = buckets_within(buckets, self.budget, graph_bytes_per_token(runner.model.config, dtype))
        self.capture = bool(capture)
        self._graphs: dict[Bucket, _Graph] = {}
        # a bucket's static buffers are loaded, replayed and read (the pooling enqueued, in stream order
        # before the next load) by one thread at a time; captures take it too
        self._lock = threading.Lock()
        self._pool = None
        self._pool_bytes = 0  # what captures grew the reserved memory by (a dropped bucket's stays counted)
        self.replays = 0  # batches run through a graph (or padded eagerly when capture is False)

    def __getattr__(self, name):  # backend, uses_packed, fallback_reason, packed_limit, device, ...
        return getattr(self.runner, name)

    def run(self, batch: PackedBatch) -> torch.Tensor:
        """Chunk vectors of ``batch``: (n_chunks, hidden_size) float32, as `ModelRunner.run`."""
        r = self.runner
        r.check_placement()  # a graph replays the weights it captured: moved, they are freed memory
        bucket = None
        if batch.n_tokens and r.uses_packed(batch.max_seqlen) and batch.pool_rows is None:  # late: unpadded
            bucket = choose_bucket(self.buckets, batch.n_tokens, len(batch.lengths), batch.max_seqlen)
        if bucket is None:
            return r.run(batch)
        padded = pad_batch(batch, bucket, r.pad_id, r.spec.first_position)
        with torch.inference_mode(), (self._lock if self.capture else contextlib.nullcontext()):
            hidden = self._replay(bucket, padded) if self.capture else self._forward(padded)
            if hidden is not None:
                self.replays += 1
                cu = to_device(batch.cu_seqlens, r.device)
                return pool_chunks(hidden[: batch.n_tokens], cu, r.pooling, impl=r.pooling_impl)
        return r.run(batch)  # the bucket was dropped at capture (memory): unpadded

    # ----------------------------------------------------------------------------------------
    def _forward(self, padded: PackedBatch, ids=None, pos=None, cu=None) -> torch.Tensor:
        """(T, H) hidden states of the padded batch (the graph's body; eager when called directly)."""
        from . import attention as attn

        r = self.runner
        dev = r.device
        ids = to_device(padded.input_ids, dev).unsqueeze(0) if ids is None else ids
        pos = to_device(padded.position_ids, dev).unsqueeze(0) if pos is None else pos
        cu = to_device(padded.cu_seqlens, dev) if cu is None else cu
        if not attn.installed(r.model):
            attn.install(r.model)
        kwargs = {"use_cache": False} if r.takes_cache else {}
        kwargs.update(sync_free_kwargs(ids))
        m = padded.max_seqlen
        with attn.attention_context(r.backend, r.causal, padded.lengths, padded.cu_seqlens):
            out = r.model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                          max_length_q=m, max_length_k=m, **kwargs)
        return out.last_hidden_state[0]

    def _replay(self, bucket: Bucket, padded: PackedBatch) -> torch.Tensor | None:
        g = self._graphs.get(bucket)
        if g is None:
            if bucket not in self.buckets:
                return None
            g = self._capture(bucket, padded)
            if g is None:
                return None
        g.load(padded)
        g.graph.replay()
        return g.hidden

    def _capture(self, bucket: Bucket, padded: PackedBatch) -> _Graph | None:
        """Capture ``bucket``'s forward (warm-up on a side stream first: lazy inits and autotuning
        must not happen inside the capture); None, and the bucket and larger ones dropped, when the
        pool grew past the memory cap."""
        dev = self.runner.device
        g = _Graph(bucket, dev)
        g.load(padded)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(padded, g.ids, g.pos, g.cu)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # as the capture does first: what is reserved now is live, the rest the pool's
        before = torch.cuda.memory_reserved(dev)
        # thread_local: the producer thread (`dice_fast.pipeline`) stages the next batch meanwhile (an event
        # wait, pinned and device allocations), which "global" mode would make fail the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            g.hidden = self._forward(padded, g.ids, g.pos, g.cu)
        g.graph = graph
        torch.cuda.synchronize(dev)
        self._pool_bytes += max(0, torch.cuda.memory_reserved(dev) - before)  # this capture's new segments
        if self._pool_bytes > self.budget:
            self.buckets = tuple(b for b in self.buckets if b.tokens < bucket.tokens)
            del g, graph
            return None
        self._graphs[bucket] = g
        return g


def use_cuda_graphs(encoder, buckets=None, capture: bool | None = None, memory_mb: float = DEFAULT_MEMORY_MB):
    """Switch ``encoder`` (a `DiceEncoder`) to graphed small batches (see the module docstring);
    returns its `GraphedRunner`. Idempotent: a second call replaces the first's buckets."""
    runner = encoder.runner.runner if isinstance(encoder.runner, GraphedRunner) else encoder.runner
    longest = encoder.config.chunk_size + encoder.chunk_overhead
    encoder.runner = GraphedRunner(runner, longest, buckets, capture, memory_mb, shortest_chunk=max(1, encoder.chunk_overhead))
    return encoder.runner
