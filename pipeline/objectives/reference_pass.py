"""The reference of DPO and IPO when the reference is not the model being trained with its adapters off (full
fine-tuning, or --reference-model): every pair's log-probabilities under the reference, computed once before the first
step by the model as the strategy built it (the reference's weights loaded into it), and kept beside the token cache
(in REFERENCE_DIR, under a key of the reference's weights and the compute dtype), so a resume or a second run on the
same reference and data reuses them and nothing but the policy is resident while training.

The pass saves its results chunk by chunk, so a kill during it resumes from the chunks done. Each node's first process
saves them (the token cache may be local to a node); a chunk counts as done only where every process finds it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pipeline.data.batches import Part, dealt, rounds
from pipeline.data.pair_tokens import count_pairs, pair_starts
from pipeline.distributed.runtime import Dist
from pipeline.fsutil import save_npy_atomic, write_text_atomic
from pipeline.model.head import Head
from pipeline.objectives.preference import sequence_logps

REFERENCE_DIR = "reference"
"""The token cache's subfolder holding references' log-probabilities of its pairs, one folder per key."""
CHUNK_BLOCKS = 256
"""Blocks per saved chunk of the pass: what a kill during it loses at most."""
FORMAT = 1
"""Part of the key: a change to what the pass computes makes earlier results unused."""


def reference_folder(cache: Path, weights_digest: str, dtype: torch.dtype) -> Path:
    """Where the log-probabilities of a token cache's pairs under a reference with these weights are kept."""
    key = json.dumps({"format": FORMAT, "weights": weights_digest, "dtype": str(dtype)}, sort_keys=True)
    return cache / REFERENCE_DIR / hashlib.sha256(key.encode()).hexdigest()[:24]


