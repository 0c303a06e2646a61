"""One file of the corpus to dataset rows: text (cut at paragraph boundaries when long), conversations, preference
records or prompts, with what was skipped inside it and why. A file that yields nothing usable raises SkipFile;
nothing here stops DATA-HF.

A worker's memory is bounded whatever the file: a file is sniffed (its first bytes) before it is read, so a binary
or sparse file is skipped unread; .txt/.md and UTF-8 .jsonl files larger than WHOLE_BYTES are streamed (text in
blocks, JSON lines one at a time), and only .json/.yaml documents (and .jsonl in UTF-16/32), which must be parsed
whole, are read whole, up to Limits.max_file_bytes. A row longer than Limits.max_row_chars is skipped by reason.
"""

from __future__ import annotations

import codecs
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import BinaryIO

import yaml

from pipeline.prep import conversations, preferences, prompts
from pipeline.yaml_bounds import PARSER, YamlBoundsError, check_bounds

TEXT_TYPES = (".txt", ".md")
SUPPORTED = (*TEXT_TYPES, ".json", ".jsonl", ".yaml", ".yml", ".parquet")
ROW_CHARS = 1_000_000
"""Plain-text files larger than this are cut into rows of about this many characters at paragraph boundaries."""
SNIFF_BYTES = 8192
"""The first bytes of a file, read before anything else: its encoding (a BOM, UTF-16 without one) or binary."""
WHOLE_BYTES = 64 * 2**20
"""Text and UTF-8 .jsonl files up to this size are read in one piece; larger ones are streamed."""
BLOCK_BYTES = 8 * 2**20
"""What a streamed file is read in."""
INT_DIGITS = 4000
"""A JSON or YAML integer with more digits is kept as a Decimal: Python refuses to convert one of more than 4300
(its defence against quadratic conversion), which would skip the whole file as invalid."""


@dataclass(frozen=True)
class Limits:
    """What one file or row may cost a worker (DATA-HF's --max_file_mb and --max_row_mb)."""

    max_file_bytes: int = 256 * 2**20
    """A document parsed whole (.json, .yaml, a UTF-16/32 .jsonl) larger than this is skipped as too_large."""
    max_row_chars: int = 64 * 2**20
    """A row (a JSON line, a record's text, a conversation) longer than this is skipped as row_too_large."""


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


_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
"""UTF-32's little-endian BOM starts with UTF-16's: checked first."""


def sniff(head: bytes) -> str:
    """The encoding of a file from its first bytes: a BOM's, UTF-16 without one (ASCII text with a zero byte beside
    every character), else UTF-8; SkipFile("binary") for other zero bytes."""
    for bom, encoding in _BOMS:
        if head.startswith(bom):
            return encoding
    if b"\x00" not in head:
        return "utf-8"
    even, odd = head[0::2], head[1::2]
    if len(head) >= 4 and not odd.strip(b"\x00") and b"\x00" not in even:
        return "utf-16-le"
    if len(head) >= 4 and not even.strip(b"\x00") and b"\x00" not in odd:
        return "utf-16-be"
    raise SkipFile("binary")


def decode(data: bytes, encoding: str = "") -> str:
    """Text in the sniffed encoding, or SkipFile with the reason: empty, binary or undecodable."""
    if not data.strip():
        raise SkipFile("empty")
    try:
        text = data.decode(encoding or sniff(data[:SNIFF_BYTES]))
    except UnicodeDecodeError:
        raise SkipFile("undecodable") from None
    if not text.strip():
        raise SkipFile("empty")
    return text


def _split(text: str, limit: int) -> list[str]:
    """Text in pieces of at most about limit characters at blank lines where possible; blank pieces kept, so the
    last piece is a suffix of text (what a stream carries into its next block)."""
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
    rows.append("\n\n".join(current))
    return rows


def split_paragraphs(text: str, limit: int = ROW_CHARS) -> list[str]:
    """Cut text into pieces of at most about limit characters, at blank lines where possible."""
    return [r for r in _split(text, limit) if r.strip()]


def _parse_int(digits: str) -> int | Decimal:
    return int(digits) if len(digits.lstrip("+-")) <= INT_DIGITS else Decimal(digits)


def load_json(text: str):
    """json.loads with integers of any length (a long one as a Decimal, which no text extraction reads)."""
    return json.loads(text, parse_int=_parse_int)


