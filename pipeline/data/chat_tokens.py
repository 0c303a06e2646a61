"""Conversations to token ids and a per-token loss mask, through the model's own chat template.

Most templates (Llama 3.x, ChatML and others) have no `{% generation %}` markers, so the assistant turns are found by
rendering prefixes: the conversation up to a user turn with the generation prompt ends where the assistant's answer
starts, and the conversation up to that answer ends where it ends (its end-of-turn token included, trailing
whitespace not). The full rendering is tokenized once with character offsets, and a token is trained when it starts
inside a trained span. This holds only when every prefix renders as a prefix of the whole; a template that rewrites
earlier turns (some strip reasoning from all but the last answer) gives `template_mismatch` for that conversation.
"""

from __future__ import annotations

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


def render(tokenizer, messages: list[dict], date: str, **kwargs) -> str:
    """The chat template applied to messages, with today's date pinned (Llama 3.1/3.2 templates print it)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, date_string=date, **kwargs)


def _assistant_spans(tokenizer, messages: list[dict], date: str, full: str) -> list[tuple[int, int]]:
    """Character spans of full holding each assistant turn."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(tokenizer, messages[:i], date, add_generation_prompt=True))
        upto = render(tokenizer, messages[: i + 1], date)
        if not full.startswith(upto) or not upto.startswith(full[:start]):
            raise TemplateMismatch
        end = len(upto.rstrip())
        spans.append((start, max(start, end)))
    return spans


def tokenize_conversation(tokenizer, messages: list[dict], date: str, train_on: str) -> Rendered:
    """Render, tokenize and mask one conversation; BadConversation or TemplateMismatch when it cannot be."""
    if any(m.get("role") not in ROLES or not isinstance(m.get("content"), str) for m in messages):
        raise BadConversation("malformed_message")
    check(messages)
    full = render(tokenizer, messages, date)
    spans = _assistant_spans(tokenizer, messages, date, full)
    if train_on == "last":
        spans = spans[-1:]
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    starts = np.fromiter((a for a, _ in enc["offset_mapping"]), dtype=np.int64, count=len(enc["input_ids"]))
    trained = np.full(len(starts), train_on == "all")
    cuts = []
    for a, b in spans:
        inside = (starts >= a) & (starts < b)
        trained |= inside
        if inside.any():
            cuts.append(int(np.flatnonzero(inside)[-1]) + 1)
    return Rendered(np.asarray(enc["input_ids"], dtype=np.uint32), trained, sorted(set(cuts)))


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
