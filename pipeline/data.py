"""Training data: tokenize, pack into fixed-length blocks, cache on disk, and a resumable global sampler.

Each row is tokenized without special tokens, followed by EOS; all rows are concatenated and cut into
seq_length-token blocks (labels are the inputs; the model shifts them). Blocks are split into train and
validation by a seeded permutation and cached as .npy files keyed by a fingerprint of everything that defines
them, so every later run and every other experiment on the same data reuses them memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from pipeline.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
CACHE_FORMAT = 1


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
    if "text" not in ds.column_names:
        raise UserError(f"--dataset-name {name} has no 'text' column (columns: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise UserError(f"--dataset-name {name} is empty")
    return ds


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


def data_fingerprint(dataset_fp: str, tokenizer_fp: str, seq_length: int, val_fraction: float, seed: int) -> str:
    key = {"format": CACHE_FORMAT, "dataset": dataset_fp, "tokenizer": tokenizer_fp, "seq_length": seq_length,
           "val_fraction": val_fraction, "seed": seed}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def token_cache_dir(save_dir: Path, dataset_fp: str, model_dir: Path, seq_length: int, val_fraction: float,
                    seed: int) -> Path:
    """Where the packed blocks of this dataset, tokenizer and cut live: shared by every run under save_dir."""
    fp = data_fingerprint(dataset_fp, tokenizer_fingerprint(model_dir), seq_length, val_fraction, seed)
    return Path(save_dir) / "token_cache" / fp[:24]


@dataclass
class Blocks:
    train: np.ndarray
    """(n_train, seq_length) token ids, memory-mapped."""
    val: np.ndarray
    """(n_val, seq_length) token ids, memory-mapped."""
    path: Path
    """The cache directory they were read from."""


def _tokenize(batch: dict, tokenizer, eos_id: int) -> dict:
    """A batch of rows -> one row: their ids, each followed by EOS, as one uint32 array. Arrow takes a numpy array
    in one copy, where a list of Python int lists is converted element by element (a quarter of the whole
    tokenize+pack time on the bench)."""
    ids = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
    flat = np.fromiter(chain.from_iterable(row + [eos_id] for row in ids), dtype=np.uint32)
    return {"input_ids": [flat]}


def split_blocks(n_blocks: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, val) block indices from a seeded permutation; one val block at least when n >= 2."""
    n_val = round(n_blocks * val_fraction)
    if val_fraction > 0 and n_blocks >= 2:
        n_val = max(1, n_val)
    perm = np.random.default_rng(seed).permutation(n_blocks)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def build_blocks(ds, tokenizer, seq_length: int, val_fraction: float, seed: int, num_proc: int, out: Path) -> None:
    """Tokenize, pack and split into out/ (written to a temporary sibling, then renamed)."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenized = ds.map(_tokenize, batched=True, batch_size=1000, num_proc=num_proc if num_proc > 1 else None,
                           remove_columns=ds.column_names, fn_kwargs={"tokenizer": tokenizer,
                                                                      "eos_id": tokenizer.eos_token_id},
                           cache_file_name=str(tmp / "tokenized.arrow"), desc="tokenizing")
        column = tokenized.data.column("input_ids")
        flat = np.concatenate([chunk.flatten().to_numpy() for chunk in column.chunks]).astype(np.uint32)
        n_blocks = len(flat) // seq_length
        blocks = flat[: n_blocks * seq_length].reshape(n_blocks, seq_length)
        train_idx, val_idx = split_blocks(n_blocks, val_fraction, seed)
        np.save(tmp / "train.npy", blocks[train_idx])
        np.save(tmp / "val.npy", blocks[val_idx])
        meta = {"tokens": int(len(flat)), "blocks": n_blocks, "train_blocks": len(train_idx),
                "val_blocks": len(val_idx), "seq_length": seq_length, "rows": len(ds)}
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
    return Blocks(np.load(path / "train.npy", mmap_mode="r"), np.load(path / "val.npy", mmap_mode="r"), path)


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
