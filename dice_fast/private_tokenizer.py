"""The tokenizer dice_fast calls: its own copy of the one it was given, one call at a time.

    tok, lock = private_tokenizer(tokenizer)   # a copy (or, passed one of its copies, that one) and its lock
    with lock:
        tok(texts, ...)
    lowercasing(tok)                           # a model whose sentence-transformers config says do_lower_case
"""

from __future__ import annotations

import threading
import weakref


def private_tokenizer(tokenizer) -> tuple[object, threading.Lock]:
    """(a copy of ``tokenizer`` for dice_fast's own calls, the lock every such call takes). A
    transformers fast tokenizer sets its Rust tokenizer's truncation and padding before each call,
    then encodes: a caller's ``tokenizer(texts, truncation=True, max_length=8)`` in another thread,
    between those two steps of an encoder's call, cut the encoder's documents to 8 tokens, silently;
    and a fast tokenizer is not safe to call from two threads. A copy costs ~40 ms and ~7 MB for
    all-MiniLM-L6-v2's. A copy made here, passed again (an encoder built over another's: the
    integrations' variants, evaluation twins), is shared with its lock, not copied again; a tokenizer
    that cannot be copied is used as given, one dice_fast call at a time."""
    import copy

    with _PRIVATE_LOCK:
        if tokenizer not in _PRIVATE:
            try:
                tokenizer = copy.deepcopy(tokenizer)
            except Exception:  # noqa: BLE001 - shared with the caller then, as before copies
                pass
            _PRIVATE.setdefault(tokenizer, threading.Lock())
        return tokenizer, _PRIVATE[tokenizer]


def lowercasing(tokenizer):
    """``tokenizer`` (dice_fast's copy) made to lowercase every text first, as sentence-transformers applies
    a model's ``do_lower_case``: a Lowercase normalizer before its own, unless one is there already (the
    offsets still point into the text as given). Returns the same tokenizer."""
    from tokenizers import normalizers

    backend = tokenizer.backend_tokenizer
    current = backend.normalizer
    if not (isinstance(current, normalizers.Lowercase) or (isinstance(current, normalizers.Sequence)
                                                           and any(isinstance(n, normalizers.Lowercase) for n in current))):
        rest = list(current) if isinstance(current, normalizers.Sequence) else [] if current is None else [current]
        backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), *rest])
    return tokenizer


_PRIVATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # dice_fast's tokenizers -> their lock
_PRIVATE_LOCK = threading.Lock()
