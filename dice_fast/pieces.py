"""Tokenization in bounded pieces (the server: no lock held for a whole huge text, refusal midway).

`tokenize_bounded` gives `dice_fast.chunking.tokenize`'s result in tokenizer calls of at most
`PIECE_CHARS` characters each, each holding the tokenizer lock alone. Where a text is cut (`pieces`):

1. **A word gap** (a space between two non-space characters, `word_gap`): the last one in the piece's
   ``size`` characters. Exact for every tokenizer where `cuts_are_exact` holds (WordPiece, byte-level
   BPE, Metaspace; checked once per tokenizer on a probe text).
2. **A forced cut** when the piece holds no word gap (gapless text such as ``a.a.a.…``, CJK, URLs,
   base64, lines without spaces): among the last `SEARCH_CHARS` characters of the piece, the positions
   where the character class changes (letter or digit / punctuation / symbol / whitespace / other, and
   between two CJK ideographs), never
   inside a grapheme (not before a combining mark, a zero-width joiner or non-joiner, a variation
   selector, an emoji skin tone or tag, nor after a joiner). Each candidate, latest first, is checked
   by tokenizing the `CHECK_CHARS` characters on each side of it both whole and cut there (one small
   call for up to `CHECK_CANDIDATES` candidates): the first whose two tokenizations agree is the cut.
   A token the cut would split, a WordPiece ``##`` continuation, a BPE or Unigram merge across the cut
   all show up as a disagreement, so such a cut is never taken.
3. **A character bound** when no candidate passes: ``size`` characters on, moved back out of a
   grapheme (at most `SEARCH_CHARS` back: a longer glued run is cut where it lies). Only here may the ids differ from the whole text's: inside a run of more than
   ``size - SEARCH_CHARS`` characters that offers no cut agreeing with the whole. Typical case: a run of
   letters, or of emoji, longer than a piece (WordPiece turns a word of more than 100 characters into
   one ``[UNK]``; cut, it gives one ``[UNK]`` per piece). `pieces` reports such cuts (``exact=False``).

Python strings hold code points, so no cut ever splits a surrogate pair; a lone surrogate is not valid
Unicode and raises `TextError` naming its text wherever it lies.
"""

from __future__ import annotations

import unicodedata

import numpy as np

from .chunking import TextError, TokenizedDocuments, raise_for_unencodable, tokenize
from .text_prefix import TextPrefix

PIECE_CHARS = 32_768  # characters per tokenizer call: ~8k English tokens, ~30-80 ms on one CPU core
SEARCH_CHARS = 256  # a forced cut is looked for among the last characters of a piece
CHECK_CHARS = 48  # characters on each side of a forced-cut candidate tokenized to check it
CHECK_CANDIDATES = 8  # candidates checked per forced cut (one call of at most 8 * 4 * 48 characters)
_PROBE = ("Hello  world, it's A test: naïve café, 3.14159 x^2 foo-bar_baz \"quoted\" (paren) 中文字符 "
          "ＦＵＬＬ　width 🙂 tab\there new\nline don't   stop.\u00a0end co-operate e.g. U.S.A. http://x.y/z?q=1")


def word_gap(text: str, j: int) -> bool:
    """Whether ``text[j]`` is a space between two characters that are not whitespace."""
    return (0 < j < len(text) - 1 and text[j] == " " and not text[j - 1].isspace()
            and not text[j + 1].isspace())


def cut_point(text: str, start: int, size: int) -> int | None:
    """End of the piece of ``text`` that begins at ``start``: the text's end if it is at most ``size``
    characters on, else just before the last `word_gap` space in the next ``size`` characters, else
    None (no word gap: the cut must be forced, see `pieces`)."""
    if len(text) - start <= size:
        return len(text)
    j = start + size + 1
    while (j := text.rfind(" ", start + 1, j)) > start:
        if word_gap(text, j):
            return j
    return None


def _glued(c: str) -> bool:
    """Whether a cut just before ``c`` would split a grapheme: a combining mark, a joiner or non-joiner,
    a variation selector, an emoji skin tone or tag character."""
    o = ord(c)
    return (o in (0x200C, 0x200D) or 0xFE00 <= o <= 0xFE0F or 0x1F3FB <= o <= 0x1F3FF or 0xE0020 <= o <= 0xE007F
            or 0xE0100 <= o <= 0xE01EF or unicodedata.category(c)[0] == "M")


