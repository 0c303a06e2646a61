"""Conversations in the formats users have, turned into one: a Chat of OpenAI-style messages and tool schemas.

Recognised records (a JSON object, one per .jsonl line or per element of a .json list):
    OpenAI / HF      {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...], "tools": [...]}
    ShareGPT         {"conversations": [{"from": "system"|"human"|"gpt"|"function_call"|"observation", "value": ...}],
                      "tools": "[...]"}                                             (LLaMA-Factory's, tools optional)
    alpaca           {"instruction": "...", "input": "...", "output": "..."}      (input optional)
    prompt/complete  {"prompt": "...", "completion": "..."}                         (or lists of messages)
An assistant message may carry tool_calls (OpenAI's, or the older function_call) and a reasoning trace
(reasoning_content, thinking or reasoning); a tool result is a `tool` message (OpenAI's `function`, Llama 3.1's
`ipython` and ShareGPT's `observation` are read as one). Stored messages keep role and content, and where present
reasoning_content, tool_calls (a JSON list of {"type": "function", "function": {"name", "arguments": {...}}}: a
string keeps the Arrow schema the same whatever the arguments hold), tool_call_id and name.

Any other record is not a conversation (its strings stay text). A record that is one of these but malformed raises
BadConversation with the reason DATA-HF reports: it is skipped, never turned into text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal

ROLES = ("system", "user", "assistant", "tool")
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool", "function": "tool",
                "ipython": "tool"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
OWN_ROW = {"text", "messages", "source", "chosen", "rejected", "tools", "columns"}
"""The columns of a DATA-HF dataset: a record with these (a dataset's to_json or to_parquet) is one of its rows (a
preference pair when chosen is not empty: pipeline/prep/preferences.py; a prompt when columns is not empty:
pipeline/prep/prompts.py). A dataset written before columns existed has the others alone."""
REASONS = ("malformed_message", "unknown_role", "malformed_tool_call", "bad_tool_arguments", "bad_tool_schema",
           "tool_calls", "reasoning_trace", "empty", "no_assistant_turn", "orphan_tool_result", "not_alternating")
"""Why a conversation is skipped, in the order they are checked (tool_calls and reasoning_trace: a preference pair
holding them, which preference objectives do not train yet)."""
TOOL_KEYS = ("tool_calls", "function_call")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
"""Where an assistant message's tool calls and reasoning trace are found (the first present is read)."""
OPTIONAL = ("reasoning_content", "tool_calls", "tool_call_id", "name")
"""The stored message fields besides role and content (absent, or None in a dataset, when the message has none)."""


class BadConversation(Exception):
    """A record in a conversation format that cannot be trained on; the message is one of REASONS."""


@dataclass
class Chat:
    """One conversation row: its messages, and the tool schemas its template is given."""

    messages: list[dict]
    tools: str = ""
    """The function schemas as a JSON list ("" for none): one string, so rows of different schemas share a column."""

    @property
    def chars(self) -> int:
        return len(self.tools) + sum(len(m["content"]) + len(m.get("reasoning_content") or "")
                                     + len(m.get("tool_calls") or "") for m in self.messages)


def _content(value: object) -> str:
    """A message's text: a string, or OpenAI's list of parts ({"type": "text", "text": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise BadConversation("malformed_message")


def _json_default(value: object) -> object:
    """A long integer the reader kept as a Decimal (pipeline/prep/extract.py), written back as the number it is."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    raise TypeError(type(value).__name__)


def dumps(value: object) -> str:
    """value as the JSON string a dataset stores (non-ASCII as it is)."""
    return json.dumps(value, ensure_ascii=False, default=_json_default)


def _parsed(value: object, reason: str) -> object:
    """A JSON value given as a string (a tool call's arguments, LLaMA-Factory's tools), parsed; BadConversation."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise BadConversation(reason) from None


def tool_calls(value: object) -> str:
    """An assistant turn's calls (a list of OpenAI tool calls, or one {"name", "arguments"} as the older
    function_call and ShareGPT's function_call value hold it) as the stored JSON list, arguments as objects."""
    calls = _parsed(value, "malformed_tool_call")
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise BadConversation("malformed_tool_call")
        arguments = _parsed(fn.get("arguments") or {}, "bad_tool_arguments")  # "" and null: a call without any
        if not isinstance(arguments, dict):
            raise BadConversation("bad_tool_arguments")
        entry: dict = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    if not out:
        raise BadConversation("malformed_tool_call")
    return dumps(out)


