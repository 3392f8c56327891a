"""Tokenization and the chunk plan: which token span of which document each chunk covers.

Everything is flat integer arrays (no per-token Python loops):

* `TokenizedDocuments`: ``ids`` (total_tokens,) int64 of all documents back to back, and
  ``offsets`` (n_docs + 1,) int64 so document ``d`` is ``ids[offsets[d]:offsets[d+1]]``; with
  ``char_start`` / ``char_end`` (total_tokens,) int64, the character span of every token in its own
  document's text (the fast tokenizer's offsets, got in the same call as the ids).
* `ChunkPlan`: per chunk ``document``, ``start``, ``length`` (content tokens, in the document's
  token coordinates) and per document ``cu_doc_chunks`` (n_docs + 1,); chunks are ordered by
  document then position, so a document's chunks are contiguous.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from .errors import ArgumentTypeError, OptionError, TextError
from .text_prefix import TextPrefix, prompt_left_out


@dataclass(frozen=True)
class TokenizedDocuments:
    """ids: (total_tokens,) int64; offsets: (n_docs + 1,) int64 with offsets[0] == 0; char_start /
    char_end: (total_tokens,) int64 token ``t`` is ``text[char_start[t]:char_end[t]]`` of its document
    (None when the ids did not come from a tokenizer, e.g. hand-made plans in tests, or were
    tokenized without spans: `tokenize(..., spans=False)`)."""

    ids: np.ndarray
    offsets: np.ndarray
    char_start: np.ndarray | None = None
    char_end: np.ndarray | None = None

    @property
    def lengths(self) -> np.ndarray:
        """(n_docs,) int64 token count of every document."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1


def check_texts(texts, what: str = "documents") -> list[str]:
    """Return ``texts`` as a list of str; TypeError naming the first non-string element's index."""
    if isinstance(texts, (str, bytes)):
        raise ArgumentTypeError(f"{what} must be a sequence of strings, not a single {type(texts).__name__}")
    try:
        items = list(texts)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be a sequence of strings, got {type(texts).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, str):
            raise ArgumentTypeError(f"{what}[{i}] is {type(t).__name__}, expected str")
    return items


def tokenize(tokenizer, texts: list[str], batch_size: int = 1024, what: str = "texts", base: int = 0,
             spans: bool = True, after: TextPrefix | None = None, follows=None) -> TokenizedDocuments:
    """Batched fast tokenization without special tokens, flattened, with every token's character
    span (one tokenizer call gives both; ``spans=False``: ids only, ``char_start`` / ``char_end`` None,
    for callers that return no chunk spans). texts: n_docs strings. ``after``: every non-empty text
    (where ``follows``, n_docs bools, is true; None: all) has the ids it has tokenized after that
    prefix (`TextPrefix.text_start`; alone where a token would span both), its spans still in the text.

    A text the tokenizer cannot take raises ValueError naming ``what[base + index]``.
    """
    ids, pairs, alone = [], [], []
    for i in range(0, len(texts), batch_size):
        batch = texts[i : i + batch_size]
        joint = [after is not None and bool(t) and (follows is None or bool(follows[i + j])) for j, t in enumerate(batch)]
        enc = _call(tokenizer, [after.text + t if k else t for t, k in zip(batch, joint)] if any(joint) else batch,
                    batch, base + i, what, spans)
        for j, seq in enumerate(enc["input_ids"]):
            start = 0
            if joint[j]:  # without spans asked for, only the boundary's two tokens are looked up
                start = after.text_start(seq, enc["offset_mapping"][j].__getitem__ if spans else
                                         (lambda k, j=j: enc.token_to_chars(j, k)))
                if start is None:  # a token spans prefix and text: the text is tokenized alone below
                    alone.append(i + j)
                    start = 0
            ids.append(np.asarray(seq[start:], dtype=np.int64))
            if spans:
                pair = enc["offset_mapping"][j][start:]
                pairs.append(after.text_spans(pair) if joint[j] else np.asarray(pair, dtype=np.int64).reshape(-1, 2))
    if alone:  # texts whose first token would span the prefix and the text
        enc = _call(tokenizer, [texts[k] for k in alone], [texts[k] for k in alone], base, what, spans)
        for j, k in enumerate(alone):
            ids[k] = np.asarray(enc["input_ids"][j], dtype=np.int64)
            if spans:
                pairs[k] = np.asarray(enc["offset_mapping"][j], dtype=np.int64).reshape(-1, 2)
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in ids], out=offsets[1:])
    if not ids:
        empty = np.zeros(0, dtype=np.int64)
        return TokenizedDocuments(empty, offsets, *((empty, empty.copy()) if spans else ()))
    if not spans:
        return TokenizedDocuments(np.concatenate(ids), offsets)
    span = np.concatenate(pairs)
    return TokenizedDocuments(np.concatenate(ids), offsets, span[:, 0].copy(), span[:, 1].copy())


