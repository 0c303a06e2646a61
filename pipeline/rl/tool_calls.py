"""The model's tool calls read back from its turn, in the form its chat template writes them: the tokenizer's own
response_template (transformers' response parsing, which a model may ship in its tokenizer_config.json) where it has
one; else JSON between <tool_call> tags (Qwen 2.5 and 3, Hermes and the templates that copy them) or a bare JSON
object (Llama 3.1 to 3.3: {"name": ..., "parameters": {...}}). Which one is not guessed from the family's name: a
probe call is rendered through the template and the reader is the one that reads it back whole (call_reader); a
template none reads back is one line at preflight.

A call that does not parse is the model's mistake: Parsed.error says why, and the episode answers it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from pipeline.data.chat_render import render
from pipeline.errors import UserError

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""A call as Hermes-style templates ask for it: JSON between tags, {"name": ..., "arguments": {...}}."""
THINKING = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
"""A reasoning span (Qwen 3, DeepSeek-R1): a call drafted in it is thought, not made (as transformers' parsers read
the content alone)."""
PYTHON_TAG = "<|python_tag|>"
"""Llama 3's marker before a call of a built-in tool, which its custom calls may carry too."""


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Parsed:
    """What the model's turn asked for: its calls, or why they could not be read."""

    calls: list[Call]
    error: str = ""
    """Why a call did not parse ("" when every one did): answered to the model, counted."""


class CallReader(Protocol):
    name: str

    def parse(self, turn: str, before: str) -> Parsed:
        """The calls in the text of the model's turn (special tokens kept, its end-of-turn token included); before:
        the text the turn continues (the prompt and the episode's earlier turns)."""


def _outside_thinking(turn: str, before: str) -> str:
    """The turn's text outside its reasoning, counting a <think> the text before it left open (a template whose
    generation prompt opens one: the turn starts inside it)."""
    opened = before.rfind("<think>") > before.rfind("</think>")
    return THINKING.sub("", ("<think>" if opened else "") + turn)


def _call(obj: object, arguments_key: str) -> Call | str:
    """A call from a parsed JSON object, or why it is none."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f'a tool call must be a JSON object with a "name" and "{arguments_key}"'
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"the arguments of {obj['name']} are not a JSON object"
    if not isinstance(arguments, dict):
        return f"the arguments of {obj['name']} are not a JSON object"
    return Call(obj["name"], arguments)


class Tagged:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as many as the turn holds, outside its reasoning."""

    name = "<tool_call> JSON"

    def parse(self, turn: str, before: str = "") -> Parsed:
        text = _outside_thinking(turn, before)
        calls = []
        for body in CALL.findall(text):
            try:
                found = _call(json.loads(body), "arguments")
            except json.JSONDecodeError as exc:
                return Parsed(calls, f"the tool call is not JSON ({exc.msg} at character {exc.pos})")
            if isinstance(found, str):
                return Parsed(calls, found)
            calls.append(found)
        if not calls and "<tool_call>" in text:
            return Parsed(calls, "a <tool_call> tag is not closed by </tool_call>")
        return Parsed(calls)


class BareJson:
    """A turn that is one JSON object, {"name": ..., "parameters": {...}} (Llama 3's form; "arguments" read too),
    optionally after <|python_tag|>; a turn that starts otherwise is an answer, not a call."""

    name = "Llama 3's JSON"

    def parse(self, turn: str, before: str = "") -> Parsed:
        text = _outside_thinking(turn, before).strip()
        tagged = text.startswith(PYTHON_TAG)
        text = text.removeprefix(PYTHON_TAG).lstrip()
        if not tagged and not re.match(r'\{\s*"name"', text):
            return Parsed([])
        try:
            obj, _ = json.JSONDecoder().raw_decode(text)  # what follows it (its end-of-turn token) is not the call's
        except json.JSONDecodeError as exc:
            return Parsed([], f"the tool call is not JSON ({exc.msg} at character {exc.pos})")
        found = _call(obj, "parameters")
        return Parsed([], found) if isinstance(found, str) else Parsed([found])


