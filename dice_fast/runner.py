"""Running packed batches through the frozen model: the packed path where it is exact, else a padded one.

`ModelRunner.run(batch)` takes a `PackedBatch` and returns its chunk vectors. Two paths, both exact:

* **packed**: one forward over the flat sequence with dice_fast's varlen attention (block-diagonal:
  a chunk sees only itself); used for every model whose attention goes through transformers'
  ``AttentionInterface`` and adds nothing of its own (no relative-position bias or custom mask);
* **padded** (the fallback): the batch's chunks, already sorted by length, padded into dense
  sub-batches of at most ``max_batch_tokens`` padded tokens and run with the model's own attention
  and mask. Used for models that bypass the interface (MPNet, DeBERTa-v2, T5 encoders: relative
  position biases), and for chunks longer than a sliding attention window on a ``torch_varlen``
  without ``window_size`` (torch 2.9-2.10); every other backend bands the window inside chunks.

With ``compile=True`` the packed path runs compiled (`dice_fast.compiled`: the same attention as a
traceable op, one dynamic graph for every batch size), made at construction and checked against the
eager packed forward on the probe batch; a model on the padded fallback is refused.

Which path a model takes is found at construction by a probe: two short chunks are run packed and
each alone, and the packed path is kept only if the attention function saw every layer without a
bias of its own and the hidden states agree. Nothing here mutates the model after construction. On
a CPU both paths run the model's linears through the GEMM measured fastest there (`dice_fast.cpu_linear`).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from . import attention as attn
from . import cpu_fusion, cpu_layer_norm, cpu_linear, cpu_paths
from .nosync import sync_free_kwargs
from .ops import pool_chunks
from .packing import PackedBatch, pack
from .chunking import ChunkPlan, TokenizedDocuments
from .config import dtype_name
from .errors import ModelError, OptionError

PADDED = "padded"
# the attention backends the compiled forward (dice_fast.compiled) traces, per device type
COMPILED_BACKENDS = {"cpu": ("sdpa_groups",), "cuda": ("sdpa_groups", "flash_attn", "torch_varlen")}
# relative error of the probe's packed hidden states against per-chunk forwards; chunks attending to
# each other differ by > 0.1 on every model tried, rounding by < 1e-6 (fp32) / 1e-2 (bf16)
_PROBE_TOLERANCE = {torch.float32: 1e-4}
_PROBE_TOLERANCE_HALF = 3e-2


def sliding_window(config) -> int | None:
    """Longest chunk (tokens) that a sliding attention window of ``config`` leaves unaffected, or None.

    ``config.sliding_window`` is the causal window of Mistral-style models and half the local window of
    ModernBERT; a chunk no longer than it sees the same tokens with or without the window.
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and not any("sliding" in str(t) for t in types):
        return None
    return int(window)