def _kind(c: str) -> str:
    """Character class for forced cuts: "w" letter / digit / mark / underscore, "p" punctuation,
    "s" symbol, "z" whitespace, "i" a CJK ideograph (each one a class of its own), "o" anything else."""
    if c.isspace():
        return "z"
    if c.isalnum() or c == "_":
        return "i" if unicodedata.name(c, "").startswith("CJK") else "w"
    return {"P": "p", "S": "s", "M": "w"}.get(unicodedata.category(c)[0], "o")


def _candidates(text: str, start: int, size: int) -> list[int]:
    """Forced-cut candidates (latest first) among the last `SEARCH_CHARS` characters of the piece
    ``text[start:start + size]``: where the class changes, never inside a grapheme."""
    end = start + size
    lo = max(start + 1, end - SEARCH_CHARS)
    out = []
    for j in range(end, lo - 1, -1):
        a, b = text[j - 1], text[j]
        if _glued(b) or a == "\u200d":
            continue
        ka, kb = _kind(a), _kind(b)
        if ka != kb or ka == "i":
            out.append(j)
            if len(out) == CHECK_CANDIDATES:
                break
    return out


def _bound(text: str, start: int, size: int) -> int:
    """``start + size`` moved back out of a grapheme, at most `SEARCH_CHARS` characters (never to
    ``start``): a longer glued run (thousands of combining marks or joined emoji, no grapheme of any
    script) is cut at ``start + size`` itself, so that pieces stay ``size`` long and the cost linear
    (walking back to ``start + 1`` made 1-character pieces, each costing a ``size``-long walk)."""
    end = start + size
    for j in range(end, max(start + 1, end - SEARCH_CHARS) - 1, -1):
        if not (_glued(text[j]) or text[j - 1] == "\u200d"):
            return j
    return end


def _agreeing(tokenizer, text: str, start: int, candidates: list[int], lock) -> int | None:
    """The first candidate cut whose neighbourhood tokenizes the same whole and cut there, or None."""
    if not candidates:
        return None
    windows = []
    for j in candidates:
        lo, hi = max(start, j - CHECK_CHARS), min(len(text), j + CHECK_CHARS)
        windows += [text[lo:hi], text[lo:j], text[j:hi]]
    with lock:
        out = tokenize(tokenizer, windows, spans=False)
    ids, off = out.ids, out.offsets
    for n, j in enumerate(candidates):
        whole = ids[off[3 * n]:off[3 * n + 1]]
        if np.array_equal(whole, ids[off[3 * n + 1]:off[3 * n + 3]]):
            return j
    return None


def pieces(tokenizer, text: str, lock, size: int = PIECE_CHARS, start: int = 0):
    """Yield ``(start, end, exact)`` of the pieces of at most ``size`` characters that ``text`` is
    tokenized in, in order from ``start``: cut at word gaps, else at a checked forced cut, else at the
    character bound (``exact`` False: the ids of that piece and the next may differ from the whole
    text's there; see the module's notes). Checking a forced cut makes one small tokenizer call
    holding ``lock``."""
    while start < len(text):
        end, exact = cut_point(text, start, size), True
        if end is None:
            end = _agreeing(tokenizer, text, start, _candidates(text, start, size), lock)
            if end is None:
                end, exact = _bound(text, start, size), False
        yield start, end, exact
        start = end


def cuts_are_exact(tokenizer) -> bool:
    """Whether ``tokenizer`` gives a text's ids as the ids of its pieces cut at word gaps, back to back
    (true of WordPiece, byte-level BPE and Metaspace tokenizers; false where a normalizer prepends to
    every call, as Llama 2's does), checked on a probe text cut at every word gap."""
    cuts = [0] + [j for j in range(len(_PROBE)) if word_gap(_PROBE, j)] + [len(_PROBE)]
    parts = [_PROBE[a:b] for a, b in zip(cuts, cuts[1:])]
    whole = tokenize(tokenizer, [_PROBE], spans=False).ids
    return np.array_equal(whole, tokenize(tokenizer, parts, spans=False).ids)


