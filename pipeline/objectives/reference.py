"""The reference model of DPO and IPO, without a second model resident while training.

- With adapters (LoRA, DoRA, QLoRA): the base is the reference, the model with its adapters switched off (as peft,
  TRL and torchtune do): one forward without gradient per micro-step, no extra weights.
- Full fine-tuning: every pair's reference log-probabilities computed once, before the first step, by the base (or
  --reference-model) built under the same strategy, and kept beside the token cache under a key of the reference's
  weights and the cache, so a resume or a second run on the same base and data reuses them. The pass writes its
  results chunk by chunk, so a kill during it resumes from its finished chunks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pipeline.data.batches import Batch, make_batch
from pipeline.data.pair_tokens import count_pairs
from pipeline.dist.runtime import Dist
from pipeline.fsutil import save_npy_atomic, write_text_atomic
from pipeline.model.vocab_parallel import gather_rows
from pipeline.objectives.head import Head, token_logps
from pipeline.objectives.preference import answers

CHUNK_BLOCKS = 256
"""Blocks per saved chunk of the reference pass: what a kill during it loses at most."""


def adapters_off(head: Head, disabled: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    """The reference of an adapter run: the same model with its adapters switched off (disabled: the adapter
    transform's context), no gradient. Called by the objective inside torch.no_grad, on the batch it trains on."""

    def reference(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with disabled():
            logps, labels = token_logps(head, batch)
        flags = batch.flags if not head.vocab_parallel else gather_rows(batch.flags, head.group)
        got = answers(flags, labels, logps)
        return got["chosen"], got["rejected"]

    return reference


def precomputed(head: Head) -> Callable:
    """The reference of a full fine-tuning run: the cached log-probabilities the batch carries (Batch.ref, [rows,
    pairs, 2], NaN past a row's pairs), in the objective's pair order."""

    def reference(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        ref = batch.ref if not head.vocab_parallel else gather_rows(batch.ref, head.group)
        flat = ref.flatten(0, 1)
        flat = flat[~torch.isnan(flat[:, 0])]
        return flat[:, 0], flat[:, 1]

    return reference


def reference_key(weights: str, cache: Path) -> str:
    """Where a reference's log-probabilities of a cache's pairs are kept: by its weights' content and the cache."""
    return hashlib.sha256(json.dumps({"weights": weights, "cache": cache.name}).encode()).hexdigest()[:24]


def max_pairs(flags: np.ndarray) -> int:
    """The most pairs one block of these holds."""
    return max((count_pairs(flags[i:i + 1]) for i in range(len(flags))), default=0)


def _blocks_by_rank(n: int, d: Dist, batch_size: int) -> Iterator[tuple[np.ndarray, int]]:
    """This rank's blocks of range(n) in batches of batch_size, padded with block 0 (valid: how many are real);
    every rank runs the same number of batches (the forwards are collectives)."""
    mine = np.arange(d.rank, n, d.world_size)
    for b in range(math.ceil(math.ceil(n / d.world_size) / batch_size)):
        idx = mine[b * batch_size:(b + 1) * batch_size]
        valid = len(idx)
        yield np.concatenate([idx, np.zeros(batch_size - valid, dtype=idx.dtype)]), valid


@torch.no_grad()
def reference_pass(head: Head, blocks: np.ndarray, flags: np.ndarray, batch_size: int, d: Dist,
                   work: Path) -> np.ndarray:
    """Every pair's (chosen, rejected) summed log-probabilities under the model the head runs: [blocks, pairs, 2]
    float32, NaN past a block's pairs. The blocks are dealt to the ranks; each chunk of CHUNK_BLOCKS is gathered
    on every rank and saved by rank 0 to work/ (a kill resumes from the chunks done). A collective."""
    out = np.full((len(blocks), max(max_pairs(flags), 1), 2), np.nan, dtype=np.float32)
    head.model.eval()
    for start in range(0, len(blocks), CHUNK_BLOCKS):
        stop = min(start + CHUNK_BLOCKS, len(blocks))
        saved = work / f"chunk-{start // CHUNK_BLOCKS:05d}.npy"
        if saved.exists():  # every rank sees it (the work folder is on the run's shared storage)
            out[start:stop] = np.load(saved)
            continue
        mine: dict[int, np.ndarray] = {}
        for idx, valid in _blocks_by_rank(stop - start, d, batch_size):
            rows = start + idx
            batch = make_batch(blocks[rows], flags[rows], d.device, valid)
            logps, labels = token_logps(head, batch)
            batch_flags = batch.flags if not head.vocab_parallel else gather_rows(batch.flags, head.group)
            got = answers(batch_flags, labels, logps)
            values = torch.stack([got["chosen"], got["rejected"]], 1).float().cpu().numpy()
            owners = _owners(rows, valid, d, head.vocab_parallel)
            per_block = [count_pairs(flags[r:r + 1]) for r, _ in owners]
            for (r, real), part in zip(owners, np.split(values, np.cumsum(per_block)[:-1]), strict=True):
                if real:
                    mine[r] = part
        for part in _gathered(mine, head.vocab_parallel):
            for r, values in part.items():
                out[r, :len(values)] = values
        if d.is_main:
            save_npy_atomic(saved, out[start:stop])
        dist.barrier()
    return out


def _owners(rows: np.ndarray, valid: int, d: Dist, every_rank: bool) -> list[tuple[int, bool]]:
    """(block index, real) of each row the log-probabilities cover; a padding row (a copy of a block, its targets
    ignored) is not real, though answers lists its pairs. every_rank: the rows of every rank, in rank order."""
    own = [(int(r), i < valid) for i, r in enumerate(rows)]
    if not every_rank:
        return own
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, own)
    return [r for part in everyone for r in part]


def _gathered(mine: dict[int, np.ndarray], every_rank: bool) -> list[dict[int, np.ndarray]]:
    """Every rank's results (each rank its own blocks'), on every rank; already so on the vocabulary-parallel
    path. A collective."""
    if every_rank or not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def save_reference(folder: Path, train: np.ndarray, val: np.ndarray, meta: dict) -> None:
    """The finished reference beside the cache (atomic files: a reader sees both or neither complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_npy_atomic(folder / "train_ref.npy", train)
    save_npy_atomic(folder / "val_ref.npy", val)
    write_text_atomic(folder / "meta.json", json.dumps(meta, indent=2) + "\n")
