"""Naive chunk batching: the paths dice_fast is measured against.

Each gives the same DICE document vectors as the engine (same `EncodingPlan`: chunks, wrapping,
positions; same pooling and aggregation) the way a user or the paper's reference code would:

* `encode_padded_sorted` ("padded_sorted"): every chunk of the corpus sorted by length, padded
  batches of a fixed count, the model's own (SDPA) attention with a padding mask — the paper's
  reference code; sorting keeps padding small.
* `encode_padded_naive` ("padded_naive"): the loop users actually write — chunks in corpus order
  (document by document), a fixed count per batch, each padded to its longest chunk.
* `encode_sentence_transformers`: the chunks' texts (decoded from the plan's token ids) through
  ``SentenceTransformer.encode``, then the encoder's aggregation.

Chunk vectors are aggregated with `dice_fast.ops.aggregate_documents` (``impl="auto"``, the engine's
fast path), so the baselines are timed on their batching, not on a slow aggregation.
"""

from __future__ import annotations

import numpy as np
import torch

from ..matryoshka import truncate
from ..ops import aggregate_documents
from ..runner import to_device
from ..text_prefix import prompt_left_out


def encode_padded_sorted(encoder, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """texts: n_docs strings -> (n_docs, dim) float32; chunks sorted by length, padded batches of ``batch_size``.

    ``encoder`` is a `DiceEncoder`: its model, plan and options are used, not its packed path.
    """
    return _encode_padded(encoder, texts, batch_size, sort=True)


def encode_padded_naive(encoder, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """texts: n_docs strings -> (n_docs, dim) float32; chunks in corpus order, padded batches of ``batch_size``."""
    return _encode_padded(encoder, texts, batch_size, sort=False)


def encode_sentence_transformers(st_model, encoder, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """texts: n_docs strings -> (n_docs, dim) float32: ``encoder.plan``'s chunks decoded to text (with the
    document prefix), ``st_model.encode`` on them, then ``encoder``'s aggregation and normalisation.

    The chunk pipeline (wrapping, pooling, Normalize) is the sentence-transformers model's own;
    decoding and re-tokenizing may not give back exactly the plan's tokens for every tokenizer.
    """
    plan = encoder.plan(texts)
    if plan.n_docs == 0:
        return np.zeros((0, encoder.dim), np.float32)
    ids, offsets, ch = plan.tokens.ids, plan.tokens.offsets, plan.chunks
    decode, prefix = encoder.tokenizer.decode, encoder.config.document_prefix
    chunk_texts = [
        prefix + decode(ids[offsets[d] + s : offsets[d] + s + n].tolist())
        for d, s, n in zip(ch.document.tolist(), ch.start.tolist(), ch.length.tolist())
    ]
    vecs = st_model.encode(chunk_texts, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
    return _aggregate(encoder, plan, vecs.float())


def _encode_padded(encoder, texts: list[str], batch_size: int, sort: bool) -> np.ndarray:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model, device = encoder.model, encoder.device
    plan = encoder.plan(texts)
    lengths = plan.chunk_lengths
    order = np.argsort(-lengths, kind="stable") if sort else np.arange(plan.n_chunks)
    chunks = torch.zeros((plan.n_chunks, encoder.spec.hidden_size), dtype=torch.float32, device=device)
    pad = encoder.tokenizer.pad_token_id
    pad = 0 if pad is None else pad
    first = encoder.spec.first_position
    with torch.inference_mode():
        for lo in range(0, len(order), batch_size):
            idx = order[lo : lo + batch_size]
            n = lengths[idx]
            width = int(n.max())
            if width == 0:  # only empty chunks (a tokenizer without special tokens): zero vectors
                continue
            ids = np.full((len(idx), width), pad, dtype=np.int64)
            for row, c in enumerate(idx.tolist()):
                ids[row, : n[row]] = plan.chunk_ids(c)
            valid = np.arange(width)[None, :] < n[:, None]
            positions = np.broadcast_to(np.arange(width, dtype=np.int64) + first, valid.shape)
            if plan.global_positions:
                positions = positions + plan.chunks.start[idx][:, None]
            positions = np.where(valid, positions, first)  # padding stays inside the position table
            # copies as the engine makes them (`runner.to_device`: pinned, non-blocking on CUDA), so a
            # speed-up over this path is packing, not the engine's overlap of copies with compute
            valid_t = to_device(valid, device)
            hidden = model(
                input_ids=to_device(ids, device),
                attention_mask=_attention_mask(valid_t, encoder.causal),
                position_ids=to_device(positions, device),
            ).last_hidden_state
            skip = prompt_left_out(plan.unpooled, n)
            chunks[to_device(idx, device)] = _pool(hidden, to_device(skip, device), to_device(n, device), encoder.pooling)
    head = encoder.settings.head  # the model's modules on the pooled vector, as the engine runs them
    return _aggregate(encoder, plan, chunks if head is None else head(chunks))


def _attention_mask(valid: torch.Tensor, causal: bool | None) -> torch.Tensor:
    """(batch, width) padding mask, or (batch, 1, width, width) bool when ``causal`` overrides the model."""
    if causal is None:
        return valid.long()
    mask = valid[:, None, None, :].expand(-1, 1, valid.shape[1], -1)
    if causal:
        mask = mask & torch.ones(valid.shape[1], valid.shape[1], dtype=torch.bool, device=valid.device).tril()
    return mask


def _pool(hidden: torch.Tensor, first: torch.Tensor, n: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden: (batch, width, H) -> (batch, H) float32 over each row's tokens ``first:n`` of its ``n`` valid
    ones (0 for n == 0)."""
    rows = torch.arange(len(n), device=hidden.device)
    if pooling == "mean":
        cols = torch.arange(hidden.shape[1], device=hidden.device)[None, :]
        pooled = (cols >= first[:, None]) & (cols < n[:, None])
        vec = hidden.float().masked_fill(~pooled[..., None], 0.0).sum(1) / (n - first).clamp_min(1)[:, None].float()
    elif pooling == "cls":
        vec = hidden[rows, first].float()
    else:
        vec = hidden[rows, (n - 1).clamp_min(0)].float()
    return vec.masked_fill((n == 0)[:, None], 0.0)


def _aggregate(encoder, plan, chunks: torch.Tensor) -> np.ndarray:
    """(n_chunks, dim) float32 chunk vectors -> (n_docs, dim) float32 with ``encoder``'s aggregation."""
    cfg, device = encoder.config, chunks.device
    cu = torch.from_numpy(plan.chunks.cu_doc_chunks).to(device)
    weights = torch.from_numpy(plan.chunk_weights).to(device)
    out = aggregate_documents(chunks, cu, weights, cfg.aggregation, cfg.top_k, cfg.temperature,
                              encoder.normalize_chunks, cfg.normalize, impl="auto")
    return truncate(out, cfg.truncate_dim, cfg.normalize).cpu().numpy()