class _DataLoader(PARSER):
    """The safe loader, with integers of any length (a long one kept as a Decimal)."""

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            return Decimal(self.construct_scalar(node).replace("_", ""))


_DataLoader.add_constructor("tag:yaml.org,2002:int", _DataLoader.construct_yaml_int)


def _parse(loader, text: str, reason: str):
    try:
        return loader(text)
    except RecursionError:
        raise SkipFile("too_deeply_nested") from None
    except (ValueError, ArithmeticError, yaml.YAMLError):
        raise SkipFile(reason) from None


Row = str | conversations.Chat | preferences.Pair | prompts.Prompt
"""One dataset row: text, a conversation (pipeline/prep/conversations.py), a preference pair
(pipeline/prep/preferences.py), or a prompt for online RL (pipeline/prep/prompts.py)."""


def row_chars(row: Row) -> int:
    if isinstance(row, str):
        return len(row)
    return row.chars


@dataclass
class Extracted:
    """What one file gives: its rows in order (to sink as they come, or kept in rows), unparsable .jsonl line
    numbers, records skipped by reason (where: "line N" or "item N"), how many conversations came in each format,
    and the keys of the lists of records found wrapped in an object."""

    limits: Limits = field(default_factory=Limits)
    sink: Callable[[Row], None] | None = None
    rows: list[Row] = field(default_factory=list)
    count: int = 0
    chars: int = 0
    bad_lines: list[int] = field(default_factory=list)
    bad_chats: list[tuple[str, str]] = field(default_factory=list)
    """Conversations skipped: (reason, where)."""
    bad_pairs: list[tuple[str, str]] = field(default_factory=list)
    """Preference records skipped: (reason, where)."""
    pair_forms: Counter = field(default_factory=Counter)
    """Preference pairs kept, by input form."""
    bad_prompts: list[tuple[str, str]] = field(default_factory=list)
    """Prompt records skipped: (reason, where)."""
    prompt_forms: Counter = field(default_factory=Counter)
    """Prompts kept, by form."""
    bad_rows: list[tuple[str, str]] = field(default_factory=list)
    """Other rows skipped: (reason, where), e.g. row_too_large."""
    formats: Counter = field(default_factory=Counter)
    wrapped: list[str] = field(default_factory=list)

    @property
    def bad_records(self) -> bool:
        """Whether records of a kind we know were skipped: a file holding only those is skipped by their kind
        (nothing_kept), not as one without text."""
        return bool(self.bad_chats or self.bad_pairs or self.bad_prompts)

    @property
    def nothing_kept(self) -> str:
        """Why a file that gave no row is skipped: the kind of its records that were, else no_valid_row."""
        kinds = (("no_valid_pair", self.bad_pairs), ("no_valid_prompt", self.bad_prompts),
                 ("no_valid_conversation", self.bad_chats))
        return next((why for why, bad in kinds if bad), "no_valid_row")

    def row(self, row: Row, where: str) -> bool:
        """Keep a row, unless it is longer than the limit; whether it was kept."""
        n = row_chars(row)
        if n > self.limits.max_row_chars:
            self.bad_rows.append(("row_too_large", where))
            return False
        self.count += 1
        self.chars += n
        if self.sink is None:
            self.rows.append(row)
        else:
            self.sink(row)
        return True

    def add(self, record: object, where: str) -> None:
        """A parsed JSON value: a record of a kind we know (kept, or counted as skipped), a list of records wrapped
        in an object (each read as a record), or text. A preference record is looked for first: its prompt and
        completion keys would otherwise read as a conversation; then a prompt (prompts.detect leaves conversations
        out)."""
        if form := preferences.detect(record):
            self._known(lambda: preferences.to_pair(record, form), form, self.pair_forms, self.bad_pairs, where)
            return
        if form := prompts.detect(record):
            self._known(lambda: prompts.to_prompt(record, form), form, self.prompt_forms, self.bad_prompts, where)
            return
        fmt = conversations.detect(record)
        if fmt == "row":  # one of our own rows read back (a dataset's to_json): as it was
            if record["messages"]:
                fmt = "messages"
            else:
                if isinstance(record["text"], str) and record["text"].strip():
                    self.row(record["text"], where)
                return
        if fmt is None:
            if lists := wrapped_records(record):
                for key, items in lists:
                    self.wrapped.append(key)
                    for i, item in enumerate(items, 1):
                        self.add(item, f"{where} {key}[{i}]")
                return
            row = "\n".join(strings_in(record))
            if row:
                self.row(row, where)
            return
        self._known(lambda: conversations.to_chat(record, fmt), fmt, self.formats, self.bad_chats, where)

    def _known(self, make: Callable[[], Row], form: str, kept: Counter, bad: list, where: str) -> None:
        """A record of a kind we know: its row kept (counted under form in kept), or skipped by reason (in bad)."""
        try:
            row = make()
        except (preferences.BadPair, prompts.BadPrompt, conversations.BadConversation) as exc:
            bad.append((str(exc), where))
        except RecursionError:  # JSON nested past Python's stack inside a field: this record alone is skipped
            bad.append(("too_deeply_nested", where))
        else:
            if self.row(row, where):
                kept[form] += 1


