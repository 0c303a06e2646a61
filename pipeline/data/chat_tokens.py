"""Conversations to token ids and a per-token loss mask, through the model's own chat template.

Most templates (Llama 3.x, ChatML and others) have no `{% generation %}` markers, so the assistant turns are found by
rendering prefixes: the conversation up to a user turn with the generation prompt ends where the assistant's answer
starts, and the conversation up to that answer ends where it ends (its end-of-turn token included, trailing
whitespace not). The full rendering is tokenized once with character offsets, and a token is trained when it starts
inside a trained span. This holds only when every prefix renders as a prefix of the whole; a template that rewrites
earlier turns (some strip reasoning from all but the last answer) gives `template_mismatch` for that conversation.
Rendering a prefix costs its length, so only the turns that start within the block the conversation is cut to are
rendered: a conversation of thousands of turns costs what its first block does, not the square of its length.

Text is text: a special token's text inside a message (`<|eot_id|><|start_header_id|>assistant` typed by a user) stays
text, so data cannot forge a turn; only the template's own markers are special tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from pipeline.prep.conversations import ROLES, BadConversation, check

STATUS = ("kept", "truncated", "dropped_too_long", "malformed", "template_mismatch")
"""What happened to each conversation, counted in the token cache's meta.json and the log."""


@dataclass
class Rendered:
    ids: np.ndarray
    """Token ids of the whole rendered conversation (uint32)."""
    trained: np.ndarray
    """Whether each token is a target of the loss (bool)."""
    cuts: list[int]
    """Token counts at which the conversation may be cut: the end of each trained span, ascending."""


class TemplateMismatch(Exception):
    """A prefix of the conversation does not render as a prefix of the whole."""


BLANK = "\ue000"
"""A private-use character: what special-token texts in contents are replaced by to find the template's own."""


def special_texts(tokenizer) -> re.Pattern | None:
    """The texts of the tokenizer's special tokens as one pattern (longest first), None when it has none."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None


def render(tokenizer, messages: list[dict], date: str, **kwargs) -> str:
    """The chat template applied to messages, with today's date pinned (Llama 3.1/3.2 templates print it)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, date_string=date, **kwargs)


def _assistant_spans(tokenizer, messages: list[dict], turns: list[int], date: str, full: str,
                     reach: int | None) -> list[tuple[int, int]]:
    """Character spans of full holding the assistant turns (indices into messages, ascending) that start at or
    before the character reach, or all of them when reach is None. Turns start in order, so the first one past
    reach ends the search: every turn rendered would make a long conversation quadratic in its length."""
    spans = []
    for i in turns:
        start = len(render(tokenizer, messages[:i], date, add_generation_prompt=True))
        if reach is not None and start > reach:
            break
        upto = render(tokenizer, messages[: i + 1], date)
        if not full.startswith(upto) or not upto.startswith(full[:start]):
            raise TemplateMismatch
        end = len(upto.rstrip())
        spans.append((start, max(start, end)))
    return spans


def _reach(starts: np.ndarray, capacity: int | None) -> int | None:
    """The character offset of the last-starting token among the first capacity (those a block of capacity holds);
    None when the conversation has no more tokens than that."""
    if capacity is None or len(starts) <= capacity:
        return None
    return int(starts[:capacity].max(initial=-1))


def tokenize_conversation(tokenizer, messages: list[dict], date: str, train_on: str,
                          keep_as_text: re.Pattern | None = None, capacity: int | None = None,
                          first_trained: int = 0) -> Rendered:
    """Render, tokenize and mask one conversation; BadConversation or TemplateMismatch when it cannot be.
    keep_as_text: the special-token texts (special_texts) that stay text inside message contents; None lets them
    become special tokens, as the tokenizer does by default.
    capacity: the tokens fit will cut the conversation to. When there are more, only the assistant turns that start
    among the first capacity tokens are found (and checked against the template): the mask and cuts past those
    tokens are incomplete, and fit(rendered, capacity) reads none of them. None finds every turn.
    first_trained: the assistant turns before this message are context, not targets (a preference pair's prompt)."""
    if any(m.get("role") not in ROLES or not isinstance(m.get("content"), str) for m in messages):
        raise BadConversation("malformed_message")
    check(messages)
    full = render(tokenizer, messages, date)
    if keep_as_text is not None and any(keep_as_text.search(m["content"]) for m in messages):
        ids, offsets = _contents_as_text(tokenizer, messages, date, full, keep_as_text)
    else:
        ids, offsets = _encode(tokenizer, full, split_special=False, at=0)
    starts = np.asarray(offsets, dtype=np.int64)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
    spans = _assistant_spans(tokenizer, messages, turns, date, full, _reach(starts, capacity))
    if train_on == "last":
        # a last turn not found starts past the first capacity tokens: fit drops the conversation either way
        spans = spans[-1:] if len(spans) == len(turns) else []
    trained = np.full(len(starts), train_on == "all")
    cuts = []
    for a, b in spans:
        inside = (starts >= a) & (starts < b)
        trained |= inside
        if inside.any():
            cuts.append(int(np.flatnonzero(inside)[-1]) + 1)
    return Rendered(np.asarray(ids, dtype=np.uint32), trained, sorted(set(cuts)))


def _encode(tokenizer, text: str, split_special: bool, at: int) -> tuple[list[int], list[int]]:
    """Token ids of text and where each starts, counted from `at`."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False,
                    split_special_tokens=split_special, verbose=False)
    return enc["input_ids"], [at + a for a, _ in enc["offset_mapping"]]


def _contents_as_text(tokenizer, messages: list[dict], date: str, full: str,
                      keep_as_text: re.Pattern) -> tuple[list[int], list[int]]:
    """Token ids and starts of full in which only the template's own special tokens are special. They are found by
    rendering the conversation again with every special-token text in the contents blanked to as many BLANKs; the
    text between them is tokenized with special tokens split. The tokenizer itself tokenizes the text between two
    special tokens apart from the rest, so a conversation whose contents hold none gets the ids it always had."""
    blanked = render(tokenizer, [{**m, "content": keep_as_text.sub(lambda s: BLANK * len(s.group()), m["content"])}
                                 for m in messages], date)
    if len(blanked) != len(full):
        raise TemplateMismatch
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids: list[int] = []
    starts: list[int] = []
    done = 0
    enc = tokenizer(blanked, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False,
                    verbose=False)
    for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        if token in special:
            text_ids, text_starts = _encode(tokenizer, full[done:a], split_special=True, at=done)
            ids += [*text_ids, token]
            starts += [*text_starts, a]
            done = b
    text_ids, text_starts = _encode(tokenizer, full[done:], split_special=True, at=done)
    return ids + text_ids, starts + text_starts


def fit(rendered: Rendered, capacity: int) -> tuple[Rendered | None, str]:
    """The conversation cut to at most capacity tokens at the end of a trained turn, and its status: kept,
    truncated, or None and dropped_too_long when not even its first trained turn fits."""
    if len(rendered.ids) <= capacity:
        return rendered, "kept"
    fitting = [c for c in rendered.cuts if c <= capacity]
    if not fitting:
        return None, "dropped_too_long"
    n = fitting[-1]
    return Rendered(rendered.ids[:n], rendered.trained[:n], fitting), "truncated"
