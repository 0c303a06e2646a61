"""Held-out loss: a model's next-token loss over blocks of the token cache, summed over every target token of every
rank, the same value whatever the world size or the batch size."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pipeline.data.batches import count_targets, make_batch
from pipeline.dist.runtime import Dist
from pipeline.strategies.base import Strategy

Part = tuple[np.ndarray, "np.ndarray | None"]
"""Blocks (n, seq) and their packing flags (None for plain text), as the token cache holds a split."""


@dataclass(frozen=True)
class HeldOut:
    loss: float
    """Mean cross-entropy per target token, in nats."""
    tokens: int
    """Target tokens the mean is over."""
    blocks: int

    @property
    def ppl(self) -> float:
        return math.inf if self.loss > 700 else math.exp(self.loss)  # exp overflows there; NaN stays NaN


Items = Callable[[np.ndarray, "np.ndarray | None", int], int]
"""What a mean is over, of blocks, their flags and how many rows are real: target tokens (count_targets), or a
preference objective's pairs."""


@torch.no_grad()
def held_out_loss(strategy: Strategy, parts: Sequence[Part], batch_size: int, d: Dist,
                  loss_fn: Callable | None = None, items: Items = count_targets) -> HeldOut | None:
    """The loss over every block of parts, dealt round-robin to the ranks; None when there are none. A collective:
    every rank runs the same forwards on the same shapes (the vocabulary-parallel loss and FSDP's gathers are
    collectives inside each), then one all-reduce; None too when the blocks hold no target token. The model is left
    in the mode it was in, its root released. loss_fn: the objective (default: the strategy's causal-LM loss), whose
    mean is over items."""
    total = sum(len(blocks) for blocks, _ in parts)
    if total == 0:
        return None
    loss_fn, model = loss_fn or strategy.loss(), strategy.model
    training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=d.device)
    for blocks, flags in parts:
        mine = np.arange(d.rank, len(blocks), d.world_size)
        for b in range(math.ceil(math.ceil(len(blocks) / d.world_size) / batch_size)):
            idx = mine[b * batch_size:(b + 1) * batch_size]
            # a rank short of blocks pads with block 0, whose rows do not count
            valid = len(idx)
            idx = np.concatenate([idx, np.zeros(batch_size - valid, dtype=idx.dtype)])
            rows = None if flags is None else flags[idx]
            # over num_items = world size, the losses summed over ranks are the global sum (pipeline/model/loss.py)
            loss = loss_fn(make_batch(blocks[idx], rows, d.device, valid), d.world_size)
            tokens = items(blocks[idx], rows, valid)
            sums += torch.stack([loss.double(), torch.tensor(tokens, dtype=torch.float64, device=d.device)])
    dist.all_reduce(sums)
    strategy.release()  # the root stays gathered after a forward without backward
    model.train(training)
    loss_sum, tokens = sums.tolist()  # a host sync, once per evaluation
    return HeldOut(loss_sum / tokens, int(tokens), total) if tokens else None