def tokenize_bounded(tokenizer, texts: list[str], lock, *, piece_chars: int | None = PIECE_CHARS,
                     check=None, enough: int | None = None, what: str = "texts", base: int = 0,
                     after: TextPrefix | None = None, exact: bool = False) -> TokenizedDocuments:
    """`tokenize`'s result, computed in tokenizer calls of at most ``piece_chars`` characters (pieces
    of several short texts share a call; a forced cut's check is one call of at most
    ``CHECK_CANDIDATES * 4 * CHECK_CHARS`` = 1,536), each holding ``lock`` (a context manager) alone, so
    another thread's call waits at most one piece.

    A text longer than ``piece_chars`` is cut as `pieces` says: the same ids as the whole text where
    `cuts_are_exact(tokenizer)`, except inside a run that offers no agreeing cut (module notes); pass
    ``piece_chars=None`` for a tokenizer where cuts are not exact (whole texts, a call per ~`PIECE_CHARS`
    characters of them: a text longer than that holds the lock for its whole call). ``check(counts)``,
    if given, is called between calls with (n,) int64 tokens found so far per text (a lower bound of
    each final count; read it, do not keep it) and stops everything by raising. A text with more than
    ``enough`` tokens is not tokenized further: its ids are then a prefix (of more than ``enough``
    tokens) of its full ids. A text the tokenizer cannot take raises `TextError` naming ``what[base + i]``.
    ``after``: every text's first piece is tokenized after that prefix, as `tokenize` does. ``exact``: a
    text that offers no exact cut somewhere is tokenized whole (one call holding ``lock`` for it), so the
    ids are always the whole text's (a Metaspace tokenizer prepends "▁" to every piece of a gapless text).
    """
    counts = np.zeros(len(texts), dtype=np.int64)
    parts: list[list[tuple]] = [[] for _ in texts]  # per text: (ids, char_start, char_end) of each piece
    group: list[tuple[int, str, int]] = []  # (text index, piece, its first character) to tokenize in one call
    size = piece_chars or PIECE_CHARS
    done = [0, 0]  # calls made, characters in the group

    def flush():
        if check is not None and done[0]:
            check(counts)
        done[0] += 1
        first = group[0][0]
        try:
            with lock:
                out = tokenize(tokenizer, [piece for _, piece, _ in group], what=what, after=after,
                               follows=[not at for _, _, at in group])  # first pieces follow the prefix
        except ValueError as exc:  # name the text, not the piece
            raise_for_unencodable(texts[first : group[-1][0] + 1], base + first, what, exc)
            raise
        for (i, _, at), a, b in zip(group, out.offsets[:-1], out.offsets[1:]):  # spans: piece -> text
            parts[i].append((out.ids[a:b], out.char_start[a:b] + at, out.char_end[a:b] + at))
            counts[i] += b - a
        group.clear()
        done[1] = 0

    if piece_chars:  # not valid Unicode: named here, the first such text, not as a forced cut's window
        raise_for_unencodable(texts, base, what, None)
    for i, text in enumerate(texts):
        cuts = pieces(tokenizer, text, lock, size) if piece_chars else [(0, len(text), True)]
        if exact and piece_chars:
            cuts = []
            for cut in pieces(tokenizer, text, lock, size):
                if not cut[2]:  # no exact cut somewhere: the text goes whole (the rest is not cut)
                    cuts = [(0, len(text), True)]
                    break
                cuts.append(cut)
        for start, end, _ in cuts:
            if enough is not None and counts[i] > enough:
                break
            if group and done[1] + end - start > size:
                flush()
            group.append((i, text[start:end], start))
            done[1] += end - start
            if done[1] >= size:
                flush()
    if group:
        flush()
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if not offsets[-1]:
        empty = np.zeros(0, dtype=np.int64)
        return TokenizedDocuments(empty, offsets, empty, empty.copy())
    ids, char_start, char_end = (np.concatenate([piece[k] for p in parts for piece in p]) for k in range(3))
    return TokenizedDocuments(ids, offsets, char_start, char_end)


__all__ = ["PIECE_CHARS", "TextError", "cut_point", "cuts_are_exact", "pieces", "tokenize_bounded", "word_gap"]
