"""A conversation as its chat template renders it: stored messages (DATA-HF's, or a hub dataset's) in the form
templates take, prefixes rendered once each, and the checks that a trained turn's trace and calls, and the row's
schemas, are in the rendering rather than silently left out by a template that does not know them."""

from __future__ import annotations

import json
import re
from functools import cache

from pipeline.prep.conversations import (
    OPTIONAL,
    REASONING_KEYS,
    ROLES,
    TOOL_KEYS,
    BadConversation,
    check,
    first_of,
    tool_calls,
    tools_of,
)

BLANK = "\ue000"
"""A private-use character: what special-token texts in the data are replaced by to find the template's own."""


class NotRendered(Exception):
    """The template leaves out what a trained turn holds; the message is the status (tools_not_rendered or
    reasoning_not_rendered)."""


def render(tokenizer, messages: list[dict], date: str, tools: list | None = None, **kwargs) -> str:
    """The chat template applied to messages (as template_messages gives them) and tool schemas, with today's date
    pinned (Llama 3.1/3.2 templates print it)."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, date_string=date, **kwargs)


def _without_nulls(value: object) -> object:
    """A hub dataset's objects without None values: Arrow gives a struct column every key any row has, so a call's
    arguments or a schema read back from one carry the other rows' keys as None."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def template_messages(messages: list[dict], conversation: bool = True) -> list[dict]:
    """Stored messages as templates take them: the optional fields a message lacks left out (a dataset holds them
    as None, and Llama 3.1's template tests `'tool_calls' in message`), tool calls as objects with their arguments
    as objects (DATA-HF's JSON string, or a hub dataset's objects with arguments as JSON strings), and a turn that
    only calls tools with content "" where the data has null (OpenAI's form). BadConversation when malformed."""
    out = []
    for m in messages:
        # a hub dataset may name them as DATA-HF's reader accepts them (the older function_call, thinking...)
        m = {**m, "tool_calls": first_of(m, TOOL_KEYS), "reasoning_content": first_of(m, REASONING_KEYS)}
        content = "" if m.get("content") is None and m["tool_calls"] else m.get("content")
        if m.get("role") not in ROLES or not isinstance(content, str):
            raise BadConversation("malformed_message")
        message = {"role": m["role"], "content": content}
        for key in OPTIONAL:
            if m.get(key):
                value = m[key] if isinstance(m[key], str) else _without_nulls(m[key])
                message[key] = json.loads(tool_calls(value)) if key == "tool_calls" else value
        out.append(message)
    if conversation:  # a GRPO prompt's messages are a conversation's start (DATA-HF checked them as a prompt)
        check(out)
    return out


@cache
def longest_token(tokenizer) -> int:
    """The most characters one token of the vocabulary covers (its text's length bounds its decoded length): n
    characters of text are at least n / longest_token tokens."""
    return max(1, *map(len, tokenizer.get_vocab()))


class Conversation:
    """One conversation being tokenized: its messages and schemas as the template takes them, its prefixes rendered
    (each once), and the checks of what a trained turn holds."""

    def __init__(self, tokenizer, messages: list[dict], date: str, tools: object, train_reasoning: bool):
        self.tokenizer, self.date, self.train_reasoning = tokenizer, date, train_reasoning
        self.messages = template_messages(messages)
        schemas = tools if isinstance(tools, str) or not tools else _without_nulls(tools)
        self.tools = json.loads(tools_of(schemas)) if schemas else None
        self._rendered: dict[tuple[int, bool, bool], str] = {}
        self._verbatim = [0]
        """verbatim_tokens(k) for k = 0, 1, ...: filled as far as asked."""

    def render(self, n: int, prompt: bool = False, tools: bool = True) -> str:
        """The first n messages rendered (with the generation prompt; without the schemas)."""
        key = (n, prompt, tools)
        if key not in self._rendered:
            self._rendered[key] = render(self.tokenizer, self.messages[:n], self.date, self.tools if tools else None,
                                         add_generation_prompt=prompt)
        return self._rendered[key]

    def verbatim_tokens(self, n: int) -> int:
        """At least how many tokens every rendering of the first n messages holds: the user turns' and tool results'
        own tokens (templates rewrite the assistant's turns, not these), less two each for the merges its ends may
        make with the text around it. Each message is tokenized once, however often it is asked."""
        while len(self._verbatim) <= n:
            m = self.messages[len(self._verbatim) - 1]
            own = (len(self.tokenizer(m["content"], add_special_tokens=False, verbose=False)["input_ids"])
                   if m["role"] in ("user", "tool") else 0)
            self._verbatim.append(self._verbatim[-1] + max(own - 2, 0))
        return self._verbatim[n]

    def check_turn(self, i: int) -> None:
        """Assistant message i's reasoning trace and tool calls are in its rendering (as the last message): it
        renders otherwise without them. NotRendered when not (a template that does not know them)."""
        m, upto = self.messages[i], self.render(i + 1)
        for key, status in (("reasoning_content", "reasoning_not_rendered"), ("tool_calls", "tools_not_rendered")):
            if key in m:
                without = {k: v for k, v in m.items() if k != key}
                if render(self.tokenizer, [*self.messages[:i], without], self.date, self.tools) == upto:
                    raise NotRendered(status)

    def trace_end(self, i: int, body: str) -> int | None:
        """Where assistant message i's trace ends in its rendered body (the characters of the turn), when it has one
        and it is context (train_reasoning off); None when the whole turn is trained."""
        trace = (self.messages[i].get("reasoning_content") or "").strip()
        if not trace or self.train_reasoning:
            return None
        at = body.find(trace)
        if at < 0:  # rendered (check_turn), but not as written: where it ends is unknown, so it cannot be context
            raise NotRendered("reasoning_not_rendered")
        return at + len(trace)

    def check_tools(self, n: int) -> None:
        """A template given schemas renders them: the first n messages render otherwise without them."""
        if self.tools and self.render(n) == self.render(n, tools=False):
            raise NotRendered("tools_not_rendered")

    def holds(self, pattern: re.Pattern, n: int) -> bool:
        """Whether any text of the first n messages (contents, traces, calls: their names, keys and values) or of the
        schemas matches."""
        return any(pattern.search(s) for s in _strings([self.messages[:n], self.tools]))

    def blanked(self, pattern: re.Pattern, n: int) -> str:
        """The first n messages rendered with every match of pattern in their texts, the calls' and schemas' names,
        keys and values, replaced by as many BLANKs: the same length, so the template's own markers are where they
        are in the real rendering. Roles and types are left as they are (templates branch on them)."""
        def blank(value: object, key: str = "") -> object:
            if isinstance(value, str):
                return value if key in ("role", "type") else pattern.sub(lambda s: BLANK * len(s.group()), value)
            if isinstance(value, dict):
                return {blank(k): blank(v, k) for k, v in value.items()}
            if isinstance(value, list):
                return [blank(v) for v in value]
            return value

        return render(self.tokenizer, blank(self.messages[:n]), self.date, blank(self.tools))


def _strings(value: object) -> list[str]:
    """Every string in a JSON-like value, the keys of its objects too."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
