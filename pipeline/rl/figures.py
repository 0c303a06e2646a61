"""A window of GRPO's figures: per name, the sum, the sum of squares and the count of the values added, so a mean or
a std over every rank's values comes out of one all-reduce when the window is read."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pipeline.errors import UserError

TRAIN_FIELDS = ("event", "step", "time", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "completions_per_s",
                "mfu", "time_ms", "mem_gb", "loss_scale", "eval_loss", "ppl")
"""The train and eval events' own fields, which a logged metric must not overwrite (the trainer builds the events;
tests/test_grpo.py checks that a GRPO run's train event holds no field but these and the figures')."""


class Figures:
    """Values kept by name since the last read. The names are fixed when built, in one order on every rank: the
    read's all-reduce sums them position by position, so a rank with nothing for a name still sends its zeros."""

    def __init__(self, means: list[str], stds: list[str] = (), peaks: list[str] = (), troughs: list[str] = ()):
        self.names = [*means, *stds]
        self.stds = set(stds)
        self.sums = torch.zeros(len(self.names), 3, dtype=torch.float64)
        self.extremes = [*peaks, *troughs]
        """Names of a largest value (peaks) or a smallest (troughs, kept negated: one MAX all-reduce for both)."""
        self.troughs = set(troughs)
        self.highs = torch.full((len(self.extremes),), -torch.inf, dtype=torch.float64)
        self.logged: dict[str, list[float]] = {}
        """Means of names not known when built (the reward functions' log_metric): [sum, count] by name."""

    def log(self, metrics: dict[str, list[float]]) -> None:
        """Values of names known only when they come (each a mean over the window and every rank)."""
        for name, values in metrics.items():
            if name in self.names or name in self.extremes or name in TRAIN_FIELDS:
                raise UserError(f"a reward function logged the metric {name}, a name GRPO's train and eval events "
                                "already use; give log_metric another name")
            kept = self.logged.setdefault(name, [0.0, 0])
            kept[0], kept[1] = kept[0] + sum(values), kept[1] + len(values)

    def add(self, name: str, values: torch.Tensor) -> None:
        """Add values (any shape; NaN ones left out: an abstaining reward)."""
        v = values.detach().double().flatten().cpu()
        v = v[~torch.isnan(v)]
        if name in self.extremes:
            if v.numel():
                i = self.extremes.index(name)
                self.highs[i] = max(self.highs[i], (-v if name in self.troughs else v).max())
            return
        self.sums[self.names.index(name)] += torch.stack([v.sum(), (v * v).sum(), v.new_tensor(float(v.numel()))])

    def read(self, reduce: bool) -> dict[str, float]:
        """Each name's mean (or, for a std name, the std of its values, Bessel-corrected as torch's), over every rank
        when reduce (a collective: every rank calls it); then empty. A name with no value is left out."""
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        highs, self.highs = self.highs, torch.full_like(self.highs, -torch.inf)
        logged_here, self.logged = self.logged, {}
        logged = [logged_here]
        if reduce and dist.is_initialized() and dist.get_world_size() > 1:  # CPU tensors: gloo, no device sync
            dist.all_reduce(sums)
            dist.all_reduce(highs, op=dist.ReduceOp.MAX)
            # the logged names may differ by rank: each rank's [sum, count] by name, gathered as objects
            logged = [None] * dist.get_world_size()
            dist.all_gather_object(logged, logged_here)
        out = {name: -h if name in self.troughs else h
               for name, h in zip(self.extremes, highs.tolist(), strict=True) if h != -float("inf")}
        for name in sorted({name for rank in logged for name in rank}):
            total, n = (sum(rank[name][i] for rank in logged if name in rank) for i in (0, 1))
            out[name] = total / n
        for name, (total, squares, n) in zip(self.names, sums.tolist(), strict=True):
            if not n:
                continue
            mean = total / n
            if name not in self.stds:
                out[name] = mean
            else:
                out[name] = math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1)) if n > 1 else 0.0
        return out
