"""`Int8Runner`: the engine's batches through the statically quantized int8 model.

Same plan, packing, pooling and aggregation as every other precision: a `PackedBatch` comes in, its
chunks (sorted by length) run as dense padded sub-batches (length buckets: 254-token chunks pad
nothing), the valid tokens' hidden states are gathered back into packing order, and dice_fast's
segment pooling turns them into chunk vectors.

Speed: the compiled model has ``streams`` OpenVINO streams (default: one per inference thread, each
stream one thread) and a batch's sub-batches (``max_batch_tokens / streams`` padded tokens each) are
kept ``streams`` at a time in flight in an `openvino.AsyncInferQueue`, so every core runs its own
request instead of all cores synchronising inside one (``streams=1``: one synchronous request with
every thread, the first version). Measured in benchmarks/RESULTS.md (int8 throughput section).

Exactness contract: none bit-wise. Agreement with float32 is stated and tested (`agreement`,
docs/int8.md): cosine of chunk vectors against the float32 engine on held-out prose. Static scales
make a chunk's vector independent of its sub-batch neighbours and of which stream runs it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from ..runner import PADDED, ModelRunner
from .cpu import check_int8_cpu
from .openvino import int8_model


class Int8Runner(ModelRunner):
    """A `ModelRunner` whose dense forward is the int8 OpenVINO model (the float model is kept only for
    its facts and fingerprint). ``identity``: backend, versions, model and calibration hashes;
    ``streams``: requests in flight (None: one per inference thread); ``hints``: extra OpenVINO
    compile properties (measurements only, e.g. ``{"INFERENCE_PRECISION_HINT": "f32"}``)."""

    def __init__(self, model, spec, pooling: str, pooling_impl: str, max_batch_tokens: int,
                 pad_token_id: int | None, calibration, cache_root: Path, fingerprint: str,
                 streams: int | None = None, hints: dict | None = None):
        self.instructions = check_int8_cpu()
        super().__init__(model, spec, PADDED, None, pooling, pooling_impl, max_batch_tokens, pad_token_id)
        threads = torch.get_num_threads()
        self.streams = max(1, int(streams if streams is not None else threads))
        self.openvino_model, self.identity = int8_model(model, calibration, cache_root, fingerprint,
                                                        self._takes_positions, threads, self.streams, hints)
        self._local = threading.local()  # one request queue per thread: a queue is not thread-safe
        self.fallback_reason = None

    def _queue(self):
        queue = getattr(self._local, "queue", None)
        if queue is None:
            import openvino as ov

            queue = self._local.queue = ov.AsyncInferQueue(self.openvino_model, self.streams)
            queue.set_callback(_gather)
        return queue

    def _padded_hidden(self, batch) -> torch.Tensor:
        """(T, H) float32 hidden states of the batch's tokens in packed order; sub-batches of at most
        ``max_batch_tokens / streams`` padded tokens, ``streams`` of them in flight."""
        out = np.empty((batch.n_tokens, self.spec.hidden_size), np.float32)
        errors: list = []
        queue = self._queue()
        for t_lo, t_hi, ids, mask, pos in self.dense_batches(batch, max(1, self.max_batch_tokens // self.streams)):
            feed = {"input_ids": ids, "attention_mask": mask}
            if pos is not None:
                feed["position_ids"] = pos
            # share_inputs: OpenVINO reads the arrays in place (kept alive by userdata until done)
            queue.start_async(feed, (out, t_lo, t_hi, mask.astype(bool), feed, errors), share_inputs=True)
        queue.wait_all()
        if errors:
            raise errors[0]
        return torch.from_numpy(out)


def _gather(request, userdata) -> None:
    """AsyncInferQueue callback: the finished sub-batch's valid tokens into ``out[t_lo:t_hi]``
    (disjoint slices, so concurrent callbacks never overlap); an error is kept for the caller."""
    out, t_lo, t_hi, valid, _feed, errors = userdata
    try:
        out[t_lo:t_hi] = request.get_output_tensor(0).data[valid]
    except Exception as exc:  # noqa: BLE001 - raised by _padded_hidden in the caller's thread
        errors.append(exc)
