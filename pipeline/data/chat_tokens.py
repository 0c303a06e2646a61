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
turns costs what its first block does, not the square of its length.

Tool calls and reasoning traces are rendered by the template from the stored fields (the row's tool schemas passed
as `tools`); a trained turn whose trace or calls the template does not render, or schemas it ignores, is
NotRendered rather than trained without them.

Text is text: a special token's text inside a message (`<|eot_id|><|start_header_id|>assistant` typed by a user) stays
text, so data cannot forge a turn; only the template's own markers are special tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from pipeline.prep.conversations import OPTIONAL, ROLES, BadConversation, check, tool_calls, tools_of

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
    context: int = 0
    """Tokens before the first trained turn that an earlier sample of the same conversation also holds (turn by
    turn only): what rendering turn by turn costs."""


class TemplateMismatch(Exception):
    """A prefix of the conversation does not render as a prefix of the whole."""


class NotRendered(Exception):
    """The template leaves out what a trained turn holds; the message is the status (tools_not_rendered or
    reasoning_not_rendered)."""


BLANK = "\ue000"
"""A private-use character: what special-token texts in contents are replaced by to find the template's own."""


def special_texts(tokenizer) -> re.Pattern | None:
    """The texts of the tokenizer's special tokens as one pattern (longest first), None when it has none."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None


def template_messages(messages: list[dict]) -> list[dict]:
    """Stored messages as templates take them: the optional fields a message lacks left out (a dataset holds them
    as None, and Llama 3.1's template tests `'tool_calls' in message`), tool calls as objects again."""
    out = []
    for m in messages:
        message = {"role": m["role"], "content": m["content"]}
        for key in OPTIONAL:
            if m.get(key):  # a hub dataset's calls may be objects already, their arguments strings
                message[key] = json.loads(tool_calls(m[key])) if key == "tool_calls" else m[key]
        out.append(message)
    return out


def render(tokenizer, messages: list[dict], date: str, tools: list | None = None, **kwargs) -> str:
    """The chat template applied to messages (as template_messages gives them) and tool schemas, with today's date
    pinned (Llama 3.1/3.2 templates print it)."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, date_string=date, **kwargs)


@dataclass
class _Turn:
    index: int
    """The assistant message's index."""
    start: int
    end: int
    """Its characters in the rendering [start, end): from the generation prompt's end to its end-of-turn."""
    trained_from: int
    """Where its trained characters start: start, or the end of its reasoning trace when the trace is context."""


class _Conversation:
    """One conversation being tokenized: its messages as the template takes them, and how turns are rendered."""

    def __init__(self, tokenizer, messages: list[dict], date: str, tools: object, train_reasoning: bool):
        if any(m.get("role") not in ROLES or not isinstance(m.get("content"), str) for m in messages):
            raise BadConversation("malformed_message")
        check(messages)
        self.tokenizer, self.date, self.train_reasoning = tokenizer, date, train_reasoning
        self.messages = template_messages(messages)
        self.tools = json.loads(tools_of(tools)) if tools else None

    def render(self, n: int, prompt: bool = False) -> str:
        """The first n messages rendered (with the generation prompt)."""
        return render(self.tokenizer, self.messages[:n], self.date, self.tools, add_generation_prompt=prompt)

    def turn(self, i: int, text: str, start: int, upto: str) -> _Turn:
        """Assistant message i, found in text at start with upto (messages[:i + 1] rendered) ending it."""
        end = max(start, len(upto.rstrip()))
        return _Turn(i, start, end, start)

    def trained(self, turns: list[_Turn], text: str) -> list[_Turn]:
        """The turns to train, checked: NotRendered when the template left out a reasoning trace or a call of
        one; with train_reasoning off, each trained from its trace's end."""
        out = []
        for t in turns:
            body, m = text[t.start:t.end], self.messages[t.index]
            trained_from = t.start
            if trace := (m.get("reasoning_content") or "").strip():
                at = body.find(trace)
                if at < 0:
                    raise NotRendered("reasoning_not_rendered")
                if not self.train_reasoning:
                    trained_from = t.start + at + len(trace)
            if any(call["function"]["name"] not in body for call in m.get("tool_calls") or []):
                raise NotRendered("tools_not_rendered")
            out.append(_Turn(t.index, t.start, t.end, trained_from))
        return out

    def check_tools(self, text: str) -> None:
        """A template given schemas renders them: the text differs from the rendering without them."""
        if self.tools and text == render(self.tokenizer, self.messages, self.date):
            raise NotRendered("tools_not_rendered")


def _assistant_turns(conv: _Conversation, turns: list[int], full: str, reach: int | None) -> list[_Turn]:
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
        found.append(conv.turn(i, full, start, upto))
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
                          first_trained: int = 0, tools: str = "", train_reasoning: bool = True) -> Rendered:
    """Render, tokenize and mask one conversation as one sample; BadConversation, TemplateMismatch or NotRendered
    when it cannot be (a template's own error, jinja2's TemplateError, passes through).
    keep_as_text: the special-token texts (special_texts) that stay text inside message contents; None lets them
    become special tokens, as the tokenizer does by default.
    capacity: the tokens fit will cut the conversation to. When there are more, only the assistant turns that start
    among the first capacity tokens are found (and checked against the template): the mask and cuts past those
    tokens are incomplete, and fit(rendered, capacity) reads none of them. None finds every turn.
    first_trained: the assistant turns before this message are context, not targets (a preference pair's prompt).
    tools: the row's tool schemas (a JSON list, "" for none). train_reasoning: a trained turn's reasoning trace is
    trained too; off, it is context."""
    conv = _Conversation(tokenizer, messages, date, tools, train_reasoning)
    full = conv.render(len(messages))
    conv.check_tools(full)
    ids, starts = _ids(conv, len(messages), full, keep_as_text)
    turns = _trained_turns(messages, first_trained)
    found = _assistant_turns(conv, turns, full, _reach(starts, capacity))
    if train_on == "last":
        # a last turn not found starts past the first capacity tokens: fit drops the conversation either way
        found = found[-1:] if len(found) == len(turns) else []
    return _masked(ids, starts, conv.trained(found, full), train_on == "all")


