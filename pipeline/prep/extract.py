"""One file of the corpus to dataset rows: text (cut at paragraph boundaries when long) or conversations, with what
was skipped inside it and why. A file that yields nothing usable raises SkipFile; nothing here stops DATA-HF."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.prep import conversations
from pipeline.yaml_bounds import PARSER, YamlBoundsError, check_bounds

TEXT_TYPES = (".txt", ".md")
SUPPORTED = (*TEXT_TYPES, ".json", ".jsonl", ".yaml", ".yml")
ROW_CHARS = 1_000_000
"""Plain-text files larger than this are cut into rows of about this many characters at paragraph boundaries."""
_YAML_LOADER = PARSER  # SafeLoader family only: no tag can run code


class SkipFile(Exception):
    """The whole file is unusable; the message is the reason reported."""


def strings_in(obj: object) -> list[str]:
    """All non-blank string values in document order, iteratively so that depth cannot overflow the stack."""
    out: list[str] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item.strip():
                out.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return out


def decode(data: bytes) -> str:
    """UTF-8 text (BOM or not), or SkipFile with the reason: empty, binary or undecodable."""
    if not data.strip():
        raise SkipFile("empty")
    if b"\x00" in data[:8192]:
        raise SkipFile("binary")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise SkipFile("undecodable") from None
    if not text.strip():
        raise SkipFile("empty")
    return text


def split_paragraphs(text: str, limit: int = ROW_CHARS) -> list[str]:
    """Cut text into pieces of at most about limit characters, at blank lines where possible."""
    if len(text) <= limit:
        return [text]
    rows: list[str] = []
    current: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        while len(para) > limit:  # one paragraph bigger than a row: cut at a line break, else hard
            cut = para.rfind("\n", 0, limit)
            cut = cut if cut > 0 else limit
            rows.append(para[:cut])
            para = para[cut:].lstrip("\n")
        if current and size + len(para) + 2 > limit:
            rows.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        rows.append("\n\n".join(current))
    return [r for r in rows if r.strip()]


def _parse(loader, text: str, reason: str):
    try:
        return loader(text)
    except RecursionError:
        raise SkipFile("too_deeply_nested") from None
    except (ValueError, yaml.YAMLError):
        raise SkipFile(reason) from None


Row = str | list[dict]
"""One dataset row: text, or a conversation's messages (pipeline/prep/conversations.py)."""


@dataclass
class Extracted:
    """What one file gives: its rows in order, unparsable .jsonl line numbers, skipped conversations by reason
    (where: "line N" or "item N"), and how many conversations came in each format."""

    rows: list[Row] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    bad_chats: list[tuple[str, str]] = field(default_factory=list)
    formats: Counter = field(default_factory=Counter)

    def add(self, record: object, where: str) -> None:
        """A parsed JSON value: a conversation (kept, or counted as skipped) or text."""
        fmt = conversations.detect(record)
        if fmt is None:
            row = "\n".join(strings_in(record))
            if row:
                self.rows.append(row)
            return
        try:
            self.rows.append(conversations.to_messages(record, fmt))
        except conversations.BadConversation as exc:
            self.bad_chats.append((str(exc), where))
        else:
            self.formats[fmt] += 1


def _json_rows(text: str) -> Extracted:
    doc = _parse(json.loads, text, "invalid_json")
    out = Extracted()
    for i, part in enumerate(doc if isinstance(doc, list) else [doc], 1):
        out.add(part, f"item {i}")
    return out


def _yaml_rows(text: str) -> Extracted:
    try:  # before the loader: a deep list kills it with SIGSEGV, an alias bomb fills memory (yaml_bounds)
        check_bounds(text)
    except YamlBoundsError as exc:
        raise SkipFile(exc.reason) from None
    except yaml.YAMLError:
        raise SkipFile("invalid_yaml") from None
    docs = _parse(lambda t: list(yaml.load_all(t, Loader=_YAML_LOADER)), text, "invalid_yaml")
    return Extracted(rows=[row for row in ("\n".join(strings_in(d)) for d in docs) if row])


def _jsonl_rows(text: str) -> Extracted:
    out = Extracted()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            out.bad_lines.append(lineno)
            continue
        out.add(record, f"line {lineno}")
    if out.bad_lines and not out.rows and not out.bad_chats:
        raise SkipFile("invalid_jsonl")
    return out


def extract_file(path: Path) -> Extracted:
    """Rows (text or conversations) of one file, with what was skipped inside it; SkipFile when nothing in it is
    usable text or a conversation (a file of only malformed conversations returns no rows and their reasons)."""
    text = decode(path.read_bytes())
    ext = path.suffix.lower()
    if ext in TEXT_TYPES:
        out = Extracted(rows=split_paragraphs(text))
    elif ext == ".json":
        out = _json_rows(text)
    elif ext == ".jsonl":
        out = _jsonl_rows(text)
    else:
        out = _yaml_rows(text)
    if not out.rows and not out.bad_chats:
        raise SkipFile("no_text")
    return out