def is_record(value: object) -> bool:
    """Whether a JSON value is a record of a kind read as such (a preference pair, a prompt, a conversation, a row of
    ours)."""
    return bool(preferences.detect(value) or prompts.detect(value) or conversations.detect(value))


def wrapped_records(value: object) -> list[tuple[str, list]]:
    """The lists of records an object wraps ({"version": "1.0", "data": [{...}, ...]}): every list of objects among
    its values, and among those of the objects it holds, by path ("data", "splits.train"); [] for anything else. The
    wrapper's other values are metadata, not text."""
    if not isinstance(value, dict):
        return []
    found: list[tuple[str, list]] = []
    stack: list[tuple[str, dict]] = [("", value)]
    while stack:
        prefix, obj = stack.pop()
        for key, item in obj.items():
            path = f"{prefix}{key}"
            if isinstance(item, list) and item and all(isinstance(x, dict) for x in item):
                found.append((path, item))
            elif isinstance(item, dict) and not is_record(item):
                stack.append((f"{path}.", item))
    return sorted(found, key=lambda f: f[0])


def _json_rows(text: str, out: Extracted) -> None:
    doc = _parse(load_json, text, "invalid_json")
    for i, part in enumerate(doc if isinstance(doc, list) else [doc], 1):
        out.add(part, f"item {i}")


def _yaml_rows(text: str, out: Extracted) -> None:
    """One row per document, as text; a document that is a record, a list of records or an object wrapping them is
    read as records (a conversation in YAML is a conversation)."""
    try:  # before the loader: a deep list kills it with SIGSEGV, an alias bomb fills memory (yaml_bounds)
        check_bounds(text)
    except YamlBoundsError as exc:
        raise SkipFile(exc.reason) from None
    except yaml.YAMLError:
        raise SkipFile("invalid_yaml") from None
    docs = _parse(lambda t: list(yaml.load_all(t, Loader=_DataLoader)), text, "invalid_yaml")
    for i, doc in enumerate(docs, 1):
        if isinstance(doc, list) and any(is_record(x) for x in doc):
            for j, part in enumerate(doc, 1):
                out.add(part, f"document {i} item {j}")
        elif is_record(doc) or wrapped_records(doc):
            out.add(doc, f"document {i}")
        elif row := "\n".join(strings_in(doc)):
            out.row(row, f"document {i}")


def _json_line(line: bytes | str | None, lineno: int, out: Extracted) -> bool:
    """Read one line into out; whether it held anything (a blank line does not)."""
    if line is None:
        out.bad_rows.append(("row_too_large", f"line {lineno}"))
        return True
    if not line.strip():
        return False
    try:
        record = load_json(line)
    except (ValueError, RecursionError, ArithmeticError):  # a bad byte is a UnicodeDecodeError, a ValueError
        out.bad_lines.append(lineno)
        return True
    out.add(record, f"line {lineno}")
    return True


def _byte_lines(fh: BinaryIO, max_bytes: int) -> Iterator[bytes | None]:
    """Each line of a file split on b"\\n" alone (so U+2028 or U+0085 inside a JSON string never splits a record;
    a trailing \\r is JSON whitespace), read in blocks: None for a line longer than max_bytes, dropped unread."""
    parts: list[bytes] = []
    size, oversized = 0, False
    for block in iter(lambda: fh.read(BLOCK_BYTES), b""):
        pieces = block.split(b"\n")
        for piece in pieces[:-1]:
            yield None if oversized or size + len(piece) > max_bytes else b"".join([*parts, piece])
            parts, size, oversized = [], 0, False
        tail = pieces[-1]
        if not oversized and size + len(tail) > max_bytes:
            parts, oversized = [], True
        elif not oversized:
            parts.append(tail)
            size += len(tail)
    if oversized or size:
        yield None if oversized else b"".join(parts)