def _call(tokenizer, batch: list[str], texts: list[str], base: int, what: str, spans: bool):
    """The tokenizer on ``batch`` (``texts`` as called: prefixed or not); ValueError naming the first of
    ``texts`` it cannot take as ``what[base + index]``."""
    try:
        return tokenizer(batch, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False,
                         return_offsets_mapping=spans, verbose=False)
    except (TypeError, ValueError) as exc:
        raise_for_unencodable(texts, base, what, exc)
        raise


def check_vocabulary(tokens: TokenizedDocuments, vocab_size: int, what: str, base: int = 0) -> None:
    """`TextError` naming the first text (``what[base + i]``) holding a token id the model has no
    embedding for (a tokenizer given tokens after its model was saved, without a resize); a
    ``vocab_size`` of 0 means unknown: nothing is checked."""
    bad = np.flatnonzero(tokens.ids >= vocab_size) if vocab_size else ()
    if len(bad):
        i = int(np.searchsorted(tokens.offsets, bad[0], side="right")) - 1
        raise TextError(f"{what}[{base + i}] holds token id {int(tokens.ids[bad[0]])}, beyond the model's "
                        f"{vocab_size} embeddings: the tokenizer has tokens the model was not resized for "
                        "(model.resize_token_embeddings(len(tokenizer)))", base + i)


def raise_for_unencodable(batch: list[str], base: int, what: str, exc: Exception | None) -> None:
    """Name the first text the tokenizer cannot take (e.g. a lone surrogate, which is not UTF-8)."""
    for j, text in enumerate(batch):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as bad:
            raise TextError(
                f"{what}[{base + j}] is not valid Unicode: {bad.reason} at character {bad.start}", base + j
            ) from exc


@dataclass(frozen=True)
class ChunkPlan:
    """Chunks of a set of documents, as flat arrays.

    document: (n_chunks,) int64 document index; start: (n_chunks,) int64 first content token in the
    document; length: (n_chunks,) int64 content tokens; cu_doc_chunks: (n_docs + 1,) int64.
    """

    document: np.ndarray
    start: np.ndarray
    length: np.ndarray
    cu_doc_chunks: np.ndarray

    @property
    def n_chunks(self) -> int:
        return len(self.document)

    @property
    def n_docs(self) -> int:
        return len(self.cu_doc_chunks) - 1


def plan_chunks(doc_lengths: np.ndarray, chunk_size: int, overlap: int = 0, max_chunks: int | None = None) -> ChunkPlan:
    """Split documents of ``doc_lengths`` (n_docs,) tokens into chunks of ``chunk_size`` tokens.

    Consecutive chunks share ``overlap`` tokens (stride ``chunk_size - overlap``); the last chunk is
    the shorter remainder and no chunk lies wholly inside its predecessor; a document of at most
    ``chunk_size`` tokens (including an empty one) is one chunk. ``max_chunks`` keeps only each
    document's first chunks.
    """
    if not 0 <= overlap < chunk_size:
        raise OptionError(f"overlap ({overlap}) must satisfy 0 <= overlap < chunk_size ({chunk_size})")
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    stride = chunk_size - overlap
    extra = np.maximum(lengths - chunk_size, 0)
    counts = 1 + (extra + stride - 1) // stride
    if max_chunks is not None:
        counts = np.minimum(counts, max_chunks)
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    document = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    index_in_doc = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], counts)
    start = index_in_doc * stride
    length = np.minimum(chunk_size, lengths[document] - start)
    return ChunkPlan(document, start, length, cu)


