"""Conversations to token ids and a per-token loss mask, through the model's own chat template.

Most templates (Llama 3.x, ChatML and others) have no `{% generation %}` markers, so the assistant turns are found by
rendering prefixes: the conversation up to an assistant turn with the generation prompt ends where the assistant's
answer starts, and the conversation up to that answer ends where it ends (its end-of-turn token included, trailing
whitespace not). The full rendering is tokenized once with character offsets, and a token is trained when it starts
inside a trained span. This holds when every prefix renders as a prefix of the whole. Templates that rewrite earlier
turns (Qwen3 drops the reasoning of answers before the last user turn) are trained turn by turn (tokenize_turns):
the conversation becomes one sample per run of turns that render as prefixes of each other, each ending at its last
turn and beginning with the history as the template renders it before that turn, which is what the model sees at
inference; the history repeated in the later samples is the cost, counted. Rendering a prefix costs its length, so
only the turns that start within the block the conversation is cut to are rendered: a conversation of thousands of
turns costs what its first block does, not the square of its length. Turn by turn, each turn is rendered, but a
sample whose history cannot fit a block is not tokenized, and rendering stops once the user turns and tool results
alone cannot fit.

Tool calls and reasoning traces are rendered by the template from the stored fields (the row's tool schemas passed
as `tools`); a trained turn whose trace or calls the template does not render, or schemas it ignores, is
NotRendered rather than trained without them (pipeline/data/chat_render.py).

Text is text: a special token's text inside the data (`<|eot_id|><|start_header_id|>assistant` typed by a user, or in
a tool call or schema) stays text, so data cannot forge a turn; only the template's own markers are special tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from pipeline.data.chat_render import Conversation, longest_token

STATUS = ("kept", "truncated", "dropped_too_long", "malformed", "template_mismatch", "template_error",
          "tools_not_rendered", "reasoning_not_rendered")
"""What happened to each sample (a conversation, or one of its turn-by-turn samples), counted in the token cache's
meta.json and the log. template_error: the template raised (Llama 3.1's refuses two tool calls in one turn)."""


@dataclass
class Rendered:
    ids: np.ndarray
    """Token ids of the whole rendered conversation (uint32)."""
    trained: np.ndarray
    """Whether each token is a target of the loss (bool)."""
    cuts: list[int]
    """Token counts at which the conversation may be cut: the end of each trained span, ascending."""


@dataclass
class Turns:
    """A conversation's samples (tokenize_turns): one, or one per run of turns; None for a sample that cannot fit a
    block (not tokenized)."""

    samples: list[Rendered | None]
    whole: int = 0
    """Tokens of one rendering of the messages the tokenized samples cover (the last one's), where the conversation
    was split (0 where not): the samples' tokens beyond it are what rendering turn by turn costs."""

    @property
    def extra(self) -> int:
        return max(0, sum(len(s.ids) for s in self.samples if s is not None) - self.whole) if self.whole else 0


class TemplateMismatch(Exception):
    """A prefix of the conversation does not render as a prefix of the whole."""


def special_texts(tokenizer) -> re.Pattern | None:
    """The texts of the tokenizer's special tokens as one pattern (longest first), None when it has none."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None


@dataclass
class _Turn:
    index: int
    """The assistant message's index."""
    start: int
    end: int
    """Its characters in the rendering [start, end): from the generation prompt's end to its end-of-turn."""
    trained_from: int
    """Where its trained characters start: start, or the end of its reasoning trace when the trace is context."""


def _turn(i: int, start: int, upto: str) -> _Turn:
    """Assistant message i, starting at start, with upto (messages[:i + 1] rendered) ending it."""
    return _Turn(i, start, max(start, len(upto.rstrip())), start)


def _trained(conv: Conversation, turns: list[_Turn], text: str) -> list[_Turn]:
    """The turns to train, checked (Conversation.check_turn: NotRendered when the template leaves out a trace or a
    call), each trained from its trace's end when the trace is context."""
    out = []
    for t in turns:
        conv.check_turn(t.index)
        end = conv.trace_end(t.index, text[t.start:t.end])
        out.append(_Turn(t.index, t.start, t.end, t.start if end is None else t.start + end))
    return out


def _assistant_turns(conv: Conversation, turns: list[int], full: str, reach: int | None) -> list[_Turn]:
    """The assistant turns (indices into messages, ascending) of the full rendering that start at or before the
    character reach, or all of them when reach is None. Turns start in order, so the first one past reach ends the
    search: every turn rendered would make a long conversation quadratic in its length."""
    found = []
    for i in turns:
        start = len(conv.render(i, prompt=True))
        if reach is not None and start > reach:
            break
        upto = conv.render(i + 1)
        if not full.startswith(upto) or not upto.startswith(full[:start]):
            raise TemplateMismatch
        found.append(_turn(i, start, upto))
    return found


def _reach(starts: np.ndarray, capacity: int | None) -> int | None:
    """The character offset of the last-starting token among the first capacity (those a block of capacity holds);
    None when the conversation has no more tokens than that."""
    if capacity is None or len(starts) <= capacity:
        return None
    return int(starts[:capacity].max(initial=-1))


def _trained_turns(messages: list[dict], first_trained: int) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]


