"""Preference pairs to token ids and packed blocks: both answers of a pair in the same block, never split.

Each answer is one sequence, the prompt followed by it: a conversational pair rendered by the chat template (the
answer's turns trained, their end-of-turn token included, pipeline/data/chat_tokens.py), a standard one concatenated
as TRL does (BOS where the tokenizer has one, the prompt, the answer and EOS, the answer and EOS trained). A pair
longer than a block has its prompt cut from the left, as TRL's keep_end truncation does, in both answers alike; one
whose answers alone do not fit is dropped. Pairs are packed best-fit decreasing by their two lengths together; in
a block the chosen answer comes right before its rejected one, each starting a sequence (positions restart, so no
sequence attends to another), and the flags say which is which.

A KTO example is packed as a pair is: its completion in the chosen place (flagged UNDESIRABLE too when labelled
so) and, in the rejected place, its KL sequence, the prompt followed by another record's completion (the record
before it in the dataset, the first taking the last's: TRL's mismatched pairs, whose log-probability ratio estimates
the KL term; cut from its end where the example would not fit a block, so a long neighbour drops no example). A pair
under KTO is two examples, its chosen answer desirable and its rejected one not, as TRL unpairs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jinja2.exceptions import TemplateError

from pipeline.data import chat_tokens, packing
from pipeline.data.chat_render import NotRendered
from pipeline.prep.conversations import BadConversation

CHOSEN = 4
"""Flag bit of every token of a chosen answer's sequence (packing's TRAIN is 1, START 2)."""
REJECTED = 8
"""Flag bit of every token of a rejected answer's sequence."""
UNDESIRABLE = 16
"""Flag bit of every token of a KTO example's completion labelled undesirable (its chosen place)."""
STATUS = ("kept", "truncated", "dropped_too_long", "malformed", "template_mismatch", "template_error",
          "tools_not_rendered", "reasoning_not_rendered", "prompt_cut_too_far")
MIN_PROMPT = 16
"""The fewest prompt tokens a truncated pair keeps (all of a shorter prompt: it is not cut at all): below it the
answers would be trained without their question, so the pair is dropped as prompt_cut_too_far."""


@dataclass
class TokenPair:
    chosen: np.ndarray
    chosen_trained: np.ndarray
    rejected: np.ndarray
    rejected_trained: np.ndarray
    prompt: int
    """Tokens of the prompt at the start of both (the part truncation may cut)."""

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


def tokenize_pair(tokenizer, prompt_text: str, prompt: list[dict], chosen: list[dict], rejected: list[dict],
                  date: str, keep_as_text) -> TokenPair:
    """One pair's two sequences and their trained masks; BadConversation or TemplateMismatch when it cannot be."""
    if prompt:
        c = chat_tokens.tokenize_conversation(tokenizer, [*prompt, *chosen], date, "assistant", keep_as_text,
                                              first_trained=len(prompt))
        r = chat_tokens.tokenize_conversation(tokenizer, [*prompt, *rejected], date, "assistant", keep_as_text,
                                              first_trained=len(prompt))
        shared = int(np.argmax(c.trained)) if c.trained.any() else 0
        if not np.array_equal(c.ids[:shared], r.ids[:shared]):
            raise chat_tokens.TemplateMismatch
        return TokenPair(c.ids, c.trained, r.ids, r.trained, shared)
    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids = [*head, *_encode(tokenizer, prompt_text)]
    pair = []
    for answer in (chosen, rejected):
        tail = [*_encode(tokenizer, answer[0]["content"]), tokenizer.eos_token_id]
        pair += [np.asarray(ids + tail, dtype=np.uint32), np.r_[np.zeros(len(ids), bool), np.ones(len(tail), bool)]]
    return TokenPair(*pair, len(ids))


