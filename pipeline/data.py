"""Training data: tokenize, pack into fixed-length blocks, cache on disk, and a resumable global sampler.

Text rows are tokenized without special tokens, each followed by EOS, concatenated and cut into seq_length-token
blocks. Conversation rows (a `messages` column, DATA-HF.py) are rendered with the model's chat template, masked so
that only the trained turns count (pipeline/chat_tokens.py), and packed whole into blocks (pipeline/packing.py). A
dataset may hold both. Blocks are split into train and validation by a seeded permutation and cached as .npy files
keyed by a fingerprint of everything that defines them, so every later run and every other experiment on the same
data reuses them memory-mapped. A cache of plain text blocks (no conversations, no document mask) is ids only;
any other also holds per-token flags (what is trained, where a sequence starts).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from pipeline import chat_tokens, packing
from pipeline.conversations import BadConversation
from pipeline.errors import UserError
from pipeline.hub import TOKENIZER_FILES

CACHE_FORMAT = 2


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


def dataset_fingerprint(ds) -> str:
    """Identifies a dataset's contents without reading them: the metadata datasets writes beside its Arrow files
    (state.json, dataset_info.json: their fingerprint, split and features) and the names and sizes of those files,
    found through the public `cache_files`."""
    files = [Path(f["filename"]) for f in ds.cache_files]
    if not files:
        raise UserError("the dataset is not backed by files on disk; save it with DATA-HF.py or save_to_disk")
    digest = hashlib.sha256()
    for folder in sorted({f.parent for f in files}):
        _hash_named_files(digest, folder, ("state.json", "dataset_info.json"))
    for f in files:
        digest.update(f"{f.name}:{f.stat().st_size}\n".encode())
    return digest.hexdigest()[:32]


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

    @property
    def flagged(self) -> bool:
        """Whether blocks carry per-token flags (anything but plain text cut into blocks)."""
        return self.chats or self.document_mask

    def key(self) -> dict:
        """The fields that matter for this data (chat settings only with conversations, the document mask only when
        on, a template by its hash), so a text run's key is what it was before conversations existed."""
        key = {"seq_length": self.seq_length, "val_fraction": self.val_fraction, "seed": self.seed}
        if self.chats:
            key.update(train_on=self.train_on, chat_date=self.chat_date,
                       chat_template=hashlib.sha256(self.chat_template.encode()).hexdigest()[:16]
                       if self.chat_template else "")
        if self.document_mask:
            key["document_mask"] = True
        return key


def token_cache_dir(save_dir: Path, dataset_fp: str, model_dir: Path, spec: BlockSpec) -> Path:
    """Where the packed blocks of this dataset, tokenizer and cut live: shared by every run under save_dir."""
    key = {"format": CACHE_FORMAT, "dataset": dataset_fp, "tokenizer": tokenizer_fingerprint(model_dir),
           **spec.key()}
    fp = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(save_dir) / "token_cache" / fp[:24]


@dataclass
class Blocks:
    train: np.ndarray
    """(n_train, seq_length) token ids, memory-mapped."""
    val: np.ndarray
    """(n_val, seq_length) token ids, memory-mapped."""
    path: Path
    """The cache directory they were read from."""
    train_flags: np.ndarray | None = None
    """(n_train, seq_length) packing.TRAIN | packing.START per token; None for plain text blocks."""
    val_flags: np.ndarray | None = None


def _tokenize(batch: dict, tokenizer, eos_id: int) -> dict:
    """A batch of rows -> one row: their ids, each followed by EOS, as one uint32 array. Arrow takes a numpy array
    in one copy, where a list of Python int lists is converted element by element (a quarter of the whole
    tokenize+pack time on the bench)."""
    ids = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
    flat = np.fromiter(chain.from_iterable(row + [eos_id] for row in ids), dtype=np.uint32)
    return {"input_ids": [flat]}


