"""Prompt records for online RL (GRPO), in TRL's prompt-only forms, turned into one: a Prompt.

    standard         {"prompt": "What is 17 + 25?", "answer": "42", ...}
    conversational   {"prompt": [{"role": "user", "content": "..."}, ...], "tools": [...], "tests": [...], ...}

A prompt record is a JSON object with a "prompt" key that is neither a preference record nor a conversation (those
are looked for first: a prompt with a completion is one of them). The model generates what follows the prompt: after
a user's or a tool's turn, the assistant's answer; after an assistant's turn with text (a prefill such as "<think>"),
the rest of that turn, as TRL continues it (continue_final_message). Every other key of the record (an answer, tests,
numbers, nested objects; not tools, which are the template's schemas as in a conversation) is kept as it is, as one
JSON object in the `columns` column, so rows with different keys share a column; the reward functions get them back
as keyword arguments. A non-empty `columns` ("{}" when there are none) is what marks a prompt row.

A record in these forms that cannot be a prompt raises BadPrompt with the reason DATA-HF reports: it is skipped,
never turned into text (its answer would be trained as words) nor a conversation.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from pipeline.prep import conversations, preferences

REASONS = ("malformed_prompt", "malformed_message", "unknown_role", "malformed_tool_call", "bad_tool_arguments",
           "empty_prompt", "ends_with_tool_call", "orphan_tool_result", "not_alternating", "bad_tool_schema",
           "bad_columns")
"""Why a prompt record is skipped: malformed_prompt (neither text nor a list of messages), the message reasons of
conversations.REASONS, empty_prompt (no text, or a turn without any), ends_with_tool_call (a conversational prompt whose
last turn is the assistant's calling tools: what follows is the tools' results, not the model's), bad_columns (another
key holding what JSON cannot: bytes or a date from a Parquet or YAML file; or a row of ours whose columns is no JSON
object)."""
OWN_KEYS = ("prompt", "tools")
"""The keys a prompt record's row holds in its own columns; every other key goes into `columns`."""
_ANSWER = {"role": "assistant", "content": "answer"}
"""The turn a conversational prompt is checked with: prompt + answer must be a trainable conversation."""


class BadPrompt(Exception):
    """A record in a prompt form that cannot be generated from; the message is one of REASONS."""


@dataclass(frozen=True)
class Prompt:
    """One prompt row: a standard prompt's text, or a conversational one's messages (named as a Pair's prompt, which
    is stored alike); the record's other keys."""

    prompt_text: str
    prompt_messages: list[dict]
    columns: str
    """The record's other keys as a JSON object ("{}" for none): one string, so rows of different keys share a
    column."""
    tools: str = ""
    """The function schemas as a JSON list ("" for none), as a conversation's."""

    @property
    def form(self) -> str:
        return "conversational" if self.prompt_messages else "standard"

    @property
    def chars(self) -> int:
        return len(self.prompt_text) + len(self.columns) + conversations.Chat(self.prompt_messages, self.tools).chars


def detect(record: object) -> str | None:
    """The prompt form of a JSON value ("standard", "conversational"; a prompt row of our own datasets read back has
    its own form), or None when it is no prompt record. A row of ours is a prompt row when its columns is not
    empty; a dataset written before columns existed holds none."""
    if not isinstance(record, dict):
        return None
    if conversations.is_own_row(record):
        if not record.get("columns"):
            return None
        return "conversational" if record["messages"] else "standard"
    if "prompt" not in record or preferences.detect(record) or conversations.detect(record):
        return None
    return "standard" if isinstance(record["prompt"], str) else "conversational"


def to_prompt(record: dict, form: str) -> Prompt:
    """The record (of form, from detect) as a checked Prompt; BadPrompt with the reason when it cannot be one."""
    try:
        if conversations.is_own_row(record):
            return _own_row(record, form)
        prompt = record["prompt"]
        text, messages = (prompt, []) if form == "standard" else ("", _messages(prompt))
        if not text.strip() and not messages:
            raise BadPrompt("empty_prompt")
        return Prompt(text, messages, _columns(record), conversations.tools_of(record.get("tools")))
    except conversations.BadConversation as exc:  # the reasons of the messages and tools, as conversations name them
        raise BadPrompt(str(exc)) from None


