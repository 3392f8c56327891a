"""The exactness oracle: every chunk alone through the plain Hugging Face model, float64 aggregation.

Written independently of dice_fast (plain Python loops, no packing, the model's own SDPA attention),
following the paper: tokenize without specials, split into chunks of k tokens with overlap o, wrap
each chunk as a standalone input, positions restarting per chunk (or the chunk's document offset for
"global"), pool tokens, aggregate chunk vectors, L2-normalise.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch


def chunk_token_lists(ids, k, o, max_chunks=None):
    chunks, start = [], 0
    while True:
        chunks.append((start, ids[start : start + k]))
        if start + k >= len(ids):
            break
        start += k - o
    return chunks[:max_chunks] if max_chunks else chunks


@functools.lru_cache(maxsize=None)
def _plain_copies():
    return {}


def plain_model(model):
    """A private copy of ``model`` with the attention implementation it was created with, so the
    oracle never runs through anything dice_fast registered on the shared model."""
    copies = _plain_copies()
    if id(model) not in copies:
        twin = copy.deepcopy(model)
        original = getattr(model.config, "_dice_fast_original_attn", None) or model.config._attn_implementation
        twin.config._attn_implementation = original
        copies[id(model)] = (model, twin)  # keep the original alive so its id is not reused
    return copies[id(model)][1]


def encode_chunk(model, ids, positions, pooling, attention):
    if not ids:
        return None
    model = plain_model(model)
    x = torch.tensor([ids])
    kw = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kw["position_ids"] = torch.tensor([positions])
    n = len(ids)
    if attention == "bidirectional":
        kw["attention_mask"] = torch.ones(1, 1, n, n, dtype=torch.bool)
    elif attention == "causal":
        kw["attention_mask"] = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        h = model(input_ids=x, **kw).last_hidden_state[0].double()
    return {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]


def aggregate(vecs, weights, raw_norms, aggregation, top_k, temperature):
    """Chunk vectors -> document vector; top-k / softmax use the chunk norms before normalize_chunks."""
    v = torch.stack(vecs)
    if aggregation == "mean":
        return v.mean(0)
    if aggregation == "weighted_mean":
        w = torch.tensor(weights, dtype=torch.float64)
        return (w[:, None] * v).sum(0) / w.sum()
    if aggregation == "max":
        return v.max(0).values
    norms = torch.tensor(raw_norms, dtype=torch.float64)
    if aggregation == "topk_norm":
        order = sorted(range(len(vecs)), key=lambda i: (-float(norms[i]), i))[:top_k]
        return v[order].mean(0)
    w = torch.softmax(norms / temperature, 0)
    return (w[:, None] * v).sum(0)


def prefix_as_before_text(tokenizer, text_prefix: str) -> list[int]:
    """The ids a text prefix ("passage: ") has when it is tokenized together with the text after it (as
    sentence-transformers' prompts are): the tokens of ``text_prefix + "x"`` that end inside the prefix
    without its trailing spaces (which the next word's token takes)."""
    if not text_prefix:
        return []
    enc = tokenizer(text_prefix + "x", add_special_tokens=False, return_offsets_mapping=True)
    keep = len(text_prefix.rstrip(" "))
    return [i for i, (_, end) in zip(enc["input_ids"], enc["offset_mapping"]) if end <= keep]


def text_after_prefix(tokenizer, text_prefix: str, text: str) -> list[int]:
    """The ids ``text`` has when tokenized together with ``text_prefix`` before it: the tokens of
    ``text_prefix + text`` that end past the prefix without its trailing spaces; where one token spans
    both ("query:" + "," as ":," with a word-level tokenizer), the text's own ids, as the engine
    documents (`dice_fast.text_prefix`)."""
    if not text_prefix or not text:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    enc = tokenizer(text_prefix + text, add_special_tokens=False, return_offsets_mapping=True)
    keep = len(text_prefix.rstrip(" "))
    if any(start < keep < end for start, end in enc["offset_mapping"]):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [i for i, (_, end) in zip(enc["input_ids"], enc["offset_mapping"]) if end > keep]


def reference_encode(model, tokenizer, texts, *, prefix, suffix, first_position, chunk_size, overlap=0,
                     pooling="mean", aggregation="mean", top_k=2, temperature=1.0, positions="local",
                     normalize_chunks=False, normalize=True, max_chunks=None, text_prefix="", attention="model default"):
    """(n_docs, H) float64 numpy document vectors and the list of per-document chunk vectors."""
    pre = list(prefix) + prefix_as_before_text(tokenizer, text_prefix)
    docs, all_chunks = [], []
    for text in texts:
        ids = text_after_prefix(tokenizer, text_prefix, text)
        vecs, weights, raw_norms = [], [], []
        for start, content in chunk_token_lists(ids, chunk_size, overlap, max_chunks):
            wrapped = pre + content + list(suffix)
            pos = [first_position + j + (start if positions == "global" else 0) for j in range(len(wrapped))]
            v = encode_chunk(model, wrapped, pos, pooling, attention)
            if v is None:
                v = torch.zeros(model.config.hidden_size, dtype=torch.float64)
            raw_norms.append(float(v.norm()))
            if normalize_chunks:
                v = v / v.norm().clamp_min(1e-12)
            vecs.append(v)
            weights.append(len(wrapped))
        docs.append(_document(vecs, weights, raw_norms, aggregation, top_k, temperature, normalize))
        all_chunks.append(torch.stack(vecs).numpy())
    return torch.stack(docs).numpy(), all_chunks


def _document(vecs, weights, raw_norms, aggregation, top_k, temperature, normalize):
    """One document's float64 vector from its chunk vectors (the aggregation, then the L2 norm)."""
    d = aggregate(vecs, weights, raw_norms, aggregation, top_k, temperature)
    return d / d.norm().clamp_min(1e-12) if normalize else d


def late_windows(n_tokens, chunks, capacity, overlap):
    """Late chunking's windows of a document of ``n_tokens`` with ``chunks`` [(start, ids)], written as a
    plain loop: [(window start, window end, [chunk indices pooled in it])]. Greedy from the first chunk
    not yet pooled: ceil(overlap/2) tokens of context before it, the most chunks that fit with
    overlap//2 tokens after the last of them."""
    left, right = overlap - overlap // 2, overlap // 2
    out, c = [], 0
    while c < len(chunks):
        a = max(0, chunks[c][0] - left)
        j = c
        while j + 1 < len(chunks) and min(n_tokens, chunks[j + 1][0] + len(chunks[j + 1][1]) + right) - a <= capacity:
            j += 1
        out.append((a, min(n_tokens, chunks[j][0] + len(chunks[j][1]) + right), list(range(c, j + 1))))
        c = j + 1
    return out


def late_reference_encode(model, tokenizer, texts, *, prefix, suffix, first_position, chunk_size, capacity,
                          overlap, aggregation="mean", top_k=2, temperature=1.0, normalize_chunks=False,
                          normalize=True, max_chunks=None, attention="model default"):
    """Late chunking by hand: each window alone (wrapped, positions from ``first_position``) through the
    plain model, every chunk the float64 mean of its own tokens' states (a chunk without tokens: its
    whole window). Returns (n_docs, H) float64 document vectors and per-document chunk vectors."""
    docs, all_chunks = [], []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        chunks = chunk_token_lists(ids, chunk_size, 0, max_chunks)
        vecs = [None] * len(chunks)
        weights = [0] * len(chunks)
        for a, b, owned in late_windows(len(ids), chunks, capacity, overlap):
            wrapped = list(prefix) + ids[a:b] + list(suffix)
            if not wrapped:  # an empty document of a model without special tokens: nothing runs
                vecs[owned[0]] = torch.zeros(model.config.hidden_size, dtype=torch.float64)
                continue
            model_ = plain_model(model)
            kw = {}
            if "position_ids" in inspect.signature(model_.forward).parameters:
                kw["position_ids"] = torch.tensor([[first_position + j for j in range(len(wrapped))]])
            n = len(wrapped)
            if attention == "bidirectional":
                kw["attention_mask"] = torch.ones(1, 1, n, n, dtype=torch.bool)
            with torch.no_grad():
                h = model_(input_ids=torch.tensor([wrapped]), **kw).last_hidden_state[0].double()
            for c in owned:
                start, content = chunks[c]
                lo = len(prefix) + start - a
                vecs[c] = h[lo:lo + len(content)].mean(0) if content else h.mean(0)
                weights[c] = len(content) if content else n
        raw_norms = [float(v.norm()) for v in vecs]
        if normalize_chunks:
            vecs = [v / v.norm().clamp_min(1e-12) for v in vecs]
        docs.append(_document(vecs, weights, raw_norms, aggregation, top_k, temperature, normalize))
        all_chunks.append(torch.stack(vecs).numpy())
    return torch.stack(docs).numpy(), all_chunks