class ModelRunner:
    """Runs packed batches of one frozen model; ``backend`` names the attention the packed path uses
    or ``"padded"`` when the model runs on the fallback only."""

    def __init__(self, model, spec, backend: str, causal: bool | None, pooling: str, pooling_impl: str,
                 max_batch_tokens: int, pad_token_id: int | None, compile: bool = False):
        self.model, self.spec, self.causal = model, spec, causal
        self.compiled = None  # a dice_fast.compiled.CompiledForward when the packed forward is compiled
        self._linear: str | None = None  # the CPU linear kernel (dice_fast.cpu_linear), chosen at the first forward
        self._gelu_pairs: tuple = ()  # the linears fused with their GELU (dice_fast.cpu_fusion), found then
        self._layer_norm = None  # dice_fast.cpu_layer_norm.layer_norm where it runs a bf16 model's LayerNorms, decided then
        self.pooling, self.pooling_impl, self.max_batch_tokens = pooling, pooling_impl, max_batch_tokens
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu":
            cpu_paths.warn_if_emulated(param.dtype)
        self.pad_id = int(pad_token_id or 0)
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self.takes_cache = "use_cache" in params
        # chunks longer than a sliding window run packed where the backend applies the window itself
        self.packed_limit = None if attn.supports_sliding_window(backend) else sliding_window(model.config)
        self.fallback_reason: str | None = None
        if backend != PADDED:
            attn.install(model)
            self.fallback_reason = self._probe(backend)
            if self.fallback_reason is not None:
                attn.uninstall(model)
        self.backend = PADDED if backend == PADDED or self.fallback_reason is not None else backend
        # the padded path runs the model's own attention mask: a forced mode would be silently ignored
        if self.backend == PADDED and causal is not None and causal != spec.is_causal:
            raise OptionError(
                f"attention={'causal' if causal else 'bidirectional'} needs the packed path, but this model runs "
                f"on the padded fallback ({self.fallback_reason or 'attention_backend=padded'}); use the model's "
                "own attention"
            )
        if compile:
            self._compile()

    # ----------------------------------------------------------------------------------------
    def run(self, batch: PackedBatch) -> torch.Tensor:
        """Chunk vectors of ``batch``: (n_chunks, hidden_size) float32 in the batch's packing order."""
        if batch.n_tokens == 0:
            return torch.zeros((0, self.spec.hidden_size), dtype=torch.float32, device=self.device)
        self.check_placement()
        cu = on_device(batch, "cu_seqlens", self.device)
        with torch.inference_mode():
            if self.uses_packed(batch.max_seqlen):
                if not attn.installed(self.model):  # the caller switched the model's attention since
                    attn.install(self.model)
                hidden = (self._compiled_hidden(batch, cu) if self.compiled is not None
                          else self._packed_hidden(batch, cu, self.causal)[0])
            else:
                hidden = self._padded_hidden(batch)
            return pool_batch(hidden, batch, cu, self.pooling, self.pooling_impl)

    def check_placement(self) -> None:
        """`ModelError` when the model's weights are no longer where and what they were at construction
        (another encoder built on the same model object moved them): the vectors, and the chunk cache's
        key, would silently change."""
        param = next(self.model.parameters())
        if param.dtype != self.dtype or param.device != self.device:
            were = f"{dtype_name(self.dtype)} on {self.device}"
            raise ModelError(f"the model's weights are now {dtype_name(param.dtype)} on {param.device}, "
                             f"not the {were} this encoder was built with: another encoder on the same model object "
                             "(or its caller) moved them; give each encoder its own copy of the model "
                             "(copy.deepcopy), or build them with the same dtype and device")

    def uses_packed(self, longest_chunk: int) -> bool:
        """Whether a batch whose longest chunk has ``longest_chunk`` tokens runs packed."""
        return self.backend != PADDED and (self.packed_limit is None or longest_chunk <= self.packed_limit)

    def _packed_hidden(self, batch: PackedBatch, cu: torch.Tensor, causal) -> tuple[torch.Tensor, object]:
        """(hidden states, the forward's `attention_context` record)."""
        kwargs = {"use_cache": False} if self.takes_cache else {}
        ids = on_device(batch, "input_ids", self.device).unsqueeze(0)
        pos = on_device(batch, "position_ids", self.device)
        kwargs.update(sync_free_kwargs(ids))  # no host sync in transformers' mask code
        with attn.attention_context(self.backend, causal, batch.lengths, batch.cu_seqlens) as run, self.linear_mode():
            out = self.model(
                input_ids=ids,
                position_ids=pos.unsqueeze(0),
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen,
                **kwargs,
            )
        return out.last_hidden_state[0], run

    def linear_mode(self):
        """The context the eager forward runs its linears in: oneDNN's kernel where it was measured faster
        on this CPU for the model's dtype (`dice_fast.cpu_linear`), with each linear that feeds only a GELU
        fused with it (`dice_fast.cpu_fusion`); else torch's own. A bf16 model's LayerNorms run on
        dice_fast's kernel where it was measured faster (`dice_fast.cpu_layer_norm`)."""
        if self._linear is None:
            kernel = cpu_linear.model_kernel(self.model)
            self._gelu_pairs = cpu_fusion.gelu_pairs(self.model) if kernel == "onednn" else ()
            param = next(self.model.parameters())
            if param.device.type == "cpu" and param.dtype == torch.bfloat16 and cpu_layer_norm.kernel() == "native":
                self._layer_norm = cpu_layer_norm.layer_norm
            self._linear = kernel
        return cpu_linear.linear_mode(self._linear, gelu=cpu_fusion.active(self._gelu_pairs),
                                      layer_norm=self._layer_norm)

    def cpu_label(self) -> str:
        """The CPU kernels the eager forward chose, as the encoder's repr shows them: ``", cpu_linear=onednn
        (6 with gelu), cpu_layer_norm=native"``; "" before the first forward, or off the CPU."""
        if self._linear is None or self.device.type != "cpu":
            return ""
        fused = f" ({len(self._gelu_pairs)} with gelu)" if self._gelu_pairs else ""
        native_ln = "" if self._layer_norm is None else ", cpu_layer_norm=native" + (" (eager batches)" if self.compiled else "")
        return f", cpu_linear={self._linear}{fused}{native_ln}"

    def _compiled_hidden(self, batch: PackedBatch, cu: torch.Tensor) -> torch.Tensor:
        from .attention_op import group_table, max_len_tensor

        groups = (group_table(attn.length_runs(batch.lengths, batch.cu_seqlens)) if self.backend == "sdpa_groups"
                  else max_len_tensor(batch.max_seqlen))
        return self.compiled(on_device(batch, "input_ids", self.device), on_device(batch, "position_ids", self.device),
                             cu, groups, self.causal)

    def _compile(self) -> None:
        """Compile the packed forward (`dice_fast.compiled`) on the probe batch, checked against eager."""
        if self.backend not in COMPILED_BACKENDS.get(self.device.type, ("sdpa_groups",)):
            why = self.fallback_reason or f"attention_backend={self.backend} on {self.device.type}"
            raise OptionError(
                f"compile='on' compiles the packed forward (sdpa_groups; on CUDA also flash_attn, torch_varlen), but "
                f"this model runs on {self.backend} ({why}); use compile='off'"
                + ("" if self.backend == PADDED else " or attention_backend='sdpa_groups'")
            )
        from .compiled import CompiledForward, compiler_missing

        missing = compiler_missing(self.device.type)
        if missing:
            raise OptionError(f"compile='on': {missing}; or use compile='off'")
        self.compiled = CompiledForward(self.model, self.takes_cache, self.backend)
        batch = _probe_batch(self)
        cu = to_device(batch.cu_seqlens, self.device)
        with torch.inference_mode():
            got = self._compiled_hidden(batch, cu).float()
            want = self._packed_hidden(batch, cu, self.causal)[0].float()
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        if not err <= _PROBE_TOLERANCE.get(self.model.dtype, _PROBE_TOLERANCE_HALF):
            raise RuntimeError(f"the compiled forward differs from the eager one on the probe (relative error {err:.2g})")

    def _padded_hidden(self, batch: PackedBatch) -> torch.Tensor:
        """(T, H) hidden states of the batch's tokens in packed order, from dense padded sub-batches."""
        out, groups = None, padded_groups(batch.lengths, self.max_batch_tokens)
        for _, _, t_lo, t_hi, ids, mask, pos in self.dense_batches(batch, groups):
            hidden = self._dense_hidden(ids, mask, pos)
            if out is None:
                out = hidden.new_empty((batch.n_tokens, hidden.shape[-1]))
            out[t_lo:t_hi] = hidden[to_device(mask, hidden.device).bool()]
        return out

    def dense_batches(self, batch: PackedBatch, groups):
        """The batch's chunks (sorted by length) as dense padded sub-batches, one per consecutive (lo, hi)
        row range of ``groups`` (`padded_groups`, the OpenVINO runner's `request_groups`): (lo, hi, t_lo,
        t_hi, ids, mask, positions) with ids / mask / positions (n, width) int64 (positions None where the
        model takes none) holding chunks ``lo:hi`` (packing order), packed tokens ``t_lo:t_hi``."""
        lengths, cu = batch.lengths, batch.cu_seqlens.astype(np.int64)
        for lo, hi in groups:
            n, width = hi - lo, int(lengths[lo])
            sub = lengths[lo:hi]
            t_lo, t_hi = int(cu[lo]), int(cu[hi])
            rows = np.repeat(np.arange(n), sub)
            cols = np.arange(t_hi - t_lo) - np.repeat(cu[lo:hi] - t_lo, sub)
            ids = np.full((n, width), self.pad_id, dtype=np.int64)
            ids[rows, cols] = batch.input_ids[t_lo:t_hi]
            mask = np.zeros((n, width), dtype=np.int64)
            mask[rows, cols] = 1
            pos = None
            if self._takes_positions:
                pos = np.full((n, width), self.spec.first_position, dtype=np.int64)
                pos[rows, cols] = batch.position_ids[t_lo:t_hi]
            yield lo, hi, t_lo, t_hi, ids, mask, pos

    def _dense_hidden(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray | None) -> torch.Tensor:
        """(B, L, H) hidden states of one dense padded batch: ids, mask, positions (B, L) int64 (positions
        None where the model takes none)."""
        kwargs = {"use_cache": False} if self.takes_cache else {}
        if positions is not None:
            kwargs["position_ids"] = to_device(positions, self.device)
        with self.linear_mode():
            return self.model(input_ids=to_device(ids, self.device), attention_mask=to_device(mask, self.device),
                              **kwargs).last_hidden_state

    # ----------------------------------------------------------------------------------------
    def _probe(self, backend: str) -> str | None:
        """Why the packed path is not exact for this model, or None when it is (see the module docstring)."""
        docs, plan, prefix, suffix = _probe_inputs(self)
        batch = _probe_batch(self)
        cu = to_device(batch.cu_seqlens, self.device)
        self.backend = backend
        with torch.inference_mode():
            packed, run = self._packed_hidden(batch, cu, None)
            alone = []
            for i in range(2):
                one = pack(docs, plan, np.array([i]), prefix, suffix, self.spec.first_position)
                alone.append(self._padded_hidden(one))
        if run.calls == 0:
            return "its attention does not go through transformers' AttentionInterface"
        if run.extra_bias:
            return "its attention adds a mask or position bias of its own"
        # per-chunk outputs are in the packed batch's (length-sorted) order
        want = torch.cat([alone[int(c)] for c in batch.chunk_ids]).float()
        if not bool(torch.isfinite(want).all()):  # nothing to compare: a NaN error said "differs" (and chose padded)
            return (f"its per-chunk forward gives NaN or infinite hidden states in {dtype_name(packed.dtype)} (the model "
                    "overflows this precision, or its weights hold NaN), so the packed forward could not be checked")
        err = float((packed.float() - want).norm() / want.norm().clamp_min(1e-12))
        tol = _PROBE_TOLERANCE.get(packed.dtype, _PROBE_TOLERANCE_HALF)
        if not err <= tol:
            return f"its packed forward differs from per-chunk forwards (relative error {err:.2g})"
        return None


