"""Training data: the dataset, what identifies it, what defines its blocks, and the resumable global sampler.

The blocks themselves (tokenized, packed, split, cached on disk) are pipeline/token_cache.py's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from pipeline.errors import UserError
from pipeline.hub import TOKENIZER_FILES


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
