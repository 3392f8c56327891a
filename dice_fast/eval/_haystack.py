"""The haystack of the synthetic tasks: a filler or prose text tokenized once, with the token windows
a document may be cut at (see `dice_fast.eval.tasks`)."""

from __future__ import annotations

import functools

import numpy as np

from ..data import prose

__all__ = ["PASSKEY_FILLER", "haystack", "count_tokens"]

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


class _Source:
    """A haystack text tokenized once: token char spans, cut points and sentence starts.

    A cut point is a token boundary that any usual pre-tokenizer also splits at: whitespace between
    the tokens, or a non-alphanumeric character on either side. Text cut there re-tokenizes to the
    same tokens for WordPiece (and nearly so for BPE / SentencePiece)."""

    def __init__(self, text: str, tokenizer):
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        except (NotImplementedError, TypeError, ValueError) as exc:
            raise ValueError(
                "the synthetic tasks need a fast Hugging Face tokenizer (return_offsets_mapping); "
                f"got {type(tokenizer).__name__}: {exc}"
            ) from None
        off = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
        self.text = text
        self.start, self.end = off[:, 0], off[:, 1]
        self.n = n = off.shape[0]
        first = np.array([text[a : a + 1] for a in self.start])
        last = np.array([text[z - 1 : z] if z > 0 else " " for z in np.concatenate([[0], self.end[:-1]])])
        word = np.ones(n, bool)  # token i starts a new whitespace-separated word
        word[1:] = self.start[1:] > self.end[:-1]
        word |= np.char.isspace(first)
        # cut[i]: a window may end just before token i (cut[n] = True: the end of the source)
        self.cut_ok = np.ones(n + 1, bool)
        self.cut_ok[:n] = word | ~np.char.isalnum(first) | ~np.char.isalnum(last)
        sent = word & np.isin(last, [".", "!", "?"])
        sent[0] = True
        self.sent_pos = np.flatnonzero(sent)

    def window(self, s0: int, budget: int) -> tuple[int, int]:
        """Token window [s, e) of ``budget`` tokens starting at a sentence start ``s >= s0`` chosen so
        that ``e`` is a cut point (the first of the next 64 sentence starts that allows it); failing
        that, ``s = s0`` and ``e`` the cut point nearest to ``s0 + budget``."""
        if s0 + budget > self.n:
            raise ValueError(f"haystack source too short: needs {s0 + budget} tokens, has {self.n}")
        cands = self.sent_pos[np.searchsorted(self.sent_pos, s0):][:64]
        cands = cands[cands + budget <= self.n]
        ok = cands[self.cut_ok[cands + budget]]
        if ok.size:
            return int(ok[0]), int(ok[0]) + budget
        cut = np.flatnonzero(self.cut_ok[s0 + 1 :]) + s0 + 1
        return s0, int(cut[np.argmin(np.abs(cut - (s0 + budget)))])

    def build(self, s: int, e: int, needle: str, depth: float) -> tuple[str, int]:
        """(text, at): window tokens [s, e) with ``needle`` at the sentence boundary nearest to ``depth``
        in [0, 1]; ``text[at:at + len(needle)] == needle``."""
        lo, hi = np.searchsorted(self.sent_pos, [s, e])
        cands = np.concatenate([self.sent_pos[lo:hi], [e]])
        cand = int(cands[np.argmin(np.abs(cands - (s + depth * (e - s))))])
        a, z = int(self.start[s]), int(self.end[e - 1])
        if cand == s:
            return needle + " " + self.text[a:z], 0
        if cand == e:
            return self.text[a:z] + " " + needle, z - a + 1
        c = int(self.start[cand])
        return self.text[a:c] + needle + " " + self.text[c:z], c - a


@functools.lru_cache(maxsize=4)
def _haystack_cached(kind: str, tokenizer, copies: int) -> tuple[_Source, np.ndarray]:
    if kind == "passkey":
        src = _Source(" ".join([PASSKEY_FILLER] * copies), tokenizer)
        return src, np.zeros(1, np.int64)  # LongEmbed: every passkey haystack starts at the top
    text = prose().strip()
    src = _Source("\n\n".join([text] * copies), tokenizer)
    return src, src.sent_pos[src.start[src.sent_pos] < len(text)]  # start in the first copy


def haystack(kind: str, tokenizer, longest: int) -> tuple[_Source, np.ndarray]:
    """The tokenized haystack source of ``kind`` holding windows of ``longest`` tokens, and the
    tokens a window may start at. Cached for the last few (kind, tokenizer, size)."""
    if kind == "passkey":
        unit = int(count_tokens(tokenizer, [PASSKEY_FILLER])[0])
        copies = longest // max(1, unit) + 4
    else:  # a copy of the prose is >= 30k tokens for any tokenizer of < 5.5 characters per token
        copies = 2 + longest // 30_000
    try:
        return _haystack_cached(kind, tokenizer, copies)
    except TypeError:  # an unhashable tokenizer
        return _haystack_cached.__wrapped__(kind, tokenizer, copies)


def count_tokens(tokenizer, texts: list[str]) -> np.ndarray:
    """(len(texts),) int64 tokens of each text, without special tokens."""
    if not texts:
        return np.zeros(0, np.int64)
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return np.array([len(x) for x in ids], np.int64)