def pool_batch(hidden: torch.Tensor, batch: PackedBatch, cu: torch.Tensor, pooling: str, impl: str) -> torch.Tensor:
    """(n_chunks, H) float32 chunk vectors of ``batch`` from its (T, H) hidden states: pooled per sequence
    (``cu`` its cu_seqlens on hidden's device), or over the segments it names (late chunking: the rows
    ``pool_rows`` gathered, then pooled by ``pool_cu``)."""
    if batch.pool_rows is None:
        return pool_chunks(hidden, cu, pooling, impl=impl)
    rows = to_device(batch.pool_rows, hidden.device)
    return pool_chunks(hidden.index_select(0, rows), to_device(batch.pool_cu, hidden.device), pooling, impl=impl)


def _probe_inputs(runner: ModelRunner):
    """Two chunks (5 and 3 tokens of random ids, never the pad id) of one document, and the wrapping."""
    vocab = runner.model.get_input_embeddings().num_embeddings
    ids = np.random.default_rng(0).integers(0, vocab, 16)
    ids = np.where(ids == runner.pad_id, (ids + 1) % vocab, ids)
    docs = TokenizedDocuments(ids, np.array([0, 5, 8]))
    plan = ChunkPlan(np.array([0, 1]), np.array([0, 0]), np.array([5, 3]), np.array([0, 1, 2]))
    spec = runner.spec
    return docs, plan, np.array(spec.special_prefix, np.int64), np.array(spec.special_suffix, np.int64)


def _probe_batch(runner: ModelRunner) -> PackedBatch:
    docs, plan, prefix, suffix = _probe_inputs(runner)
    return pack(docs, plan, np.arange(2), prefix, suffix, runner.spec.first_position)


def padded_groups(lengths: np.ndarray, budget: int):
    """Consecutive ranges of the (non-increasing) ``lengths`` whose padded size n x longest fits ``budget``."""
    lo, n = 0, len(lengths)
    while lo < n:
        width = max(int(lengths[lo]), 1)
        hi = min(n, lo + max(budget // width, 1))
        yield lo, hi
        lo = hi


def on_device(batch: PackedBatch, name: str, device: torch.device) -> torch.Tensor:
    """``batch``'s int array ``name`` ("input_ids", "position_ids", "cu_seqlens") on ``device``: the
    pipeline's staged view when it staged the batch (one copy for all three, `dice_fast.pipeline`),
    else a copy (`to_device`)."""
    staged = batch.staged
    return getattr(staged, name) if staged is not None else to_device(getattr(batch, name), device)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as a tensor on ``device``; to CUDA through pinned memory without blocking the host, so the
    next batch is packed while the GPU still runs this one."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
