"""Held-out loss: an objective's loss over blocks of the token cache (the causal-LM loss: summed over every target
token of every rank), the same value whatever the world size or the batch size, and the figures it keeps."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipeline.data.batches import Part, dealt, rounds
from pipeline.distributed.runtime import Dist
from pipeline.objectives.objective import HeldOut, Objective
from pipeline.strategies.base import Strategy


@torch.no_grad()
def held_out_loss(strategy: Strategy, parts: Sequence[Part], batch_size: int, d: Dist,
                  objective: Objective) -> HeldOut | None:
    """The objective's loss over every block of parts, dealt round-robin to the ranks; None when there are none. A
    collective: every rank runs the same forwards on the same shapes (the vocabulary-parallel loss and FSDP's gathers
    are collectives inside each), then one all-reduce and the objective's figures read over the ranks; None too when
    the blocks hold no item. The model is left in the mode it was in, its root released, and the objective's
    training window as it was."""
    total = sum(len(part.blocks) for part in parts)
    if total == 0:
        return None
    model = strategy.model
    training = model.training
    model.eval()
    with objective.window_apart():
        sums = _sums(parts, batch_size, d, objective)
        dist.all_reduce(sums)
        metrics = objective.read_metrics(reduce=True)
    strategy.release()  # the root stays gathered after a forward without backward
    model.train(training)
    per_part = sums.tolist()  # a host sync, once per evaluation
    loss_sum, tokens = (sum(column) for column in zip(*per_part, strict=True))
    by_part = [s / n if n else None for s, n in per_part]
    return HeldOut(loss_sum / tokens, int(tokens), total, metrics, by_part) if tokens else None


def _sums(parts: Sequence[Part], batch_size: int, d: Dist, objective: Objective) -> torch.Tensor:
    """This rank's (summed loss, items) over its share of each part: (parts, 2)."""
    sums = torch.zeros(len(parts), 2, dtype=torch.float64, device=d.device)
    for p, part in enumerate(parts):
        n = len(part.blocks)
        for b in range(rounds(n, d.world_size, batch_size)):
            # a rank short of blocks pads with block 0, whose rows do not count
            idx, valid = dealt(n, d.rank, d.world_size, batch_size, b)
            # over num_items = world size, the losses summed over ranks are the global sum
            # (pipeline/objectives/causal_lm.py)
            loss = objective(part.batch(idx, d.device, valid), d.world_size)
            tokens = objective.items(part.blocks[idx], part.flags_at(idx), valid)
            sums[p] += torch.stack([loss.double(), torch.tensor(tokens, dtype=torch.float64, device=d.device)])
    return sums