def chunk_char_spans(tokens: TokenizedDocuments, chunks: ChunkPlan) -> tuple[np.ndarray, np.ndarray]:
    """Character span of every chunk: (start, end), two (n_chunks,) int64 arrays.

    A chunk's span runs from the start of its first token to the end of its last (the smallest start
    at or after its first token and the largest end up to its last, so a tokenizer whose offsets are
    not monotone still gets a span covering all its tokens). Without overlap the spans of a document
    tile it: in order, each starting where its predecessor ended or after characters no token covers
    (whitespace a word-level or WordPiece tokenizer drops), overlapping by at most one character where
    byte-level BPE cuts a multi-byte character between two tokens of different chunks. Byte-level BPE
    and Metaspace (Unigram) tokens carry their leading space, so their spans may begin with one. An
    empty document's single chunk is (0, 0).
    """
    n = chunks.n_chunks
    if tokens.char_start is None or n == 0 or len(tokens.char_start) == 0:
        return np.zeros(n, np.int64), np.zeros(n, np.int64)
    # per-document running max of ends / reverse running min of starts, shifted apart per document
    # (the shift exceeds any offset, so one document never leaks into the next)
    doc_of_token = np.repeat(np.arange(len(tokens), dtype=np.int64), tokens.lengths)
    shift = doc_of_token * (int(max(tokens.char_end.max(initial=0), tokens.char_start.max(initial=0))) + 1)
    ends = np.maximum.accumulate(tokens.char_end + shift) - shift
    starts = np.minimum.accumulate((tokens.char_start + shift)[::-1])[::-1] - shift
    first = tokens.offsets[chunks.document] + chunks.start
    has = chunks.length > 0
    start = np.where(has, starts[np.minimum(first, max(len(starts) - 1, 0))], 0)
    end = np.where(has, ends[np.maximum(first + chunks.length - 1, 0)], 0)
    return start.astype(np.int64), np.maximum(end, start).astype(np.int64)


@dataclass(frozen=True)
class Windows:
    """Late chunking's windows over a `ChunkPlan`: per window ``document``, ``start`` (first content
    token in the document) and ``length`` (content tokens), (n_windows,) int64 each, ordered by document
    then position; ``chunk_window`` (n_chunks,) int64: the one window each chunk is pooled in."""

    document: np.ndarray
    start: np.ndarray
    length: np.ndarray
    chunk_window: np.ndarray

    def as_chunks(self) -> ChunkPlan:
        """The windows as a `ChunkPlan` (one "chunk" per window), which is how they are packed."""
        return ChunkPlan(self.document, self.start, self.length, np.zeros(1, np.int64))


