"""Training data: the dataset, what identifies it (and its tokenizer), and what defines its blocks.

The blocks themselves (tokenized, packed, split, cached on disk) are pipeline/data/token_cache.py's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.content_hash import HashRecord
from pipeline.errors import UserError
from pipeline.prep.hub import TOKENIZER_FILES


def load_text_dataset(name: str):
    """A DATA-HF dataset directory, or a hub dataset id from the local datasets cache (offline)."""
    import datasets

    path = Path(name)
    if path.exists():
        try:
            ds = datasets.load_from_disk(str(path))
        except IndexError:  # datasets saves a dataset of no rows as zero shards, then fails to index them
            raise UserError(f"--dataset-name {name} is empty") from None
        except (FileNotFoundError, ValueError) as exc:
            raise UserError(f"--dataset-name {name} is not a dataset saved by DATA-HF.py ({exc})") from None
        except OSError as exc:  # pyarrow's reader on a truncated or damaged Arrow file (no errno; a disk's has one)
            if exc.errno is not None:
                raise
            raise UserError(f"--dataset-name {name} cannot be read, its files are damaged ({exc}); build it again "
                            "with DATA-HF.py") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise UserError(f"--dataset-name {name} has no 'train' split (splits: {', '.join(ds)})")
            ds = ds["train"]
    elif "/" in name and not name.startswith((".", "/")):
        try:
            ds = datasets.load_dataset(name, split="train")
        except Exception as exc:  # datasets raises many types for "not cached offline"; all mean the same here
            raise UserError(f"--dataset-name {name} is neither a local path nor a hub dataset in the offline "
                            f"cache ({type(exc).__name__}); convert local files with DATA-HF.py") from None
    else:
        raise UserError(f"--dataset-name {name} does not exist")
    if "text" not in ds.column_names and "messages" not in ds.column_names:
        raise UserError(f"--dataset-name {name} has neither a 'text' nor a 'messages' column (columns: "
                        f"{', '.join(ds.column_names)}); convert it with DATA-HF.py")
    if len(ds) == 0:
        raise UserError(f"--dataset-name {name} is empty")
    return ds


def conversation_rows(ds) -> np.ndarray:
    """Whether each row is a conversation (a non-empty `messages` list), from the Arrow list lengths alone."""
    if "messages" not in ds.column_names:
        return np.zeros(len(ds), dtype=bool)
    column = ds.data.column("messages")
    lengths = pc.fill_null(pc.list_value_length(column), 0)
    return np.asarray(lengths.to_numpy(zero_copy_only=False)) > 0


def preference_rows(ds) -> tuple[int, int]:
    """(pairs, unpaired): how many rows hold a preference pair (a non-empty `chosen` and `rejected`: DATA-HF's lists of
    messages, or a hub dataset's strings) and how many one answer alone (KTO's unpaired records: chosen when
    desirable, rejected when not), from the Arrow columns alone."""
    if "chosen" not in ds.column_names or "rejected" not in ds.column_names:
        return 0, 0
    chosen, rejected = (np.asarray(_answer_sizes(ds.data.column(name)).to_numpy(zero_copy_only=False)) > 0
                        for name in ("chosen", "rejected"))
    return int((chosen & rejected).sum()), int((chosen ^ rejected).sum())


def prompt_rows(ds) -> int:
    """How many rows are prompts for online RL (a non-empty `columns`: DATA-HF's JSON object of a prompt record's other
    keys, "" in every other row), from the Arrow column alone; 0 for a dataset without that column of strings (one
    written before it existed, or a hub dataset), which holds no prompts."""
    if "columns" not in ds.column_names:
        return 0
    column = ds.data.column("columns")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return 0
    return int(pc.sum(pc.greater(pc.fill_null(pc.utf8_length(column), 0), 0)).as_py() or 0)


def _answer_sizes(column):
    sizes = pc.list_value_length(column) if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) \
        else pc.utf8_length(pc.cast(column, pa.string()))
    return pc.fill_null(sizes, 0)


DATA_RECORD = ".content-hashes.json"
"""The SHA-256 of each Arrow file of a folder, kept beside them (content_hash.HashRecord)."""


def _fingerprint(ds, file_part: Callable[[Path], str]) -> str:
    """The metadata datasets writes beside its Arrow files (state.json, dataset_info.json: their fingerprint, split
    and features), found through the public `cache_files`, and file_part of each Arrow file."""
    files = [Path(f["filename"]) for f in ds.cache_files]
    if not files:
        raise UserError("the dataset is not backed by files on disk; save it with DATA-HF.py or save_to_disk")
    digest = hashlib.sha256()
    for folder in sorted({f.parent for f in files}):
        _hash_named_files(digest, folder, ("state.json", "dataset_info.json"))
    for f in files:
        digest.update(f"{f.name}:{file_part(f)}\n".encode())
    return digest.hexdigest()[:32]


def dataset_fingerprint(ds) -> str:
    """Identifies a dataset's contents: its metadata and each Arrow file's SHA-256. A file is read once: the record
    beside it vouches for it while its size and time are unchanged (a read-only folder is read at every start)."""
    records: dict[Path, HashRecord] = {}

    def content(f: Path) -> str:
        record = records.setdefault(f.parent, HashRecord(f.parent / DATA_RECORD))
        return record.digest(f.name, f)

    fingerprint = _fingerprint(ds, content)
    for record in records.values():
        record.save()
    return fingerprint


def size_fingerprint(ds) -> str:
    """The dataset fingerprint of runs from before content hashing (names and sizes of the files, not their bytes):
    the resume guard still accepts it, so those runs resume (and are guarded by content from then on)."""
    return _fingerprint(ds, lambda f: str(f.stat().st_size))


def tokenizer_fingerprint(model_dir: Path) -> str:
    digest = hashlib.sha256()
    _hash_named_files(digest, model_dir, TOKENIZER_FILES)
    return digest.hexdigest()


def _hash_named_files(digest, folder: Path, names: tuple[str, ...]) -> None:
    """Feed the name and bytes of each of these files that exists in folder (small metadata files) to digest."""
    for name in names:
        if (folder / name).exists():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())


@dataclass(frozen=True)
class BlockSpec:
    """Everything besides the dataset and tokenizer that decides the blocks (and so the token cache's key)."""

    seq_length: int
    val_fraction: float
    seed: int
    chats: bool = False
    """The dataset holds conversations."""
    train_on: str = "assistant"
    chat_date: str = ""
    chat_template: str = ""
    """The template text used instead of the model's own ("" for the model's)."""
    document_mask: bool = False
    special_tokens_in_data: bool = False
    """A special token's text inside a text row or a message becomes that token (the tokenizer's default); off, it
    stays text, so data cannot end a document or forge a chat turn."""
    pairs: bool = False
    """The dataset holds preference pairs: blocks of packed pairs (pipeline/data/pair_tokens.py)."""
    kto: bool = False
    """With pairs: the rows are KTO examples, each packed as its completion and its KL sequence."""
    train_reasoning: bool = True
    """A trained assistant turn's reasoning trace is a target (off: context)."""

    @property
    def flagged(self) -> bool:
        """Whether blocks carry per-token flags (anything but plain text cut into blocks)."""
        return self.chats or self.document_mask or self.pairs

    def key(self) -> dict:
        """The fields that matter for this data (chat settings only with conversations, the document mask only when
        on, a template by its hash), so a text run's key is what it was before conversations existed."""
        key = {"seq_length": self.seq_length, "val_fraction": self.val_fraction, "seed": self.seed}
        if self.pairs:
            key["pairs"] = True
        if self.kto:
            key["kto"] = True
        if self.chats or self.pairs:
            key.update(train_on=self.train_on, chat_date=self.chat_date,
                       chat_template=hashlib.sha256(self.chat_template.encode()).hexdigest()[:16]
                       if self.chat_template else "")
        if self.chats and not self.train_reasoning:
            key["train_reasoning"] = False
        if self.document_mask:
            key["document_mask"] = True
        if self.special_tokens_in_data:
            key["special_tokens_in_data"] = True
        return key