def tools_of(value: object) -> str:
    """A row's tool schemas (a list, or a JSON string of one) as the stored JSON list; "" for none. Each must be a
    function schema: {"type": "function", "function": {"name", ...}} or the function object alone."""
    if isinstance(value, str) and not value.strip():  # what a row of ours without schemas stores (and to_json writes)
        return ""
    schemas = _parsed(value, "bad_tool_schema")
    if schemas in (None, "", []):
        return ""
    if not isinstance(schemas, list):
        raise BadConversation("bad_tool_schema")
    for schema in schemas:
        fn = schema.get("function", schema) if isinstance(schema, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip() or \
                not isinstance(fn.get("parameters", {}), dict):
            raise BadConversation("bad_tool_schema")
    return dumps(schemas)


def first_of(item: dict, keys: tuple[str, ...]) -> object:
    """The first of these fields the message has, not empty (TOOL_KEYS, REASONING_KEYS), or None."""
    return next((item[k] for k in keys if item.get(k)), None)


def _message(item: dict, name: str, role: str, content_key: str, plain: bool) -> dict:
    """One message in the stored form; plain: tool calls and reasoning traces are refused (a preference pair)."""
    calls = item.get(content_key) if name == "function_call" else first_of(item, TOOL_KEYS)
    if name == "function_call" and calls is None:
        raise BadConversation("malformed_tool_call")
    reasoning = first_of(item, REASONING_KEYS)
    if plain and (role == "tool" or calls is not None):
        raise BadConversation("tool_calls")
    if plain and reasoning is not None:
        raise BadConversation("reasoning_trace")
    if name == "function_call" or (calls is not None and item.get(content_key) is None):
        content = ""  # ShareGPT's value is the call; OpenAI's turn that only calls has content null
    else:
        content = item[content_key]
        content = dumps(content) if role == "tool" and isinstance(content, dict | list) and not _is_parts(content) \
            else _content(content)
    out = {"role": role, "content": content}
    if calls is not None:
        if role != "assistant":
            raise BadConversation("malformed_tool_call")
        out["tool_calls"] = tool_calls(calls)
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise BadConversation("malformed_message")
        out["reasoning_content"] = reasoning
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(item.get(key), str) and item[key]:
                out[key] = item[key]
    return out


def _is_parts(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(p, dict) and "text" in p for p in value)


def _messages(items: object, role_key: str, content_key: str, roles: dict[str, str], plain: bool = False
              ) -> list[dict]:
    if not isinstance(items, list):
        raise BadConversation("malformed_message")
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get(role_key), str) or \
                (content_key not in item and not any(item.get(k) for k in TOOL_KEYS)):
            raise BadConversation("malformed_message")
        name = item[role_key].strip().lower()
        role = roles.get(name)
        if role is None:
            raise BadConversation("unknown_role")
        out.append(_message(item, name, role, content_key, plain))
    return out


def messages_of(items: object, plain: bool = True) -> list[dict]:
    """An OpenAI-style list of {"role", "content"} messages as a preference pair (plain: no tool calls or reasoning
    traces) or a prompt holds them, read and checked message by message (roles known, content parts joined);
    BadConversation otherwise. Not checked as a whole conversation (check does that)."""
    return _messages(items, "role", "content", OPENAI_ROLES, plain=plain)


def _side(value: object, role: str) -> list[dict]:
    """One side of a prompt/completion pair: a string, or already a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, "role", "content", OPENAI_ROLES)


def detect(record: object) -> str | None:
    """The conversation format of a JSON value ("row" for a row of our own datasets, which may be text), or None
    when it is not a conversation."""
    if not isinstance(record, dict):
        return None
    if is_own_row(record):
        return "row"
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    return None  # {"prompt": ...} alone is a prompt for online RL (pipeline/prep/prompts.py), never a conversation


def is_own_row(record: dict) -> bool:
    """Whether a JSON object is a row of one of our datasets read back (its to_json or to_parquet): our columns
    alone, text and messages among them (a dataset written before some of the others existed lacks those)."""
    return "text" in record and isinstance(record.get("messages"), list) and set(record) <= OWN_ROW


def to_chat(record: dict, fmt: str) -> Chat:
    """The record (of format fmt, from detect) as a checked Chat; BadConversation when it cannot be trained on."""
    if fmt == "messages":
        messages = _messages(record["messages"], "role", "content", OPENAI_ROLES)
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
    tools = tools_of(record.get("tools")) if fmt != "alpaca" else ""
    check(messages)
    return Chat(messages, tools)


def check(messages: list[dict]) -> None:
    """A trainable conversation: no empty turn (a turn that only calls tools may have no text), an optional system
    message first, then a user turn, each user turn answered by the assistant; an assistant turn that calls tools
    is followed by their results (tool messages) and then the assistant again; at least one assistant turn."""
    if not messages or any(not m["content"].strip() and not m.get("tool_calls") for m in messages):
        raise BadConversation("empty")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise BadConversation("no_assistant_turn")
    turns = messages[1:] if roles[0] == "system" else messages
    before = "start"  # what the previous turn was: start, user, answer (assistant), call (assistant calling), tool
    for m in turns:
        role = m["role"]
        if role == "tool" and before not in ("call", "tool"):
            raise BadConversation("orphan_tool_result")
        allowed = {"start": ("user",), "user": ("assistant",), "answer": ("user",), "call": ("tool",),
                   "tool": ("tool", "assistant")}[before]
        if role not in allowed:
            raise BadConversation("not_alternating")
        before = ("call" if m.get("tool_calls") else "answer") if role == "assistant" else role