def tokenize_conversation(tokenizer, messages: list[dict], date: str, train_on: str,
                          keep_as_text: re.Pattern | None = None, capacity: int | None = None,
                          first_trained: int = 0, tools: str | list | None = "", train_reasoning: bool = True
                          ) -> Rendered:
    """Render, tokenize and mask one conversation as one sample; BadConversation, TemplateMismatch or NotRendered
    when it cannot be (a template's own error, jinja2's TemplateError, passes through).
    keep_as_text: the special-token texts (special_texts) that stay text inside the data (contents, traces, calls,
    schemas); None lets them become special tokens, as the tokenizer does by default.
    capacity: the tokens fit will cut the conversation to. When there are more, only the assistant turns that start
    among the first capacity tokens are found (and checked against the template): the mask and cuts past those
    tokens are incomplete, and fit(rendered, capacity) reads none of them. None finds every turn.
    first_trained: the assistant turns before this message are context, not targets (a preference pair's prompt).
    tools: the row's tool schemas (a JSON list as DATA-HF stores them, a hub dataset's list, or none).
    train_reasoning: a trained turn's reasoning trace is trained too; off, it is context."""
    conv = Conversation(tokenizer, messages, date, tools, train_reasoning)
    return _whole(conv, train_on, keep_as_text, capacity, first_trained)


def _whole(conv: Conversation, train_on: str, keep_as_text: re.Pattern | None, capacity: int | None,
           first_trained: int = 0) -> Rendered:
    n = len(conv.messages)
    full = conv.render(n)
    conv.check_tools(n)
    ids, starts = _ids(conv, n, full, keep_as_text)
    turns = _trained_turns(conv.messages, first_trained)
    found = _assistant_turns(conv, turns, full, _reach(starts, capacity))
    if train_on == "last":
        # a last turn not found starts past the first capacity tokens: fit drops the conversation either way
        found = found[-1:] if len(found) == len(turns) else []
    return _masked(ids, starts, _trained(conv, found, full), train_on == "all")


