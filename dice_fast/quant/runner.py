"""`Int8Runner`: the engine's batches through the statically quantized int8 model.

Same plan, packing, pooling and aggregation as every other precision: a `PackedBatch` comes in, its
chunks (sorted by length) run as dense padded sub-batches of at most ``max_batch_tokens`` padded
tokens (length buckets: 254-token chunks pad nothing), the valid tokens' hidden states are gathered
back into packing order, and dice_fast's segment pooling turns them into chunk vectors.

Exactness contract: none bit-wise. Agreement with float32 is stated and tested (`agreement`,
docs/int8.md): cosine of chunk vectors against the float32 engine on held-out prose.
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
    its facts and fingerprint). ``identity``: backend, versions, model and calibration hashes."""

    def __init__(self, model, spec, pooling: str, pooling_impl: str, max_batch_tokens: int,
                 pad_token_id: int | None, calibration, cache_root: Path, fingerprint: str):
        self.instructions = check_int8_cpu()
        super().__init__(model, spec, PADDED, None, pooling, pooling_impl, max_batch_tokens, pad_token_id)
        self.openvino_model, self.identity = int8_model(model, calibration, cache_root, fingerprint,
                                                  self._takes_positions, torch.get_num_threads())
        self._local = threading.local()  # one infer request per thread: a request is not thread-safe
        self.fallback_reason = None

    def _dense_hidden(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray | None) -> torch.Tensor:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.openvino_model.create_infer_request()
        feed = {"input_ids": ids, "attention_mask": mask}
        if positions is not None:
            feed["position_ids"] = positions
        out = request.infer(feed)
        return torch.from_numpy(np.array(next(iter(out.values())), dtype=np.float32, copy=True))