def _everywhere(found: bool, d: Dist) -> bool:
    """Whether every process found it (each node may have its own copy of the cache). A collective."""
    flag = torch.tensor([float(found)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # a CPU tensor: gloo, no device sync
    return bool(flag.item())


@torch.no_grad()
def _chunk(head: Head, blocks: np.ndarray, flags: np.ndarray, batch_size: int, d: Dist, width: int,
           each_round: Callable[[], None]) -> np.ndarray:
    """The (chosen, rejected) log-probabilities of each pair of these blocks: [blocks, width, 2], NaN past a block's
    pairs. The blocks are dealt to the ranks; every rank returns the whole. each_round() before each round of
    forwards (every rank the same rounds: a stop check that is a collective may go there). A collective."""
    n, world = len(blocks), d.world_size
    out = np.full((n, width, 2), np.nan, dtype=np.float32)
    mine: dict[int, np.ndarray] = {}
    for b in range(rounds(n, world, batch_size)):
        each_round()
        idx, valid = dealt(n, d.rank, world, batch_size, b)
        got = sequence_logps(head, Part(blocks, flags).batch(idx, d.device, valid))
        values = torch.stack([got["chosen"], got["rejected"]], 1).float().cpu().numpy()
        # whose rows these are: this rank's, or on the vocabulary-parallel path every rank's in rank order
        ranks = range(world) if head.vocab_parallel else [d.rank]
        owners = [(int(i), k < valid_r) for idx_r, valid_r in (dealt(n, r, world, batch_size, b) for r in ranks)
                  for k, i in enumerate(idx_r)]
        counts = pair_starts(flags[[i for i, _ in owners]]).sum(1)
        for (i, real), part in zip(owners, np.split(values, np.cumsum(counts)[:-1]), strict=True):
            if real:  # a padding row repeats block 0, whose own row is someone's real one
                mine[i] = part
    parts = [mine]
    if not head.vocab_parallel and world > 1:  # each rank holds its own blocks': every rank gets all of them
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    for part in parts:
        for i, values in part.items():
            out[i, :len(values)] = values
    return out


def reference_pass(head: Head, blocks: np.ndarray, flags: np.ndarray, batch_size: int, d: Dist,
                   work: Path, check_stop: Callable[[int, int], None] = lambda saved, chunks: None
                   ) -> tuple[np.ndarray, int, int]:
    """Every pair's (chosen, rejected) summed log-probabilities under the model as it is: [blocks, pairs, 2]
    float32, NaN past a block's pairs, resumed from the chunks saved in work/; with (chunks read from there,
    chunks). check_stop(saved, chunks) runs on every rank before each round of forwards and once a computed chunk
    is saved everywhere, with the chunks saved so far (a stop acted on there loses one round's work at most, and a
    round is one forward: a chunk of 256 blocks took 94 s on a large pass). A collective."""
    width = max(int(pair_starts(flags).sum(1).max()) if len(flags) else 0, 1)  # the most pairs one block holds
    out = np.full((len(blocks), width, 2), np.nan, dtype=np.float32)
    starts = range(0, len(blocks), CHUNK_BLOCKS)
    resumed = 0
    for start in starts:
        stop = min(start + CHUNK_BLOCKS, len(blocks))
        saved = work / f"chunk-{start // CHUNK_BLOCKS:05d}.npy"
        if _everywhere(saved.exists(), d):
            out[start:stop] = np.load(saved)
            resumed += 1
            continue
        out[start:stop] = _chunk(head, blocks[start:stop], flags[start:stop], batch_size, d, width,
                                 functools.partial(check_stop, start // CHUNK_BLOCKS, len(starts)))
        if d.is_local_main:
            work.mkdir(parents=True, exist_ok=True)
            save_npy_atomic(saved, out[start:stop])
        dist.barrier()
        check_stop(start // CHUNK_BLOCKS + 1, len(starts))
    return out, resumed, len(starts)


def ensure_reference(head: Head, cache: Path, folder: Path, splits: dict[str, Part],
                     batch_size: int, d: Dist, load: Callable[[], None],
                     off: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                     check_stop: Callable[[int, int], None] = lambda saved, chunks: None
                     ) -> tuple[dict[str, np.ndarray], str]:
    """Each split's reference log-probabilities ({name: [blocks, pairs, 2]}) and what happened ("reused", or
    "computed in S s" with how many chunks an interrupted pass had saved): read from folder when every process finds
    them there, else computed by the model after load() has put the reference's weights in it (off: the context
    that makes the model the reference, the adapters switched off in an adapter run), saved, and the model left in
    training mode. check_stop: reference_pass's. A collective."""
    if _everywhere((folder / "meta.json").exists(), d):
        return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in splits}, "reused"
    started = time.perf_counter()
    partial = folder.with_name(folder.name + ".partial")
    load()
    head.model.eval()
    with off():
        passes = {name: reference_pass(head, part.blocks, part.flags, batch_size, d, partial / name, check_stop)
                  for name, part in splits.items()}
    head.model.train()
    found = {name: values for name, (values, _, _) in passes.items()}
    resumed = sum(read for _, read, _ in passes.values())
    chunks = sum(n for _, _, n in passes.values())
    if d.is_local_main:
        folder.mkdir(parents=True, exist_ok=True)
        for name, values in found.items():
            save_npy_atomic(folder / f"{name}.npy", values)
        pairs = {name: count_pairs(part.flags) for name, part in splits.items()}
        write_text_atomic(folder / "meta.json", json.dumps({"pairs": pairs, "cache": cache.name}, indent=2) + "\n")
    # the partial chunks go only once every process is past reading them: the last resumed chunk is read after its
    # collective, so a fast node-main could delete it under a slower rank's np.load (CI saw FileNotFoundError)
    dist.barrier()
    if d.is_local_main:
        shutil.rmtree(partial, ignore_errors=True)
    how = f"computed in {time.perf_counter() - started:.1f} s"
    return found, how + (f", {resumed} of {chunks} chunks read from an interrupted pass" if resumed else "")
