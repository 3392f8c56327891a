"""A text prefix ("passage: ", "query: ") and the ids a text has after it.

sentence-transformers' prompts tokenize prefix and text together; the engine tokenizes the prefix once
(every chunk's wrap carries its ids) and each text after it: ``prefix + text`` in one tokenizer call,
whose ids are split where the text begins (`TextPrefix.text_start`). So a document's or query's first token
is the one the joint tokenization gives ("Ġthe" after "passage: " with byte-level BPE, where "the"
alone is "the"; a SentencePiece text that starts with a space or a special token keeps its "▁"), and
token spans stay in the text. Where one token would span prefix and text (a prefix without a trailing
space that merges with the next word), that text is tokenized alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TextPrefix:
    """A text prefix ("passage: ") that texts are tokenized after, as sentence-transformers' prompts are.

    text: the prefix; ids: its ids as they stand before a text, which every chunk's wrap carries: tokenized
    alone, less the trailing tokens that are spaces alone (a prefix's trailing space is a separator that
    tokenizing prefix and text together gives the next word: "▁hello", "Ġthe"; alone, SentencePiece and
    byte-level BPE make it a token of its own that the model never sees there; a newline's token is kept).
    """

    text: str
    ids: tuple[int, ...]
    prompt_length: int = 0

    @classmethod
    def of(cls, tokenizer, text: str) -> TextPrefix | None:
        """``text``'s `TextPrefix` with ``tokenizer`` (None for "").

        ``prompt_length``: the leading tokens sentence-transformers takes for the prompt, which a Pooling
        with include_prompt false leaves out of every chunk: ``text`` tokenized alone with the special
        tokens, less a trailing special token ([CLS] and the prompt's ids; with a SentencePiece
        tokenizer that keeps a trailing "▁" alone, one more than the prefix's ids in the chunk, as
        sentence-transformers counts it)."""
        if not text:
            return None
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        whole = list(tokenizer(text)["input_ids"])
        length = len(whole) - (bool(whole) and whole[-1] in set(tokenizer.all_special_ids))
        if text.endswith(" "):
            while ids and not tokenizer.decode(ids[-1:]).strip(" "):
                ids.pop()
        return cls(text, tuple(ids), length)

    def text_start(self, ids: list[int], span_of) -> int | None:
        """Where the text's tokens begin in ``ids``, those of ``self.text + text`` tokenized together
        (``span_of(k)``: token k's (start, end) characters there); None when the ids do not begin with
        exactly ``self.ids``, ending where the text begins (a token spans prefix and text: the text is
        then tokenized alone)."""
        n, keep = len(self.ids), len(self.text.rstrip(" "))
        if tuple(ids[:n]) != self.ids or (n and span_of(n - 1)[1] > keep) or (n < len(ids) and span_of(n)[0] < keep):
            return None
        return n

    def text_spans(self, spans) -> np.ndarray:
        """(m, 2) int64 character spans in the text of tokens whose ``spans`` are in ``self.text + text``
        (a token inside the prefix's trailing spaces alone: (0, 0))."""
        return np.maximum(np.asarray(spans, np.int64).reshape(-1, 2) - len(self.text), 0)


def prompt_left_out(prompt_length: int, lengths) -> np.ndarray:
    """(n,) int64 leading tokens a Pooling that leaves the prompt out leaves out of rows of ``lengths`` (wrapped
    chunks or windows): ``prompt_length`` (`TextPrefix.prompt_length`), at most all but each row's last."""
    return np.minimum(prompt_length, np.maximum(np.asarray(lengths, np.int64) - 1, 0))


__all__ = ["TextPrefix", "prompt_left_out"]