def _tokenize_chats(batch: dict, tokenizer, spec: BlockSpec) -> dict:
    """Each conversation -> its ids, trained mask (uint8) and status (an index into chat_tokens.STATUS), fitted
    into one block."""
    out: dict[str, list] = {"input_ids": [], "trained": [], "status": []}
    for messages in batch["messages"]:
        try:
            rendered = chat_tokens.tokenize_conversation(tokenizer, messages, spec.chat_date, spec.train_on)
            fitted, status = chat_tokens.fit(rendered, spec.seq_length)
        except BadConversation:
            fitted, status = None, "malformed"
        except chat_tokens.TemplateMismatch:
            fitted, status = None, "template_mismatch"
        out["input_ids"].append(fitted.ids if fitted else np.zeros(0, np.uint32))
        out["trained"].append(fitted.trained.astype(np.uint8) if fitted else np.zeros(0, np.uint8))
        out["status"].append(chat_tokens.STATUS.index(status))
    return out


def split_blocks(n_blocks: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, val) block indices from a seeded permutation; one val block at least when n >= 2."""
    n_val = round(n_blocks * val_fraction)
    if val_fraction > 0 and n_blocks >= 2:
        n_val = max(1, n_val)
    perm = np.random.default_rng(seed).permutation(n_blocks)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def _map_kwargs(tmp: Path, name: str, num_proc: int, rows: int) -> dict:
    """datasets.map arguments: workers only when each gets a batch or more of rows."""
    return {"batched": True, "batch_size": 1000, "num_proc": num_proc if num_proc > 1 and rows > 1000 else None,
            "cache_file_name": str(tmp / f"{name}.arrow")}


def _text_blocks(ds, tokenizer, spec: BlockSpec, num_proc: int, tmp: Path) -> tuple[np.ndarray, int]:
    """Text rows tokenized, concatenated and cut into full blocks (the tail shorter than a block is dropped)."""
    if len(ds) == 0:
        return np.zeros((0, spec.seq_length), np.uint32), 0
    tokenized = ds.map(_tokenize, remove_columns=ds.column_names, desc="tokenizing text",
                       fn_kwargs={"tokenizer": tokenizer, "eos_id": tokenizer.eos_token_id},
                       **_map_kwargs(tmp, "text", num_proc, len(ds)))
    column = tokenized.data.column("input_ids")
    flat = np.concatenate([chunk.flatten().to_numpy() for chunk in column.chunks]).astype(np.uint32)
    n_blocks = len(flat) // spec.seq_length
    return flat[: n_blocks * spec.seq_length].reshape(n_blocks, spec.seq_length), len(flat)


def _chat_blocks(ds, tokenizer, spec: BlockSpec, num_proc: int, tmp: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """Conversation rows rendered, masked and packed whole into blocks; what happened to them, by status."""
    tokenized = ds.map(_tokenize_chats, remove_columns=ds.column_names, desc="tokenizing conversations",
                       fn_kwargs={"tokenizer": tokenizer, "spec": spec}, **_map_kwargs(tmp, "chats", num_proc, len(ds)))
    codes = np.asarray(tokenized.data.column("status").to_numpy())
    status = Counter(chat_tokens.STATUS[c] for c in codes.tolist())
    kept = codes <= chat_tokens.STATUS.index("truncated")
    ids = [x for x, k in zip(_ragged(tokenized, "input_ids", np.uint32), kept, strict=True) if k]
    trained = [x.astype(bool) for x, k in zip(_ragged(tokenized, "trained", np.uint8), kept, strict=True) if k]
    blocks, flags = packing.pack(ids, trained, spec.seq_length, tokenizer.eos_token_id)
    return blocks, flags, {s: status.get(s, 0) for s in chat_tokens.STATUS}


def _ragged(ds, name: str, dtype) -> list[np.ndarray]:
    """A list column as one array per row (views of one flat copy, no per-row Python conversion)."""
    column = ds.data.column(name).combine_chunks()
    offsets = np.asarray(column.offsets.to_numpy())
    flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    return np.split(flat, offsets[1:-1] - offsets[0]) if len(column) else []


def build_blocks(ds, tokenizer, spec: BlockSpec, num_proc: int, out: Path) -> None:
    """Tokenize, pack and split into out/ (written to a temporary sibling, then renamed)."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        chats = conversation_rows(ds)
        # a hub dataset may have messages and no text column: its rows without a conversation have nothing to train
        text_rows = ds.select(np.flatnonzero(~chats) if "text" in ds.column_names else [])
        blocks, n_tokens = _text_blocks(text_rows, tokenizer, spec, num_proc, tmp)
        meta: dict = {"text_tokens": int(n_tokens), "text_blocks": len(blocks)}
        if spec.flagged:
            flags = packing.text_flags(blocks, tokenizer.eos_token_id, spec.document_mask)
        if chats.any():
            chat_ids, chat_flags, meta["conversations"] = _chat_blocks(ds.select(np.flatnonzero(chats)), tokenizer,
                                                                       spec, num_proc, tmp)
            meta["chat_blocks"] = len(chat_ids)
            blocks, flags = np.concatenate([blocks, chat_ids]), np.concatenate([flags, chat_flags])
        train_idx, val_idx = split_blocks(len(blocks), spec.val_fraction, spec.seed)
        np.save(tmp / "train.npy", blocks[train_idx])
        np.save(tmp / "val.npy", blocks[val_idx])
        if spec.flagged:
            np.save(tmp / "train_flags.npy", flags[train_idx])
            np.save(tmp / "val_flags.npy", flags[val_idx])
            meta["targets"] = int(packing.targets(flags).sum())
        meta.update({"blocks": len(blocks), "train_blocks": len(train_idx), "val_blocks": len(val_idx),
                     "seq_length": spec.seq_length, "rows": len(ds), "flags": spec.flagged})
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        for leftover in tmp.glob("*.arrow"):
            leftover.unlink()
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "meta.json").exists():  # another node built it at the same time: theirs is identical
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_blocks(path: Path) -> Blocks:
    def load(name: str) -> np.ndarray | None:
        return np.load(path / name, mmap_mode="r") if (path / name).exists() else None

    return Blocks(load("train.npy"), load("val.npy"), path, load("train_flags.npy"), load("val_flags.npy"))


