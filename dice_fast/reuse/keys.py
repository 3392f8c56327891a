"""What identifies a chunk: its identity bytes and 64-bit key.

A chunk's pooled vector is a pure function of the model, the options that shape a chunk (dtype,
device type, token pooling, causal or bidirectional attention) and the token ids the model sees
(special tokens, prefix, text, suffix), plus its start offset under ``positions="global"``. A late
chunk's vector depends on its whole window: its identity is the chunk's span inside the window's
wrapped ids plus their SHA-256 (tagged apart, so a DICE identity never equals a late one). A plan
whose pooling leaves leading tokens out (`EncodingPlan.unpooled`: a prompt under include_prompt false)
puts b"U" and their count first in every identity. So:

* `model_fingerprint(model)`: the model part of a cache namespace (config and every weight).
* `chunk_keys(plan, salt)` gives every chunk of a plan its **identity** (bytes: a positions header
  and the wrapped ids as int32) and a 64-bit **key** (the first 8 bytes of SHA-256 of salt +
  identity). Keys only find candidates: a match is used only when the identities are equal.

The in-memory store is `dice_fast.reuse.memory`, the persistent one `dice_fast.reuse.persistent`;
`dice_fast.reuse.manager` is what the queue holds to use them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
from ..errors import OptionError


# --------------------------------------------------------------------------------------------
@dataclass
class ChunkKeys:
    """keys: (n_chunks,) int64; messages: n_chunks bytes, ``salt`` + identity (see the module docstring)."""

    keys: np.ndarray
    messages: list
    salt_len: int

    def identity(self, c: int) -> bytes:
        """The identity of chunk ``c`` (what is stored and compared)."""
        return self.messages[c][self.salt_len:]


def chunk_keys(plan, salt: bytes = b"") -> ChunkKeys:
    """Identity and key of every chunk of ``plan`` (an `EncodingPlan`). Cost: one pass over its
    tokens plus about a microsecond per chunk (a SHA-256 of its ids)."""
    ids = plan.tokens.ids
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= 2**31):
        raise OptionError("token ids must lie in [0, 2**31) to be keyed")
    raw = ids.astype("<i4").tobytes()
    salt_len = len(salt)
    if plan.unpooled:  # the leading tokens its pooling leaves out, first in every identity
        salt += b"U" + int(plan.unpooled).to_bytes(4, "little")
    pre = np.asarray(plan.prefix, "<i4").tobytes()
    suf = np.asarray(plan.suffix, "<i4").tobytes()
    ch = plan.chunks
    starts = (plan.tokens.offsets[ch.document] + ch.start) * 4
    ends = starts + ch.length * 4
    messages = []
    sha = hashlib.sha256
    if plan.windows is not None:
        messages = _late_messages(plan, raw, pre, suf, salt)
    elif plan.global_positions:
        for s, e, off in zip(starts.tolist(), ends.tolist(), ch.start.tolist()):
            messages.append(salt + b"G" + off.to_bytes(8, "little") + pre + raw[s:e] + suf)
    else:
        head = salt + b"L" + pre
        messages = [head + raw[s:e] + suf for s, e in zip(starts.tolist(), ends.tolist())]
    keys = np.fromiter((int.from_bytes(sha(m).digest()[:8], "little", signed=True) for m in messages),
                       np.int64, len(messages))
    return ChunkKeys(keys, messages, salt_len)


def _late_messages(plan, raw: bytes, pre: bytes, suf: bytes, salt: bytes) -> list:
    """salt + b"D" + the chunk's (offset in its wrapped window, length) + the SHA-256 of the wrapped
    window, per chunk: each window is hashed once, and an identity is 49 bytes whatever the window.

    The offset counts from the window's first wrapped id (special tokens and prefix included): counted
    from its text, a prefixed window and an unprefixed one holding the prefix as text would share an
    identity while pooling different tokens. (Tag "V" held the whole window in every chunk's identity
    until 2026-12-05, O(chunks x window) memory and cache rows, and tag "W" counted from the text before
    that: their entries never match a "D" identity.)"""
    w, ch = plan.windows, plan.chunks
    win = w.chunk_window
    w_starts = (plan.tokens.offsets[w.document] + w.start) * 4
    w_ends = w_starts + w.length * 4
    digests = [hashlib.sha256(pre + raw[s:e] + suf).digest() for s, e in zip(w_starts.tolist(), w_ends.tolist())]
    offset = (len(plan.prefix) + ch.start - w.start[win]).tolist()
    head = salt + b"D"
    return [head + o.to_bytes(8, "little", signed=True) + n.to_bytes(8, "little") + digests[k]
            for o, n, k in zip(offset, ch.length.tolist(), win.tolist())]


__all__ = ["ChunkKeys", "chunk_keys"]


def model_fingerprint(model) -> str:
    """SHA-256 (hex) of a model's config (without paths and versions) and every state_dict tensor's
    name, dtype, shape and bytes. Reads every weight once (about 1 s per GB)."""
    import torch

    h = hashlib.sha256()
    config = model.config.to_dict()
    # bookkeeping that changes no vector: save_pretrained() writes architectures and dtype into a loaded
    # model's config (dtype is in the namespace on its own)
    ignored = ("transformers_version", "name_or_path", "architectures", "dtype", "torch_dtype")
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ignored}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, t in model.state_dict().items():
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.contiguous().reshape(-1)
        data = flat.view(torch.uint8) if flat.numel() else flat
        h.update(data.cpu().numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()
