"""One optimizer step over its micro-batches, and the decision every rank takes alike on whether to apply it: the
one step function of the Trainer (and of tests/helpers/strategy_steps.py, which compares the strategies through it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeline.data.batches import Batch
from pipeline.objectives.objective import Objective
from pipeline.strategies.base import Strategy
from pipeline.train.telemetry import PhaseTimer


@dataclass
class StepResult:
    loss: float
    """Mean over every rank's tokens."""
    grad_norm: float
    """Global norm before clipping."""
    applied: bool
    """False when the loss or gradient norm was not finite on some rank: the update was skipped."""
    targets: int
    """Tokens in the loss this step, over every rank."""
    loss_scale: float | None = None
    """fp16: the loss scale this step ran at (None without one)."""


@dataclass
class Update:
    """What applies a step: the optimizer, the schedule and the clipping norm (0: measure only)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    max_norm: float
    before: Callable[[], None] = lambda: None
    """Called just before an update is applied (an async checkpoint's copy must be complete by then)."""
    scaler: torch.amp.GradScaler | None = None
    """fp16: the loss scaling (Strategy.grad_scaler); its scale halves after an overflowing step."""


def train_step(strategy: Strategy, objective: Objective, micro: Sequence, make_batch: Callable[[object], Batch | None],
               targets: float, update: Update, timer: PhaseTimer) -> StepResult:
    """One optimizer step over the micro-batches micro (each made by make_batch: a batch of the sampler's rows, or
    None where the objective made its own in prepare()), applied only when the loss and gradient norm are finite on
    every rank. Collectives inside: every rank calls it."""
    strategy.comm_seconds()  # time_ms.comm counts this step's collectives, not evaluation's or a save's
    total = torch.zeros((), device=strategy.dist.device)
    with timer.phase("total"):
        for i, idx in enumerate(micro):
            with timer.phase("data"):
                batch = make_batch(idx)
            # reduce gradients only on the last micro-step; earlier ones accumulate locally
            with strategy.gradient_sync(i == len(micro) - 1):
                with timer.phase("forward"):
                    # each micro-batch's summed loss over the whole step's targets: their sum is the token mean
                    with strategy.recording():
                        loss = objective(batch, targets)
                    # a MoE router's balancing term, per micro-batch as transformers adds it per forward, averaged
                    # over the micro-steps as the HF Trainer's accumulation does (over the ranks: auxiliary_loss)
                    aux = strategy.auxiliary_loss()
                    trained = loss if aux is None else loss + aux / len(micro)
                with timer.phase("backward"):
                    (trained if update.scaler is None else update.scaler.scale(trained)).backward()
            total += loss.detach()
        strategy.forget_split()
        with timer.phase("update"):
            scale = None
            if update.scaler is not None:  # the gradients back to their true size before they are measured
                scale = update.scaler.get_scale()
                update.scaler.unscale_(update.optimizer)
            norm = strategy.clip_grad_norm(update.max_norm or math.inf)
            result = agree(total, norm, targets, strategy.dist.world_size, scale)
            if result.applied:
                update.before()
                # also under fp16: the gradients are unscaled and every rank found them finite (agree), so the step
                # is the optimizer's own (the scaler's step would hand the fused AdamW the sharded scaler's [1]-shaped
                # overflow flag, which it cannot take)
                update.optimizer.step()
                strategy.after_optimizer_step()
                update.scheduler.step()
            if update.scaler is not None:  # an overflow halves the scale, a run of good steps doubles it
                update.scaler.update()
            update.optimizer.zero_grad(set_to_none=True)
    comm = strategy.comm_seconds()
    if comm is not None:
        timer.add("comm", comm * 1000)
    timer.step_done()
    return result


def agree(loss: torch.Tensor, norm: torch.Tensor, targets: int, world_size: int,
          loss_scale: float | None = None) -> StepResult:
    """The step's global mean loss and gradient norm, and whether to apply it: one all-reduce (every rank must reach
    it) and one host sync per step, since every rank must take the same decision before stepping. The norm is
    already global (the clipping's collective), so only the loss is summed, beside a count of the ranks that saw a
    non-finite value."""
    norm = norm.float().to(loss.device)
    bad = (~torch.isfinite(loss) | ~torch.isfinite(norm)).float()
    summed = torch.stack([loss.float(), bad])
    dist.all_reduce(summed)  # SUM: gloo has no AVG
    loss_sum, bad_ranks, local_norm = torch.cat([summed, norm.reshape(1)]).tolist()
    return StepResult(loss_sum / world_size, local_norm, bad_ranks == 0 and math.isfinite(loss_sum), targets,
                      loss_scale)


@dataclass
class Window:
    """What the steps since the last log line add up to."""

    steps: int = 0
    applied: int = 0
    loss: float = 0.0
    """Sum of the applied steps' losses."""
    grad_norm: float = math.nan
    """The last applied step's."""
    lr: float = math.nan
    """The learning rate the last applied step used (the schedule has moved on once it is applied)."""
    targets: int = 0
    """What the loss is a mean over (target tokens, or pairs: the objective's items), over every rank."""
    started: float = field(default_factory=time.perf_counter)

    def add(self, result: StepResult, lr: float) -> None:
        self.steps += 1
        self.targets += result.targets
        if result.applied:
            self.applied += 1
            self.loss += result.loss
            self.grad_norm, self.lr = result.grad_norm, lr

    def seconds(self) -> float:
        return time.perf_counter() - self.started
