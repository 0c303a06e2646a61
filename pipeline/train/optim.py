"""The optimizer and learning-rate schedule of a run."""

from __future__ import annotations

import math

import torch

from pipeline.config import Config


def build_optimizer(groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    """AdamW over the strategy's parameter groups (decay on matrices only); fused kernels (CUDA, and CPU: 3x faster
    there than the default loop)."""
    # with CPU offload the shards live on the host: the CPU kernel runs
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.optim.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.optim.warmup_steps, num_training_steps=total_steps)


def rescale_lr(scheduler, optimizer: torch.optim.Optimizer, saved: float, lr: float) -> bool:
    """--lr changed since the checkpoint (say, lowered after a divergence): the schedule goes on from this step with
    the new peak. Every schedule here is the peak times a factor of the step, so scaling is exact. Returns whether
    it changed."""
    factor = lr / saved
    if math.isclose(factor, 1.0, rel_tol=1e-9):
        return False
    scheduler.base_lrs = [base * factor for base in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
        group["initial_lr"] *= factor
    return True