def _own_row(record: dict, form: str) -> Prompt:
    """A prompt row of ours read back: its columns string kept as it was written (the same bytes, not re-encoded)."""
    columns, text = record["columns"], record["text"]
    if not isinstance(columns, str) or not isinstance(_object(columns), dict):
        raise BadPrompt("bad_columns")
    if form == "conversational":
        return Prompt("", _messages(record["messages"]), columns, conversations.tools_of(record.get("tools")))
    if not isinstance(text, str) or not text.strip():
        raise BadPrompt("empty_prompt")
    return Prompt(text, [], columns, conversations.tools_of(record.get("tools")))


def _object(text: str) -> object:
    """A JSON string parsed, integers of any length as Decimals (int() refuses over 4300 digits); None if invalid."""
    try:
        return json.loads(text, parse_int=Decimal)
    except ValueError:
        return None


def _messages(items: object) -> list[dict]:
    """A conversational prompt: messages as a conversation's (tool calls, their results and reasoning traces
    allowed: an agent's turn so far), no empty turn, and with an answer appended (or ending with the assistant's
    text, which the model continues) a trainable conversation (system first if at all, then user; tool results
    answer calls)."""
    if not isinstance(items, list):
        raise BadPrompt("malformed_prompt")
    messages = conversations.messages_of(items, plain=False)
    if not messages or any(not m["content"].strip() and not m.get("tool_calls") for m in messages):
        raise BadPrompt("empty_prompt")
    if messages[-1]["role"] != "assistant":
        conversations.check([*messages, _ANSWER])  # orphan_tool_result, not_alternating
    elif messages[-1].get("tool_calls"):
        raise BadPrompt("ends_with_tool_call")
    else:  # a prefilled answer the model continues: with it, the conversation must already be trainable
        conversations.check(messages)
    return messages


def _columns(record: dict) -> str:
    """The record's other keys as one JSON object, values as they are."""
    try:
        return conversations.dumps({k: v for k, v in record.items() if k not in OWN_KEYS})
    except (TypeError, ValueError):  # bytes, a date or a time: JSON has no such value, and a guess would change it
        raise BadPrompt("bad_columns") from None


def files_holding(shards: list[str], prompts: bool, shown: int = 3) -> str:
    """The source files of a folder's prompt rows (or of its other rows), read back from DATA-HF's Arrow shards, with
    their rows of that kind: where a folder that mixes the two has the fewer."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found: Counter = Counter()
    for shard in shards:
        with pa.ipc.open_stream(shard) as reader:
            table = reader.read_all()
        is_prompt = pc.greater(pc.utf8_length(table.column("columns")), 0)
        for source, flag in zip(table.column("source").to_pylist(), is_prompt.to_pylist(), strict=True):
            if flag == prompts:
                found[source] += 1
    named = ", ".join(f"{source} ({n} row{'s' if n > 1 else ''})" for source, n in found.most_common(shown))
    return named + (f" and {len(found) - shown} more files" if len(found) > shown else "")


def mixed_folder(folder: Path, report: dict, shards: list[str]) -> str | None:
    """The one line refusing a folder that mixes prompt records with other rows (text, conversations, preference
    records), or None: a run trains on one kind, and GRPO's prompts hold no answer another objective could train."""
    prompts, pairs = report["prompts"]["rows"], report["preferences"]["rows"]
    if not 0 < prompts < report["rows"]:
        return None
    others = report["rows"] - prompts
    kinds = [f"{pairs} preference records" if pairs else "",
             f"{others - pairs} text or conversation rows" if others - pairs else ""]
    held = files_holding(shards, prompts <= others)
    return (f"{folder} mixes {prompts} prompt records with {' and '.join(k for k in kinds if k)} (the "
            f"{'prompts' if prompts <= others else 'others'} are in {held}): a run trains on one kind (GRPO on "
            "prompts, or SFT or a preference objective); convert them from separate folders into separate datasets")
