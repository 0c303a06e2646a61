"""Held-out loss: an objective's loss over blocks of the token cache (the causal-LM loss: summed over every target
token of every rank), the same value whatever the world size or the batch size, and the figures it keeps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pipeline.data.batches import Part, dealt, rounds
from pipeline.distributed.runtime import Dist
from pipeline.objectives.objective import HeldOut, Objective
from pipeline.signals import Stopped
from pipeline.strategies.base import Strategy

STOP_EVERY = 16
"""Rounds of batches between two calls of held_out_loss's `stop`: its all-reduce costs next to nothing beside 16
forwards, and a signal waits 16 forwards at most (far under the 300 s a launcher grants after one)."""


@torch.no_grad()
def held_out_loss(strategy: Strategy, parts: Sequence[Part], batch_size: int, d: Dist, objective: Objective,
                  stop: Callable[[], bool] | None = None) -> HeldOut | None:
    """The objective's loss over every block of parts, dealt round-robin to the ranks; None when there are none. A
    collective: every rank runs the same forwards on the same shapes (the vocabulary-parallel loss and FSDP's gathers
    are collectives inside each), then one all-reduce and the objective's figures read over the ranks; None too when
    the blocks hold no item. The model is left in the mode it was in, its root released, and the objective's
    training window as it was. stop, an agreed decision (every rank gets the same answer: a collective), is asked
    every STOP_EVERY rounds; when it says so the pass raises Stopped (a long validation and a scheduler's grace
    period)."""
    total = sum(len(part.blocks) for part in parts)
    if total == 0:
        return None
    model = strategy.model
    training = model.training
    model.eval()
    try:
        with objective.window_apart():
            sums = _sums(parts, batch_size, d, strategy, objective, stop)
            dist.all_reduce(sums)
            metrics = objective.read_metrics(reduce=True)
    finally:
        strategy.forget_split()
        strategy.release()  # the root stays gathered after a forward without backward
        model.train(training)
    per_part = sums.tolist()  # a host sync, once per evaluation
    loss_sum, tokens = (sum(column) for column in zip(*per_part, strict=True))
    by_part = [s / n if n else None for s, n in per_part]
    return HeldOut(loss_sum / tokens, int(tokens), total, metrics, by_part) if tokens else None


def _sums(parts: Sequence[Part], batch_size: int, d: Dist, strategy: Strategy, objective: Objective,
          stop: Callable[[], bool] | None) -> torch.Tensor:
    """This rank's (summed loss, items) over its share of each part: (parts, 2)."""
    sums = torch.zeros(len(parts), 2, dtype=torch.float64, device=d.device)
    done = 0
    for p, part in enumerate(parts):
        n = len(part.blocks)
        for b in range(rounds(n, d.data_world, batch_size)):
            done += 1
            if stop is not None and done % STOP_EVERY == 0 and stop():  # every rank the same rounds: the same calls
                raise Stopped("during validation")
            # a rank short of blocks pads with block 0, whose rows do not count
            idx, valid = dealt(n, d.data_rank, d.data_world, batch_size, b)
            # over num_items = world size, the losses summed over ranks are the global sum
            # (pipeline/objectives/causal_lm.py); a sequence-parallel group's ranks each sum their own positions'
            loss = objective(strategy.split(part.batch(idx, d.device, valid)), d.world_size)
            tokens = objective.items(part.blocks[idx], part.flags_at(idx), valid) if d.counts_data else 0
            sums[p] += torch.stack([loss.double(), torch.tensor(tokens, dtype=torch.float64, device=d.device)])
    return sums