def _encode(tokenizer, text: str) -> list[int]:
    """A text part as data: a special token's text inside it stays text."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]


def fit_pair(pair: TokenPair, capacity: int) -> tuple[TokenPair | None, str]:
    """The pair within capacity tokens, its prompt cut from the left in both answers if need be (keeping one prompt
    token: nothing predicts a sequence's first); (None, "dropped_too_long") when the answers alone are too long,
    (None, "prompt_cut_too_far") when the prompt would keep fewer than MIN_PROMPT tokens (or any cut of a prompt
    shorter than that)."""
    over = len(pair) - capacity
    if over <= 0:
        return pair, "kept"
    cut = -(-over // 2)
    if cut > pair.prompt - 1:
        return None, "dropped_too_long"
    if pair.prompt - cut < MIN_PROMPT:  # a prompt shorter than MIN_PROMPT is never cut
        return None, "prompt_cut_too_far"
    return TokenPair(pair.chosen[cut:], pair.chosen_trained[cut:], pair.rejected[cut:], pair.rejected_trained[cut:],
                     pair.prompt - cut), "truncated"


def pack_pairs(pairs: list[TokenPair], capacity: int, pad_id: int, undesirable: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(blocks [n, capacity] uint32, flags uint8) of the pairs packed best-fit decreasing by their two lengths, the
    chosen answer before its rejected one; the room left in a block is padding, one more untrained sequence.
    undesirable: per pair, KTO's label (the chosen place's sequence flagged UNDESIRABLE where true)."""
    bins = packing.best_fit_decreasing(np.array([len(p) for p in pairs], dtype=np.int64), capacity)
    blocks = np.full((len(bins), capacity), pad_id, dtype=np.uint32)
    flags = np.zeros((len(bins), capacity), dtype=np.uint8)
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            for ids, trained, role in ((pairs[i].chosen, pairs[i].chosen_trained, CHOSEN),
                                       (pairs[i].rejected, pairs[i].rejected_trained, REJECTED)):
                blocks[b, at:at + len(ids)] = ids
                if undesirable is not None and undesirable[i] and role == CHOSEN:
                    role = CHOSEN | UNDESIRABLE
                flags[b, at:at + len(ids)] = np.where(trained, packing.TRAIN, 0) | role
                flags[b, at] |= packing.START
                at += len(ids)
        if at < capacity:
            flags[b, at] = packing.START
    return blocks, flags


def pair_starts(flags):
    """Where each pair starts: the first token of its chosen answer, True there ([rows, seq], numpy or torch alike)."""
    return ((flags & packing.START) > 0) & ((flags & CHOSEN) > 0)


def count_pairs(flags: np.ndarray, valid_rows: int | None = None) -> int:
    """Pairs in these blocks' flags, of the first valid_rows rows."""
    return int(pair_starts(flags if valid_rows is None else flags[:valid_rows]).sum())


def tokenize_pairs_batch(batch: dict, tokenizer, date: str, capacity: int, keep_as_text) -> dict:
    """datasets.map over preference rows: each pair fitted into a block, as (chosen ids, chosen mask, rejected ids,
    rejected mask, status, prompt tokens cut)."""
    out: dict[str, list] = {"chosen": [], "chosen_trained": [], "rejected": [], "rejected_trained": [], "status": [],
                            "cut": []}
    for text, prompt, chosen, rejected in zip(batch["text"], batch["messages"], batch["chosen"], batch["rejected"],
                                              strict=True):
        _add_fitted(out, tokenizer, (text, prompt, chosen, rejected), date, capacity, keep_as_text)
    return out


def fit_kto(example: TokenPair, capacity: int) -> tuple[TokenPair | None, str]:
    """A KTO example within capacity: its KL sequence's completion cut from its end first, down to one token (that
    sequence only feeds the KL estimate, as TRL's collator truncates it: a long neighbour must not drop the example),
    then its prompt as a pair's is (fit_pair)."""
    over = len(example) - capacity
    if over > 0:
        keep = max(example.prompt + 1, len(example.rejected) - over)
        example = TokenPair(example.chosen, example.chosen_trained, example.rejected[:keep],
                            example.rejected_trained[:keep], example.prompt)
    return fit_pair(example, capacity)


def _add_fitted(out: dict, tokenizer, parts: tuple, date: str, capacity: int, keep_as_text, fit=fit_pair) -> None:
    """One pair (prompt text, prompt messages, the two answers) tokenized and fitted (fit: fit_pair, or fit_kto for a
    KTO example), appended to out's columns."""
    whole = None
    try:
        whole = tokenize_pair(tokenizer, *parts, date, keep_as_text)
        fitted, status = fit(whole, capacity)
    except BadConversation:
        fitted, status = None, "malformed"
    except chat_tokens.TemplateMismatch:
        fitted, status = None, "template_mismatch"
    except TemplateError:  # the template's own raise_exception
        fitted, status = None, "template_error"
    except NotRendered as exc:  # a hub dataset's answer with a trace or calls its template leaves out
        fitted, status = None, str(exc)
    empty_ids, empty_mask = np.zeros(0, np.uint32), np.zeros(0, np.uint8)
    out["chosen"].append(fitted.chosen if fitted else empty_ids)
    out["chosen_trained"].append(fitted.chosen_trained.astype(np.uint8) if fitted else empty_mask)
    out["rejected"].append(fitted.rejected if fitted else empty_ids)
    out["rejected_trained"].append(fitted.rejected_trained.astype(np.uint8) if fitted else empty_mask)
    out["status"].append(STATUS.index(status))
    out["cut"].append(whole.prompt - fitted.prompt if fitted else 0)


def kl_answer(row: dict, desirable: bool) -> list[dict]:
    """The completion of the record before that a KTO example's KL sequence takes: a pair's answer of the same label
    (its chosen one for a desirable example), an unpaired record's one."""
    chosen, rejected = row["chosen"] or [], row["rejected"] or []
    return chosen if (desirable and chosen) or not rejected else rejected


def tokenize_kto_batch(batch: dict, indices: list[int], answers, tokenizer, date: str, capacity: int,
                       keep_as_text) -> dict:
    """datasets.map (with_indices) over preference rows as KTO examples: an unpaired row one, a pair two (chosen
    desirable, rejected not); each example's completion and KL sequence fitted into a block as a pair's two answers,
    with its label (desirable). answers: the dataset's chosen and rejected columns, where the KL completion of a
    batch's first row is read (row i takes row i - 1's, row 0 the last row's)."""
    out: dict[str, list] = {"chosen": [], "chosen_trained": [], "rejected": [], "rejected_trained": [], "status": [],
                            "cut": [], "desirable": []}
    rows = [dict(zip(("chosen", "rejected"), r, strict=True)) for r in zip(batch["chosen"], batch["rejected"],
                                                                              strict=True)]
    for k, (i, text, prompt, row) in enumerate(zip(indices, batch["text"], batch["messages"], rows, strict=True)):
        before = rows[k - 1] if k else answers[(i - 1) % len(answers)]
        for desirable, answer in ((True, row["chosen"]), (False, row["rejected"])):
            if answer:
                _add_fitted(out, tokenizer, (text, prompt, answer, kl_answer(before, desirable)), date, capacity,
                            keep_as_text, fit_kto)
                out["desirable"].append(int(desirable))
    return out