class ResponseTemplate:
    """The tokenizer's own response_template, read by transformers' parse_response (with the run's tool schemas, so
    an argument is typed as its schema says)."""

    name = "the tokenizer's response_template"

    def __init__(self, tokenizer, schemas: list[dict]) -> None:
        self.tokenizer, self.schemas = tokenizer, schemas

    def parse(self, turn: str, before: str) -> Parsed:
        try:
            message = self.tokenizer.parse_response(turn, prefix=before, tools=self.schemas or None)
        except Exception as exc:  # transformers' parser on the model's text: its mistake, answered
            return Parsed([], f"the turn does not parse as the template writes calls ({type(exc).__name__}: {exc})")
        calls = []
        for entry in message.get("tool_calls") or []:
            function = entry.get("function", entry) if isinstance(entry, dict) else entry
            found = _call(function, "arguments")
            if isinstance(found, str):
                return Parsed(calls, found)
            calls.append(found)
        return Parsed(calls)


PROBE = Call("probe_tool", {"probe_key": "probe value", "probe_count": 3})
PROBE_SCHEMA = {"type": "function", "function": {
    "name": "probe_tool", "description": "A probe.",
    "parameters": {"type": "object", "properties": {"probe_key": {"type": "string", "description": "a text"},
                                                    "probe_count": {"type": "integer", "description": "a count"}},
                   "required": ["probe_key", "probe_count"]}}}


def call_reader(tokenizer, chat_date: str, schemas: list[dict], model: str, flag: str = "--tools") -> CallReader:
    """The reader of the model's calls: the first of the tokenizer's response_template, <tool_call> JSON and Llama 3's
    JSON that reads back the probe call as the chat template writes it; none is one line (flag: what gave the
    tools)."""
    written, before = _written(tokenizer, chat_date, model, flag)
    candidates: list[CallReader] = [Tagged(), BareJson()]
    if getattr(tokenizer, "response_template", None) is not None:
        candidates.insert(0, ResponseTemplate(tokenizer, [*schemas, PROBE_SCHEMA]))
    for reader in candidates:
        if reader.parse(written, before) == Parsed([PROBE]):
            if isinstance(reader, ResponseTemplate):
                reader.schemas = schemas
            return reader
    raise UserError(f"{flag}: the chat template of {model} writes a tool call as {written.strip()[:120]!r}, which "
                    f"none of {', '.join(r.name for r in candidates)} reads back; give the tokenizer a "
                    "response_template (transformers' response parsing) in its tokenizer_config.json, or use a "
                    "template that writes <tool_call> JSON (--chat-template FILE.jinja)")


def _written(tokenizer, chat_date: str, model: str, flag: str) -> tuple[str, str]:
    """The assistant's turn calling the probe tool as the template renders it (through its end), and what precedes
    it: the conversation up to the generation prompt."""
    user = [{"role": "user", "content": "?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": PROBE.name, "arguments": PROBE.arguments}}]}
    try:
        before = render(tokenizer, user, chat_date, [PROBE_SCHEMA], add_generation_prompt=True)
        whole = render(tokenizer, [*user, call], chat_date, [PROBE_SCHEMA])
    except Exception as exc:  # the template's own raise_exception, or a jinja error
        raise UserError(f"{flag}: the chat template of {model} cannot render an assistant turn that calls a tool "
                        f"({type(exc).__name__}: {exc}); use a template that does (--chat-template FILE.jinja)"
                        ) from None
    if not whole.startswith(before):  # a template that renders the last turn otherwise: from where they part
        cut = next((i for i, (a, b) in enumerate(zip(before, whole, strict=False)) if a != b), len(before))
        return whole[cut:], before[:cut]
    return whole[len(before):], before
