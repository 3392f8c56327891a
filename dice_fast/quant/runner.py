"""`OpenVinoRunner`: the engine's batches through a compiled OpenVINO model (int8 or float).

Same plan, packing and aggregation as every other precision and runtime: a `PackedBatch` comes in, its chunks
(sorted by length) run as dense padded sub-batches (length buckets: 254-token chunks pad nothing),
and each finished sub-batch is pooled to chunk vectors at once (`pool_dense`: the engine's token ->
chunk pooling over each row's valid tokens, summed in float64), written in packing order.

Speed: the compiled model has ``streams`` OpenVINO streams (default: one per inference thread, each
stream one thread) and a batch's sub-batches (`request_groups`: a multiple of the streams per model,
of near-equal tokens) are kept ``streams`` at a time in flight in an `openvino.AsyncInferQueue`, so every
core runs its own request instead of all cores synchronising inside one (``streams=1``: one synchronous
request with every thread, the first version). Sub-batches of full chunks run on a twin of the model compiled for
their length (rows free), ~1.1x the dynamic model's speed. Pooling in the request's callback reads
the output in place: no (tokens, hidden) copy, no torch ops (whose OpenMP threads would contend with
OpenVINO's). Measured in benchmarks/RESULTS.md (the int8 throughput sections, §15-§16).

Exactness contract: none bit-wise (OpenVINO's kernels round differently from PyTorch's). Agreement
with float32 is stated and tested (`agreement`, docs/int8.md, docs/cpu.md): cosine of chunk vectors
against the float32 engine on held-out prose and the per-chunk Hugging Face forward. Static scales
(int8) and a chunk-independent graph make a chunk's vector independent of its sub-batch neighbours
and of which stream runs it.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..errors import OptionError
from ..runner import PADDED, ModelRunner

# A batch's requests (`request_groups`): the rows of one model (fixed-length twin or dynamic) cut into a
# multiple of the streams, of near-equal tokens, each about REQUEST_TOKENS at most and REQUEST_SQUARE
# rows x width² (the attention scores one head holds: 2 late windows of 512 tokens, 8 chunks of 256), so
# every stream works to the end of each model's rows. Cutting by tokens alone (requests of 4096 and a
# remainder, the rule before) left one stream idle for the remainder: on the 2-core Zen 2, MiniLM float32,
# this rule ran 1.14x-1.52x that one on documents of mixed lengths, DICE and late chunking (RESULTS §34).
REQUEST_TOKENS = 4096
REQUEST_SQUARE = 2**19


class OpenVinoRunner(ModelRunner):
    """A `ModelRunner` whose dense forward is an OpenVINO model (the Hugging Face model is kept only
    for its facts and fingerprint). ``build(takes_positions, streams)`` -> the `OpenVinoModel`
    (`int8_model` / `float_model` with the rest of their arguments bound); ``streams``: requests in
    flight (None: one per inference thread). ``identity``: the compiled model's (precision, backend,
    versions, hashes). It pools itself (`pool_dense`), so ``pooling_impl`` does not apply."""

    def __init__(self, model, spec, pooling: str, pooling_impl: str, max_batch_tokens: int,
                 pad_token_id: int | None, build, streams: int | None = None):
        super().__init__(model, spec, PADDED, None, pooling, pooling_impl, max_batch_tokens, pad_token_id)
        self.streams = max(1, int(streams if streams is not None else torch.get_num_threads()))
        self.openvino = build(self._takes_positions, self.streams)
        self.identity = self.openvino.identity
        self._local = threading.local()  # one request queue per thread and model: a queue is not thread-safe
        self.fallback_reason = None

    def _queue(self, model: str):
        """This thread's request queue for ``model``: "fixed" (the fixed-length twin), "dynamic" or
        "latency" (the latency twin: one request at a time, every thread in it)."""
        jobs = 1 if model == "latency" else self.streams
        model = self.openvino.latency.get() if model == "latency" else getattr(self.openvino, model)
        queues = getattr(self._local, "queues", None)
        if queues is None:
            queues = self._local.queues = {}
        if id(model) not in queues:  # keyed by the model itself: a runner given other models gets new queues
            import openvino as ov

            queue = queues[id(model)] = ov.AsyncInferQueue(model, jobs)
            queue.set_callback(_pool_finished)
        return queues[id(model)]

    def run(self, batch) -> torch.Tensor:
        """Chunk vectors of ``batch``: (n_chunks, hidden_size) float32 in packing order; sub-batches
        (`request_groups`) ``streams`` at a time in flight. A sub-batch as wide as the compiled fixed
        width runs on the fixed-length model, any other on the dynamic one; one model's requests finish
        before the other's start (never 2x streams at once).
        The rows of one model fewer than the streams (one query, one short document) run as one request on
        the latency twin instead, every thread in it (`LatencyTwin`).
        A batch that pools segments (`PackedBatch.segments`: late chunking, a prompt left out) pools each
        inside its row."""
        import openvino as ov

        out = np.zeros((batch.n_chunks, self.spec.hidden_size), np.float32)
        seq_rows, starts, counts = _segment_offsets(batch)
        errors: list = []
        queue = None
        try:
            cap = max(1, min(self.max_batch_tokens // self.streams, REQUEST_TOKENS))
            groups = request_groups(batch.lengths, self.openvino.width, self.streams, cap)
            for (lo, hi, _, _, ids, mask, pos), alone in zip(self.dense_batches(batch, [g[:2] for g in groups]),
                                                             [g[2] for g in groups]):
                c_lo, c_hi = batch.chunk_rows(lo, hi)
                segments = (seq_rows[c_lo:c_hi] - lo, starts[c_lo:c_hi], counts[c_lo:c_hi])
                fixed = ids.shape[1] == self.openvino.width
                wanted = self._queue("latency" if alone and self.openvino.latency else "fixed" if fixed else "dynamic")
                if queue is not wanted:
                    if queue is not None:
                        queue.wait_all()
                    queue = wanted
                arrays = {"input_ids": ids, "attention_mask": mask, **({} if pos is None else {"position_ids": pos})}
                # OpenVINO reads the arrays in place (kept alive by userdata until done); Tensors made here
                # skip its Python input dispatch: 0.26 -> 0.21 ms a start (one query, RESULTS §36)
                feed = {name: ov.Tensor(a, shared_memory=True) for name, a in arrays.items()}
                queue.start_async(feed, (out, c_lo, c_hi, segments, self.pooling, (feed, arrays), errors),
                                  share_inputs=True)
        finally:
            if queue is not None:
                queue.wait_all()  # also after a failed start: no request of this batch outlives the call
        if errors:
            raise errors[0]
        return torch.from_numpy(out)


def pool_dense(hidden: np.ndarray, segments, pooling: str) -> np.ndarray:
    """Chunk vectors of one dense sub-batch: hidden (n, width, H); ``segments`` (rows, starts, counts),
    three (m,) int arrays: chunk ``j`` is the ``counts[j]`` >= 1 tokens of row ``rows[j]`` from
    ``starts[j]`` -> (m, H) float32. mean: over them, summed in float64 (the engine's `pool_chunks` to
    float32 rounding); cls: the first; last: the last."""
    rows, starts, counts = (np.asarray(a, np.int64) for a in segments)
    if pooling == "cls":
        return np.array(hidden[rows, starts], np.float32)
    if pooling == "last":
        return np.array(hidden[rows, starts + counts - 1], np.float32)
    if pooling != "mean":
        raise OptionError(f"pooling must be mean, cls or last, got {pooling!r}")
    out = np.empty((len(rows), hidden.shape[2]), np.float32)
    for j, (row, start, count) in enumerate(zip(rows.tolist(), starts.tolist(), counts.tolist())):
        out[j] = hidden[row, start:start + count].sum(0, dtype=np.float64) / max(count, 1)  # none: zeros
    return out


def request_groups(lengths: np.ndarray, fixed_width: int | None, streams: int, cap: int = REQUEST_TOKENS,
                   square: int = REQUEST_SQUARE) -> list[tuple[int, int, bool]]:
    """Consecutive (lo, hi, alone) row ranges of a batch's non-increasing row ``lengths``, one request each:
    the rows of each model (those ``fixed_width`` long, the others) cut into ``streams`` x k requests of
    near-equal tokens, k the least that keeps a request within about ``cap`` tokens and ``square`` rows x
    width²; at least one row each. A model's rows fewer than ``streams`` are cut into k only and are
    ``alone`` (True): they run on the latency twin, one request at a time (`LatencyTwin`)."""
    lengths = np.asarray(lengths, np.int64)
    fixed = lengths == (fixed_width if fixed_width is not None else -1)
    edges = [0, *(np.flatnonzero(fixed[1:] != fixed[:-1]) + 1).tolist(), len(lengths)]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        part = lengths[lo:hi]
        need = max(-(-int(part.sum()) // cap), -(-int((part * part).sum()) // square), 1)
        alone = hi - lo < streams
        per = 1 if alone else streams
        k = min(-(-need // per) * per, hi - lo)
        if k == 1:  # one request (a query, a short document): nothing to cut
            out.append((lo, hi, alone))
            continue
        cuts = np.searchsorted(np.cumsum(part), part.sum() * np.arange(1, k) / k, side="left") + 1
        bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, hi - lo - 1), [hi - lo]]))
        out += [(lo + int(a), lo + int(b), alone) for a, b in zip(bounds, bounds[1:])]
    return out


def _segment_offsets(batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequence, first token inside it, tokens) of every chunk ``batch`` pools, (n_chunks,) int64 each."""
    pool_rows, pool_cu, seq = batch.segments()
    pool_cu = np.asarray(pool_cu, np.int64)
    counts = np.diff(pool_cu)
    first = pool_rows[np.minimum(pool_cu[:-1], max(len(pool_rows) - 1, 0))] if len(pool_rows) else np.zeros_like(counts)
    return seq, first - batch.cu_seqlens.astype(np.int64)[seq], counts


def _pool_finished(request, userdata) -> None:
    """AsyncInferQueue callback: the finished sub-batch's chunk vectors into ``out[lo:hi]`` (disjoint
    rows, so concurrent callbacks never overlap), read from the output in place; an error is kept
    for the caller's thread."""
    out, lo, hi, segments, pooling, _feed, errors = userdata
    try:
        out[lo:hi] = pool_dense(request.get_output_tensor(0).data, segments, pooling)
    except Exception as exc:  # noqa: BLE001 - raised by run() in the caller's thread
        errors.append(exc)