def _jsonl_rows(path: Path, encoding: str, out: Extracted) -> None:
    """Every line of a .jsonl file: UTF-8 streamed line by line (a bad byte loses its line only), another encoding
    decoded whole first."""
    held = False
    if encoding in ("utf-8", "utf-8-sig"):
        with open(path, "rb") as fh:
            if encoding == "utf-8-sig":
                fh.read(len(codecs.BOM_UTF8))
            for lineno, line in enumerate(_byte_lines(fh, out.limits.max_row_chars), 1):
                held |= _json_line(line, lineno, out)
    else:
        text = decode(_read_whole(path, out.limits), encoding)
        for lineno, line in enumerate(text.split("\n"), 1):
            held |= _json_line(line if len(line) <= out.limits.max_row_chars else None, lineno, out)
    if not held:
        raise SkipFile("empty")
    if out.bad_lines and not out.count and not out.bad_records and not out.bad_rows:
        raise SkipFile("invalid_jsonl")


def _read_whole(path: Path, limits: Limits) -> bytes:
    if path.stat().st_size > limits.max_file_bytes:
        raise SkipFile("too_large")
    return path.read_bytes()


def _text_blocks(path: Path, encoding: str) -> Iterator[str]:
    """A text file decoded block by block; SkipFile("undecodable") at the first bad byte."""
    decoder = codecs.getincrementaldecoder(encoding)()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(BLOCK_BYTES), b""):
                yield decoder.decode(block)
            yield decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise SkipFile("undecodable") from None


def _streamed_text(path: Path, encoding: str, out: Extracted) -> None:
    """A large text file's rows, with memory for a few blocks: a first pass checks every byte decodes and some text
    is there (so a file with a bad byte near its end is skipped whole, as a small one is), the second cuts rows."""
    if not any(block.strip() for block in _text_blocks(path, encoding)):
        raise SkipFile("empty")
    carry = ""
    for block in _text_blocks(path, encoding):
        pieces = _split(carry + block, ROW_CHARS)
        carry = pieces.pop()
        for piece in pieces:
            if piece.strip():
                out.row(piece, "text")
    for piece in split_paragraphs(carry):
        out.row(piece, "text")


def _parquet_rows(path: Path, out: Extracted) -> None:
    """Each row of a Parquet file (a dataset's to_parquet, or any table) as a JSON record, a batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        row = 0
        for batch in table.iter_batches(batch_size=1000):
            for record in batch.to_pylist():
                row += 1
                out.add(record, f"row {row}")
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None:  # the disk's, not the format's
            raise
        if not out.count:
            raise SkipFile("invalid_parquet") from None
        out.bad_rows.append(("invalid_parquet", f"rows after {row}"))  # those before are kept


def extract_file(path: Path, limits: Limits | None = None, sink: Callable[[Row], None] | None = None) -> Extracted:
    """Rows (text or conversations) of one file, each to sink (else kept in .rows), with what was skipped inside it;
    SkipFile when nothing in it is usable text or a conversation (a file of only malformed conversations returns no
    rows and their reasons)."""
    out = Extracted(limits or Limits(), sink)
    if path.suffix.lower() == ".parquet":
        _parquet_rows(path, out)
    else:
        _sniffed_rows(path, out)
    if not out.count and not out.bad_records and not out.bad_rows:
        raise SkipFile("no_text")
    return out


def _sniffed_rows(path: Path, out: Extracted) -> None:
    """A text, JSON or YAML file's rows, its encoding (or that it is binary) told by its first bytes."""
    with open(path, "rb") as fh:
        head = fh.read(SNIFF_BYTES)
    if not head:
        raise SkipFile("empty")
    encoding = sniff(head)
    ext = path.suffix.lower()
    if ext == ".jsonl":
        _jsonl_rows(path, encoding, out)
    elif ext in TEXT_TYPES and path.stat().st_size > WHOLE_BYTES:
        _streamed_text(path, encoding, out)
    elif ext in TEXT_TYPES:
        for piece in split_paragraphs(decode(path.read_bytes(), encoding)):
            out.row(piece, "text")
    elif ext == ".json":
        _json_rows(decode(_read_whole(path, out.limits), encoding), out)
    else:
        _yaml_rows(decode(_read_whole(path, out.limits), encoding), out)