def tokenize_turns(tokenizer, messages: list[dict], date: str, train_on: str, keep_as_text: re.Pattern | None = None,
                   capacity: int | None = None, tools: str = "", train_reasoning: bool = True) -> list[Rendered]:
    """The conversation as tokenize_conversation gives it, or, when its template rewrites earlier turns, as one
    sample per run of turns that render as prefixes of each other (the module's docstring); each later sample's
    repeated history is its `context`. train_on all trains every rendered token, so it is never split: a template
    that rewrites turns is a TemplateMismatch there. Samples whose history alone fills capacity end the list (a
    later turn's history holds it)."""
    try:
        return [tokenize_conversation(tokenizer, messages, date, train_on, keep_as_text, capacity, tools=tools,
                                      train_reasoning=train_reasoning)]
    except TemplateMismatch:
        if train_on == "all":
            raise
    conv = _Conversation(tokenizer, messages, date, tools, train_reasoning)
    turns = _trained_turns(messages, 0)
    samples: list[Rendered] = []
    group: list[_Turn] = []
    text, upto_n = "", 0
    for i in turns[-1:] if train_on == "last" else turns:
        ctx, upto = conv.render(i, prompt=True), conv.render(i + 1)
        if not upto.startswith(ctx):
            raise TemplateMismatch  # the turn cannot be found even alone
        if group and not upto.startswith(text):
            samples.append(_sample(conv, upto_n, text, group, keep_as_text, bool(samples)))
            if capacity is not None and samples[-1].cuts and samples[-1].cuts[0] > capacity:
                return samples  # its first turn ends past a block: so will every later one's
            group = []
        group.append(conv.turn(i, upto, len(ctx), upto))
        text, upto_n = upto, i + 1
    full = conv.render(len(messages))
    if full.startswith(text):  # the last run takes the messages after its last turn, as a whole rendering does
        text, upto_n = full, len(messages)
    conv.check_tools(text)
    samples.append(_sample(conv, upto_n, text, group, keep_as_text, bool(samples)))
    return samples


def _sample(conv: _Conversation, n: int, text: str, turns: list[_Turn], keep_as_text: re.Pattern | None,
            later: bool) -> Rendered:
    """The first n messages' rendering text, tokenized and masked for turns; a later sample's tokens before its
    first turn are its repeated context."""
    ids, starts = _ids(conv, n, text, keep_as_text)
    rendered = _masked(ids, starts, conv.trained(turns, text), False)
    if later:
        rendered.context = int((starts < turns[0].start).sum())
    return rendered


def _ids(conv: _Conversation, n: int, text: str, keep_as_text: re.Pattern | None) -> tuple[list[int], np.ndarray]:
    """Token ids of text (the first n messages rendered) and the character where each starts."""
    if keep_as_text is not None and any(keep_as_text.search(m["content"] + m.get("reasoning_content", ""))
                                        for m in conv.messages[:n]):
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


def _contents_as_text(conv: _Conversation, n: int, full: str, keep_as_text: re.Pattern) -> tuple[list[int], list[int]]:
    """Token ids and starts of full (the first n messages rendered) in which only the template's own special tokens
    are special. They are found by rendering the conversation again with every special-token text in the contents
    and reasoning traces blanked to as many BLANKs; the text between them is tokenized with special tokens split.
    The tokenizer itself tokenizes the text between two special tokens apart from the rest, so a conversation whose
    contents hold none gets the ids it always had."""
    def blank(text: str) -> str:
        return keep_as_text.sub(lambda s: BLANK * len(s.group()), text)

    messages = [{**m, "content": blank(m["content"]), **({"reasoning_content": blank(m["reasoning_content"])}
                                                        if "reasoning_content" in m else {})}
                for m in conv.messages[:n]]
    blanked = render(conv.tokenizer, messages, conv.date, conv.tools)
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