class BlockSampler:
    """One global permutation of the training blocks per epoch, from (seed, epoch).

    Each optimizer step consumes a global batch of world x batch x grad_accum blocks, taken in permutation order
    and dealt to (micro-step, rank) slots. The state is (epoch, blocks consumed), independent of the world
    size, so a resume continues at the same global position with any number of processes. A last global batch
    that would be incomplete is dropped.
    """

    def __init__(self, n_blocks: int, seed: int, world_size: int, rank: int, batch_size: int, grad_accum: int):
        self.n_blocks, self.seed = n_blocks, seed
        self.world_size, self.rank = world_size, rank
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.epoch = 0
        self.consumed = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return self.n_blocks // self.global_batch

    def has_next(self) -> bool:
        return self.consumed + self.global_batch <= self.n_blocks

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)
            self._perm_epoch = epoch
        return self._perm

    def upcoming(self) -> np.ndarray:
        """Every rank's block indices of the next optimizer step (the same on every rank)."""
        return self.permutation(self.epoch)[self.consumed: self.consumed + self.global_batch]

    def next_step(self) -> list[np.ndarray]:
        """This rank's block indices for each micro-step of the next optimizer step."""
        if not self.has_next():
            raise StopIteration
        perm = self.permutation(self.epoch)
        micro = []
        for m in range(self.grad_accum):
            start = self.consumed + (m * self.world_size + self.rank) * self.batch_size
            micro.append(perm[start: start + self.batch_size])
        self.consumed += self.global_batch
        return micro

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "n_blocks": self.n_blocks, "seed": self.seed,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state["n_blocks"] != self.n_blocks or state["seed"] != self.seed:
            raise UserError(f"the data changed since the checkpoint: {state['n_blocks']} training blocks with seed "
                            f"{state['seed']} then, {self.n_blocks} with seed {self.seed} now")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
