"""Conversations in the formats users have, turned into one: a list of {"role", "content"} messages.

Recognised records (a JSON object, one per .jsonl line or per element of a .json list):
    OpenAI / HF      {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    ShareGPT         {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
    alpaca           {"instruction": "...", "input": "...", "output": "..."}      (input optional)
    prompt/complete  {"prompt": "...", "completion": "..."}                         (or lists of messages)
Any other record is not a conversation (its strings stay text). A record that is one of these but malformed raises
BadConversation with the reason DATA-HF reports: it is skipped, never turned into text.
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
OWN_ROW = {"text", "messages", "source", "chosen", "rejected"}
"""The columns of a DATA-HF dataset: a record with these (a dataset's to_json or to_parquet) is one of its rows (a
preference pair when chosen is not empty: pipeline/prep/preferences.py)."""
REASONS = ("malformed_message", "unknown_role", "tool_calls", "reasoning_trace", "empty", "no_assistant_turn",
           "not_alternating")
"""Why a conversation is skipped, in the order they are checked."""
TOOL_ROLES = {"tool", "function", "function_call", "observation", "ipython"}
"""Roles of tool calls and their results (OpenAI's, ShareGPT's as LLaMA-Factory writes it, Llama 3.1's)."""
TOOL_KEYS = ("tool_calls", "function_call")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
"""A message's tool calls and reasoning trace: not trained yet, so a conversation with them is skipped by reason
(tool_calls, reasoning_trace) rather than trained without them (the calls or the trace silently dropped)."""


class BadConversation(Exception):
    """A record in a conversation format that cannot be trained on; the message is one of REASONS."""


def _content(value: object) -> str:
    """A message's text: a string, or OpenAI's list of parts ({"type": "text", "text": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise BadConversation("malformed_message")


def _messages(items: object, role_key: str, content_key: str, roles: dict[str, str]) -> list[dict]:
    if not isinstance(items, list):
        raise BadConversation("malformed_message")
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get(role_key), str) or content_key not in item:
            raise BadConversation("malformed_message")
        name = item[role_key].strip().lower()
        if name in TOOL_ROLES or any(item.get(k) for k in TOOL_KEYS):
            raise BadConversation("tool_calls")
        if any(item.get(k) for k in REASONING_KEYS):
            raise BadConversation("reasoning_trace")
        role = roles.get(name)
        if role is None:
            raise BadConversation("unknown_role")
        out.append({"role": role, "content": _content(item[content_key])})
    return out


def messages_of(items: object) -> list[dict]:
    """An OpenAI-style list of {"role", "content"} messages, read and checked message by message (roles known,
    content parts joined); BadConversation otherwise. Not checked as a whole conversation (check does that)."""
    return _messages(items, "role", "content", {r: r for r in ROLES})


def _side(value: object, role: str) -> list[dict]:
    """One side of a prompt/completion pair: a string, or already a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, "role", "content", {r: r for r in ROLES})


def detect(record: object) -> str | None:
    """The conversation format of a JSON value ("row" for a row of our own datasets, which may be text), or None
    when it is not a conversation."""
    if not isinstance(record, dict):
        return None
    if "text" in record and isinstance(record.get("messages"), list) and set(record) <= OWN_ROW:
        return "row"
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    return None


def to_messages(record: dict, fmt: str) -> list[dict]:
    """The record (of format fmt, from detect) as checked messages; BadConversation when it cannot be trained on."""
    if fmt == "messages":
        if record.get("tools"):  # function schemas for the template: a conversation with tool calls
            raise BadConversation("tool_calls")
        messages = _messages(record["messages"], "role", "content", {r: r for r in ROLES})
    elif fmt == "sharegpt":
        messages = _messages(record["conversations"], "from", "value", SHAREGPT_ROLES)
    elif fmt == "alpaca":
        parts = [record["instruction"], record.get("input") or ""]
        if not all(isinstance(p, str) for p in parts) or not isinstance(record["output"], str):
            raise BadConversation("malformed_message")
        messages = [{"role": "user", "content": "\n\n".join(p for p in parts if p.strip())},
                    {"role": "assistant", "content": record["output"]}]
    else:
        messages = _side(record["prompt"], "user") + _side(record["completion"], "assistant")
    check(messages)
    return messages


def check(messages: list[dict]) -> None:
    """A trainable conversation: no empty turn, an optional system message first, then user and assistant turns
    alternating from a user turn, with at least one assistant turn."""
    if not messages or any(not m["content"].strip() for m in messages):
        raise BadConversation("empty")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise BadConversation("no_assistant_turn")
    turns = roles[1:] if roles[0] == "system" else roles
    if any(role != ("user", "assistant")[i % 2] for i, role in enumerate(turns)):
        raise BadConversation("not_alternating")