def tokenize_turns(tokenizer, messages: list[dict], date: str, train_on: str, keep_as_text: re.Pattern | None = None,
                   capacity: int | None = None, tools: str | list | None = "", train_reasoning: bool = True) -> Turns:
    """The conversation as tokenize_conversation gives it, or, when its template rewrites earlier turns, as one
    sample per run of turns that render as prefixes of each other (the module's docstring), with the tokens of one
    whole rendering of what they cover to count what that costs. train_on all trains every rendered token, so it is
    never split: a template that rewrites turns is a TemplateMismatch there.
    With capacity, a sample whose history is more characters than capacity tokens can hold is None (it cannot fit;
    it is not tokenized), and once the user turns and tool results alone are more tokens than capacity (every later
    history holds them), the rest of the conversation is one None, never rendered: the renderings a conversation
    costs are bounded by what a block holds, not by its length."""
    conv = Conversation(tokenizer, messages, date, tools, train_reasoning)
    try:
        return Turns([_whole(conv, train_on, keep_as_text, capacity)])
    except TemplateMismatch:
        if train_on == "all":
            raise
    limit = None if capacity is None else capacity * longest_token(conv.tokenizer)  # chars no fitting history has
    samples: list[Rendered | None] = []
    group: list[_Turn] = []
    text, upto_n, cut = "", 0, False
    for i in _trained_turns(conv.messages, 0)[-1 if train_on == "last" else 0:]:
        if capacity is not None and conv.verbatim_tokens(i) > capacity:
            cut = True
            break
        ctx, upto = conv.render(i, prompt=True), conv.render(i + 1)
        if not upto.startswith(ctx):
            raise TemplateMismatch  # the turn cannot be found even alone
        if group and not upto.startswith(text):
            samples.append(_sample(conv, upto_n, text, group, keep_as_text, limit))
            group = []
        group.append(_turn(i, len(ctx), upto))
        text, upto_n = upto, i + 1
    if group:
        full = conv.render(len(conv.messages))
        if not cut and full.startswith(text):  # the last run takes the messages after its last turn, as a whole does
            text, upto_n = full, len(conv.messages)
        samples.append(_sample(conv, upto_n, text, group, keep_as_text, limit))
    if cut:
        samples.append(None)
    # the last tokenized sample is the rendering of every message the tokenized samples cover
    last = next((r for r in reversed(samples) if r is not None), None)
    return Turns(samples, len(last.ids) if last is not None else 0)


def _sample(conv: Conversation, n: int, text: str, turns: list[_Turn], keep_as_text: re.Pattern | None,
            limit: int | None) -> Rendered | None:
    """The first n messages' rendering text, tokenized and masked for turns; None when the history before the first
    turn is more than limit characters (more tokens than a block holds)."""
    if limit is not None and turns[0].start > limit:
        return None
    conv.check_tools(n)
    ids, starts = _ids(conv, n, text, keep_as_text)
    return _masked(ids, starts, _trained(conv, turns, text), False)


def _ids(conv: Conversation, n: int, text: str, keep_as_text: re.Pattern | None) -> tuple[list[int], np.ndarray]:
    """Token ids of text (the first n messages rendered) and the character where each starts."""
    if keep_as_text is not None and conv.holds(keep_as_text, n):
        ids, offsets = _contents_as_text(conv, n, text, keep_as_text)
    else:
        ids, offsets = _encode(conv.tokenizer, text, split_special=False, at=0)
    return ids, np.asarray(offsets, dtype=np.int64)


def _masked(ids: list[int], starts: np.ndarray, turns: list[_Turn], every: bool) -> Rendered:
    """The trained mask (every token, or those starting in a turn's trained characters) and the cuts at each
    turn's end."""
    trained = np.full(len(starts), every)
    cuts = []
    for t in turns:
        inside = (starts >= t.start) & (starts < t.end)
        trained |= (starts >= t.trained_from) & (starts < t.end)
        if inside.any():
            cuts.append(int(np.flatnonzero(inside)[-1]) + 1)
    return Rendered(np.asarray(ids, dtype=np.uint32), trained, sorted(set(cuts)))


def _encode(tokenizer, text: str, split_special: bool, at: int) -> tuple[list[int], list[int]]:
    """Token ids of text and where each starts, counted from `at`."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False,
                    split_special_tokens=split_special, verbose=False)
    return enc["input_ids"], [at + a for a, _ in enc["offset_mapping"]]


def _contents_as_text(conv: Conversation, n: int, full: str, keep_as_text: re.Pattern) -> tuple[list[int], list[int]]:
    """Token ids and starts of full (the first n messages rendered) in which only the template's own special tokens
    are special. They are found by rendering the conversation again with every special-token text in the data
    (Conversation.blanked) replaced by as many BLANKs; the text between them is tokenized with special tokens
    split. The tokenizer itself tokenizes the text between two special tokens apart from the rest, so a conversation
    whose data holds none gets the ids it always had."""
    blanked = conv.blanked(keep_as_text, n)
    tokenizer = conv.tokenizer
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
            if full[a:b] != blanked[a:b]:  # the template rendered the blanked data otherwise, not only blanked
                raise TemplateMismatch
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
