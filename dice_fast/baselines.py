"""Naive chunk batching: the baselines dice_fast is measured against.

Both produce the same DICE document vectors as the engine (same chunks, same wrapping, same pooling,
mean/other aggregation afterwards) but the way a user or the paper's reference code would:

* `encode_padded`: chunk token ids sorted by length, padded batches of a fixed count, the model's
  own (SDPA) attention with a padding mask, chunk vectors aggregated per document afterwards — the
  reference implementation's way, with right padding so positions are correct.
* `encode_sentence_transformers`: the chunks' texts (token chunks decoded back to text) through
  ``SentenceTransformer.encode`` and a per-document mean, as a user would write it.
"""

from __future__ import annotations

import numpy as np
import torch

from .chunking import plan_chunks, tokenize
from .ops import aggregate_documents


def encode_padded(encoder, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """texts: n_docs strings -> (n_docs, dim) float32 with ``encoder``'s model, chunking and options.

    ``encoder`` is a `DiceEncoder`; only its model, tokenizer and options are used (its packed path is not).
    """
    model, spec, cfg = encoder.model, encoder.spec, encoder.config
    docs = tokenize(encoder.tokenizer, texts)
    plan = plan_chunks(docs.lengths, cfg.chunk_size, cfg.overlap, cfg.max_chunks_per_document)
    prefix, suffix = (w.tolist() for w in encoder.chunk_wrapping)
    seqs = [
        prefix + docs.ids[docs.offsets[d] + s : docs.offsets[d] + s + n].tolist() + suffix
        for d, s, n in zip(plan.document, plan.start, plan.length)
    ]
    order = np.argsort([-len(s) for s in seqs], kind="stable")
    chunks = torch.zeros((len(seqs), spec.hidden_size), dtype=torch.float32, device=encoder.device)
    pad = encoder.tokenizer.pad_token_id or 0
    with torch.inference_mode():
        for lo in range(0, len(order), batch_size):
            idx = order[lo : lo + batch_size]
            width = max(len(seqs[i]) for i in idx)
            if width == 0:
                continue
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
                mask[row, : len(seqs[i])] = 1
            positions = torch.arange(width).expand(len(idx), -1) + spec.first_position
            ids, mask, positions = ids.to(encoder.device), mask.to(encoder.device), positions.to(encoder.device)
            hidden = model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state.float()
            m = mask.unsqueeze(-1).float()
            if encoder.pooling == "mean":
                vec = (hidden * m).sum(1) / m.sum(1).clamp_min(1)
            elif encoder.pooling == "cls":
                vec = hidden[:, 0]
            else:
                vec = hidden[torch.arange(len(idx), device=hidden.device), mask.sum(1) - 1]
            chunks[torch.as_tensor(idx, device=encoder.device)] = vec
    weights = torch.tensor([float(len(s)) for s in seqs], device=encoder.device)
    cu = torch.as_tensor(plan.cu_doc_chunks, device=encoder.device)
    out = aggregate_documents(chunks, cu, weights, cfg.aggregation, cfg.top_k, cfg.temperature,
                              encoder.normalize_chunks, cfg.normalize, impl="ref")
    return out.cpu().numpy()


def encode_sentence_transformers(st_model, tokenizer, texts: list[str], chunk_size: int, batch_size: int = 32) -> np.ndarray:
    """texts: n_docs strings -> (n_docs, dim) float32: token chunks decoded to text, ``st_model.encode``, mean, L2."""
    docs = tokenize(tokenizer, texts)
    plan = plan_chunks(docs.lengths, chunk_size, 0)
    chunk_texts = [
        tokenizer.decode(docs.ids[docs.offsets[d] + s : docs.offsets[d] + s + n].tolist())
        for d, s, n in zip(plan.document, plan.start, plan.length)
    ]
    vecs = st_model.encode(chunk_texts, batch_size=batch_size, convert_to_numpy=True).astype(np.float32)
    sums = np.add.reduceat(vecs, plan.cu_doc_chunks[:-1], axis=0) if len(vecs) else vecs
    means = sums / np.diff(plan.cu_doc_chunks)[:, None]
    return (means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)).astype(np.float32)