def plan_windows(chunks: ChunkPlan, doc_lengths: np.ndarray, capacity: int, overlap: int) -> Windows:
    """Windows of at most ``capacity`` content tokens over chunks that tile their documents (``overlap``
    0 between chunks), built from whole chunks: every chunk is pooled in exactly one window, with at
    least ``ceil(overlap / 2)`` tokens of context before it and ``overlap // 2`` after it wherever the
    document has them, so consecutive windows of a document share ``overlap`` tokens and a boundary
    between the chunks of two windows lies in the middle of what they share.

    A document whose kept chunks (plus their right context) fit one window is one window from its first
    token; longer ones are cut greedily (the most chunks per window). Needs ``chunk_size + overlap <=
    capacity`` (`Settings.late_windows` checks it), so a window always holds its first chunk.
    """
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    left, right = overlap - overlap // 2, overlap // 2
    cu = chunks.cu_doc_chunks
    counts = np.diff(cu)
    last = np.maximum(cu[1:] - 1, 0)
    ends = chunks.start + chunks.length
    span = np.minimum(lengths, np.where(counts > 0, ends[last] if chunks.n_chunks else 0, 0) + right)
    long_docs = np.flatnonzero(span > capacity).tolist()
    cuts = {}  # long document -> (window starts, window ends, window of each of its chunks)
    for d in long_docs:  # Python only for documents longer than a window
        lo, hi = int(cu[d]), int(cu[d + 1])
        reach = np.minimum(lengths[d], ends[lo:hi] + right)  # where a window pooling up to chunk c ends
        a_list, b_list, own = [], [], np.empty(hi - lo, np.int64)
        c0 = 0
        while c0 < hi - lo:
            a = max(0, int(chunks.start[lo + c0]) - left)
            c1 = max(c0, int(np.searchsorted(reach, a + capacity, side="right")) - 1)
            own[c0:c1 + 1] = len(a_list)
            a_list.append(a), b_list.append(int(reach[c1]))
            c0 = c1 + 1
        cuts[d] = (a_list, b_list, own)
    n_win = np.ones(len(lengths), dtype=np.int64)
    for d, (a_list, _, _) in cuts.items():
        n_win[d] = len(a_list)
    cu_w = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(n_win, out=cu_w[1:])
    document = np.repeat(np.arange(len(lengths), dtype=np.int64), n_win)
    start = np.zeros(int(cu_w[-1]), dtype=np.int64)
    length = span[document].copy()  # single-window documents: [0, span)
    chunk_window = np.repeat(cu_w[:-1], counts)
    for d, (a_list, b_list, own) in cuts.items():
        w0 = int(cu_w[d])
        start[w0:w0 + len(a_list)] = a_list
        length[w0:w0 + len(a_list)] = np.asarray(b_list) - np.asarray(a_list)
        chunk_window[int(cu[d]):int(cu[d + 1])] = w0 + own
    return Windows(document, start, length, chunk_window)


