"""Text rows to token ids with a tokenizer's memory bounded whatever the row: a long row is tokenized in pieces cut
where the cut changes no id (checked), and a row with no such place (no whitespace, or a tokenizer that marks every
input's start) in pieces of at most MAX_PIECE_CHARS, cut hard. The token cache's text chunks are made of these."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterator
from itertools import chain

import numpy as np

log = logging.getLogger(__name__)

TOKENIZE_CHARS = 2**18
"""Text per tokenizer call, and the longest piece a row is tokenized in: a fast tokenizer holds about 300 bytes
per character of its input while it works (BENCHMARKS.md section 14), so a 2.6M-character row alone took 800 MB."""
MAX_PIECE_CHARS = 2**20
"""The longest piece the tokenizer is ever given (about 300 MB of its working memory): a row with no exact cut
before this is cut here anyway (_pieces)."""
CHECK_CHARS = 1024
"""Text either side of a cut in a long row that is tokenized whole and cut to check the cut changes no id."""


def tokenize_rows(batch: dict, tokenizer, eos_id: int, split_special: bool) -> dict:
    """A batch of rows -> one row: their ids, each followed by EOS, as one uint32 array. Arrow takes a numpy array
    in one copy, where a list of Python int lists is converted element by element (a quarter of the whole
    tokenize+pack time on the bench). The tokenizer sees at most about TOKENIZE_CHARS at a time (see there); the
    generator feeds np.fromiter one call's ids at a time. split_special: a special token's text in a row stays text
    (`<|end_of_text|>` typed in a document is not the end of it)."""
    pieces = [piece for text in batch["text"] for piece in _pieces(text, tokenizer, split_special)]
    ids = _piece_ids(pieces, tokenizer, eos_id, split_special)
    return {"input_ids": [np.fromiter(chain.from_iterable(ids), dtype=np.uint32)]}


def _piece_ids(pieces: list[tuple[str, bool]], tokenizer, eos_id: int, split_special: bool) -> Iterator[list[int]]:
    """Each piece's ids, EOS after a row's last piece; the freed memory is handed back after each tokenizer call."""
    for call in _calls(pieces):
        ids = _ids(tokenizer, [text for text, _ in call], split_special)
        yield from (row + [eos_id] if last else row for row, (_, last) in zip(ids, call, strict=True))
        del ids
        release_freed_memory()


def _calls(pieces: list[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    """Consecutive pieces grouped into tokenizer calls of at most TOKENIZE_CHARS characters (a longer piece alone)."""
    call: list[tuple[str, bool]] = []
    size = 0
    for piece in pieces:
        if call and size + len(piece[0]) > TOKENIZE_CHARS:
            yield call
            call, size = [], 0
        call.append(piece)
        size += len(piece[0])
    if call:
        yield call


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere). The tokenizer's
    allocations, freed after each call, otherwise stay in the process: a worker grew by about 20 MB per call and
    reached 800 MB on the bench corpus."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the C library the process already has loaded


def _ids(tokenizer, texts: list[str], split_special: bool) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False,
                     split_special_tokens=split_special)["input_ids"]


def _pieces(text: str, tokenizer, split_special: bool) -> list[tuple[str, bool]]:
    """(piece, is the row's last) for one row: the row itself, or a longer row cut into pieces of at most about
    TOKENIZE_CHARS whose ids, one after another, are the whole row's. A cut is kept only when the text around it
    tokenizes the same whole and cut (a tokenizer that prefixes every input, as Llama 2's normalizer does, fails
    that); the rest of the row is then one piece, unless it is longer than MAX_PIECE_CHARS: it is then cut there
    anyway (a hard cut, logged: the ids beside it may differ from the whole row's), so no row, however long and
    however free of whitespace, costs the tokenizer more than a piece's memory."""
    out: list[tuple[str, bool]] = []
    start = hard = 0
    while len(text) - start > TOKENIZE_CHARS:
        cut = _exact_cut(tokenizer, text, start + TOKENIZE_CHARS // 2, start + TOKENIZE_CHARS, split_special)
        if cut is None:
            if len(text) - start <= MAX_PIECE_CHARS:
                break
            cut, hard = start + MAX_PIECE_CHARS, hard + 1
        out.append((text[start:cut], False))
        start = cut
    out.append((text[start:] if start else text, True))
    if hard:
        log.warning("a row of %d characters has no place where a cut keeps its ids: tokenized in pieces of at most "
                    "%d characters, cut %d times where the ids beside a cut may differ from the whole row's",
                    len(text), MAX_PIECE_CHARS, hard)
    return out


def _exact_cut(tokenizer, text: str, lo: int, hi: int, split_special: bool) -> int | None:
    """A place in (lo, hi) where cutting keeps the ids: at whitespace (_cut_at), else, for text without any (base64,
    a minified blob), between a letter, a digit and other characters, where the usual pre-tokenizers split too;
    None when no candidate is exact."""
    at = _cut_at(text, lo, hi)
    candidates = [at] if at is not None else []
    candidates += [i for i in _class_changes(text, lo, hi) if i != at]
    return next((c for c in candidates if _cut_is_exact(tokenizer, text, c, split_special)), None)


def _char_class(ch: str) -> int:
    return 0 if ch.isalpha() else 1 if ch.isdigit() else 2 if not ch.isspace() else 3


def _class_changes(text: str, lo: int, hi: int, most: int = 8) -> Iterator[int]:
    """Up to `most` places, from hi back to lo, where the class of the character changes (letter, digit, other)."""
    found = 0
    for i in range(hi - 1, lo, -1):
        if _char_class(text[i - 1]) != _char_class(text[i]):
            yield i
            found += 1
            if found == most:
                return


def _cut_at(text: str, lo: int, hi: int) -> int | None:
    """The last place in (lo, hi) just after a newline, else just before a space, that has a non-space character
    on either side: where the usual pre-tokenizers (GPT-2's and Llama 3's patterns) end a pre-token."""
    for sep, after in (("\n", 1), (" ", 0)):
        at = text.rfind(sep, lo, hi)
        while at > lo:
            if not text[at - 1].isspace() and at + 1 < len(text) and not text[at + 1].isspace():
                return at + after
            at = text.rfind(sep, lo, at)
    return None


def _cut_is_exact(tokenizer, text: str, cut: int, split_special: bool) -> bool:
    """Whether CHECK_CHARS either side of cut tokenize to the same ids whole and as two texts."""
    left, right = text[max(0, cut - CHECK_CHARS):cut], text[cut:cut + CHECK_CHARS]
    whole, first, second = _ids(tokenizer, [left + right, left, right], split_special)
    return whole == first + second
