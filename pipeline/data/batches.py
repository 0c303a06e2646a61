"""Blocks from the token cache as model inputs: ids, labels and position ids on the training device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pipeline.data import packing
from pipeline.model.vocab_parallel import IGNORE


@dataclass
class Batch:
    input_ids: torch.Tensor
    """[batch, seq] int64."""
    labels: torch.Tensor
    """[batch, seq]: the ids, IGNORE where a token is not a target (the model shifts them by one)."""
    position_ids: torch.Tensor | None
    """[batch, seq], restarting at each packed sequence; None for plain text blocks (0..seq-1). With them, the
    model's mask keeps attention within each sequence (transformers derives it from the restarts)."""
    flags: torch.Tensor | None = None
    """[batch, seq] the blocks' packing flags (int64), which an objective may read (a preference pair's answers);
    None for plain text blocks."""
    ref: torch.Tensor | None = None
    """[batch, pairs, 2] float32: a reference's log-probabilities of each pair's chosen and rejected answers,
    computed before training (pipeline/objectives/reference_pass.py), NaN past a row's pairs; None without."""
    rows: np.ndarray | None = None
    """A batch of prompts (GRPO, pipeline/rl/prompts.py): each row's prompt, -1 for a padding row; None otherwise."""
    shifted: bool = False
    """labels are already each position's next-token target, IGNORE where none: a sequence-parallel slice, whose
    last position's target is the first token of the next rank's slice (pipeline/strategies/sequence_parallel.py)."""


def _to(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 on the device. On GPU through pinned memory: a copy from pageable memory waits for every kernel
    already queued (a host sync per micro-step), a pinned one is queued behind them."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
    return t if device.type != "cuda" else t.pin_memory().to(device, non_blocking=True)


def make_batch(ids: np.ndarray, flags: np.ndarray | None, device: torch.device,
               valid_rows: int | None = None, ref: np.ndarray | None = None) -> Batch:
    """The batch of these blocks; rows from valid_rows on are padding and have no targets. ref: the blocks'
    reference log-probabilities, where the objective has them."""
    labels = ids.astype(np.int64)
    if flags is not None:
        labels = np.where(flags & packing.TRAIN, labels, IGNORE)
    if valid_rows is not None:
        labels[valid_rows:] = IGNORE
    input_ids = _to(ids, device)
    if flags is None:
        return Batch(input_ids, _to(labels, device), None)
    ref_t = None if ref is None else torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)).to(device)
    return Batch(input_ids, _to(labels, device), _to(packing.positions(flags), device), _to(flags, device), ref_t)


def count_targets(ids: np.ndarray, flags: np.ndarray | None, valid_rows: int | None = None) -> int:
    """Tokens of these blocks that are targets of the loss (the first of each block never is)."""
    rows = len(ids) if valid_rows is None else valid_rows
    if flags is None:
        return rows * (ids.shape[1] - 1)
    return int(packing.targets(flags[:rows]).sum())


class Part(NamedTuple):
    """A split as the token cache holds it (Blocks.part), and the batches of its rows."""

    blocks: np.ndarray
    """(n, seq) token ids."""
    flags: np.ndarray | None
    """Their packing flags (None for plain text)."""
    ref: np.ndarray | None = None
    """A reference's log-probabilities of their pairs, where the objective has them."""

    def flags_at(self, idx: np.ndarray) -> np.ndarray | None:
        return None if self.flags is None else self.flags[idx]

    def batch(self, idx: np.ndarray, device: torch.device, valid_rows: int | None = None) -> Batch:
        """The batch of these rows (make_batch)."""
        return make_batch(self.blocks[idx], self.flags_at(idx), device, valid_rows,
                          None if self.ref is None else self.ref[idx])


def rounds(n: int, world_size: int, batch_size: int) -> int:
    """How many batches each rank runs when n blocks are dealt to the ranks (dealt): the same on every rank."""
    return math.ceil(math.ceil(n / world_size) / batch_size)


def dealt(n: int, rank: int, world_size: int, batch_size: int, b: int) -> tuple[np.ndarray, int]:
    """Rank rank's b-th batch of n blocks dealt round-robin, padded with block 0 to batch_size rows, and how many are
    real (valid_rows: the padding has no targets). Every rank can compute every other's, without communication."""
    idx = np.arange(rank, n, world_size)[b * batch_size:(b + 1) * batch_size]
    return np.concatenate([idx, np.zeros(batch_size - len(idx), dtype=idx.dtype)]), len(idx)