@dataclass(frozen=True)
class EncodingPlan:
    """Everything computed about a set of texts before the model runs: one definition, used by the
    engine, the baselines, the benchmark and the evaluation.

    tokens: the texts' token ids (no special tokens); chunks: the chunk plan over them;
    prefix / suffix: (n_prefix,) / (n_suffix,) int64 ids put around every chunk (special tokens and
    the tokenized document or query prefix); global_positions: positions continue from the chunk's
    offset in its document (the paper's ablation) instead of restarting; windows: late chunking's
    `Windows` (None: every chunk runs alone, DICE). Under late chunking the prefix and suffix wrap
    every window, and a chunk is pooled over its own text tokens inside its window (a chunk without
    any, the one chunk of an empty document, over its whole window). unpooled: leading tokens of every
    wrapped chunk (or window, for a chunk without text) its pooling leaves out, at most all but its last
    (a Pooling with include_prompt false: the prompt, `TextPrefix.prompt_length`).
    """

    tokens: TokenizedDocuments
    chunks: ChunkPlan
    prefix: np.ndarray
    suffix: np.ndarray
    global_positions: bool = False
    windows: Windows | None = None
    unpooled: int = 0

    @property
    def n_docs(self) -> int:
        return self.chunks.n_docs

    @property
    def n_chunks(self) -> int:
        return self.chunks.n_chunks

    @property
    def chunk_lengths(self) -> np.ndarray:
        """(n_chunks,) int64 tokens every chunk's vector is pooled over: the chunk once wrapped (late
        chunking: its text tokens, or its whole window for a chunk without text)."""
        if self.windows is None:
            return self.chunks.length + (len(self.prefix) + len(self.suffix))
        return np.where(self.chunks.length > 0, self.chunks.length, self.run_lengths)

    @property
    def run_lengths(self) -> np.ndarray:
        """(n_chunks,) int64 tokens the model runs to pool chunk ``c``: the wrapped chunk, or under late
        chunking its wrapped window."""
        if self.windows is None:
            return self.chunk_lengths
        return self.window_lengths[self.windows.chunk_window]

    @property
    def window_lengths(self) -> np.ndarray:
        """(n_windows,) int64 wrapped tokens of every late-chunking window."""
        return self.windows.length + (len(self.prefix) + len(self.suffix))

    def batch_costs(self, runs: np.ndarray) -> np.ndarray:
        """(n_chunks,) int64 tokens each chunk adds to a batch when the chunks where ``runs`` (bool) is
        true run: its wrapped length; under late chunking its window's, counted on the window's first
        running chunk (the others cost nothing: they are pooled from the same forward)."""
        if self.windows is None:
            return self.chunk_lengths * runs
        cost = np.zeros(self.n_chunks, dtype=np.int64)
        idx = np.flatnonzero(runs)
        if len(idx):
            w = self.windows.chunk_window[idx]
            first = idx[np.concatenate([[True], w[1:] != w[:-1]])]
            cost[first] = self.window_lengths[self.windows.chunk_window[first]]
        return cost

    @property
    def chunk_weights(self) -> np.ndarray:
        """(n_chunks,) float32 weight of every chunk for ``weighted_mean``: the tokens it is pooled over."""
        lengths, late_text = self.chunk_lengths, self.windows is not None and self.chunks.length > 0
        return (lengths - np.where(late_text, 0, prompt_left_out(self.unpooled, lengths))).astype(np.float32)

    @property
    def document_tokens(self) -> np.ndarray:
        """(n_docs,) int64 wrapped tokens the model runs per document (0 for a document with none)."""
        out = np.zeros(self.n_docs, dtype=np.int64)
        if self.windows is not None:
            np.add.at(out, self.windows.document, self.window_lengths)
        elif self.n_chunks:
            np.add.at(out, self.chunks.document, self.chunk_lengths)
        return out

    @property
    def chunk_char_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, end): two (n_chunks,) int64 arrays, chunk ``c`` is ``text[start[c]:end[c]]`` of its
        own document; prefixes and special tokens are not part of it, so consecutive chunks tile the
        document (see `chunk_char_spans`). Zeros when the tokens carry no character offsets."""
        return chunk_char_spans(self.tokens, self.chunks)

    def chunk_ids(self, c: int) -> np.ndarray:
        """(wrapped length,) int64 token ids of chunk ``c`` exactly as the model sees it."""
        d, s, n = int(self.chunks.document[c]), int(self.chunks.start[c]), int(self.chunks.length[c])
        o = int(self.tokens.offsets[d])
        return np.concatenate([self.prefix, self.tokens.ids[o + s : o + s + n], self.suffix])


class TruncatedWarning(UserWarning):
    """Texts longer than the model window were cut to it; ``positions`` (their indices in the call), their
    ``lengths`` in tokens, the ``capacity`` kept and the ``window`` (for a caller that reports them its way)."""

    def __init__(self, message: str, positions=(), lengths=(), capacity: int = 0, window: int = 0):
        super().__init__(message)
        self.positions, self.lengths, self.capacity, self.window = positions, lengths, capacity, window


def truncated_message(names: list[str], count: int, capacity: int, window: int, what: str) -> str:
    """"N <what> longer than the model window ... were cut ...: " and the first three of ``names``."""
    return (f"{count} {what} longer than the model window ({window} tokens with special tokens) were cut to their "
            f"first {capacity} tokens: {', '.join(names[:3])}{' ...' if count > 3 else ''}")


def warn_truncated(doc_lengths: np.ndarray, capacity: int, window: int, what: str) -> None:
    """Warn (`TruncatedWarning`) that the texts of ``doc_lengths`` over ``capacity`` tokens were cut to it,
    naming the first three."""
    over = np.flatnonzero(doc_lengths > capacity)
    if len(over):
        names = [f"{what}[{i}] ({int(doc_lengths[i])} tokens)" for i in over[:3]]
        warnings.warn(TruncatedWarning(truncated_message(names, len(over), capacity, window, what), over,
                                       doc_lengths[over], capacity, window), stacklevel=4)
