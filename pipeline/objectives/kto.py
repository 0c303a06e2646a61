"""KTO (Ethayarajh et al. 2024, as TRL's KTOTrainer computes it) over blocks of packed KTO examples
(pipeline/data/pair_tokens.py: each example's completion, then its KL sequence, the prompt with another record's
completion).

Per example, with r = log pi(y|x) - log pi_ref(y|x) summed over the completion's tokens:
    desirable     w_d * (1 - sigmoid(beta * (r - z)))
    undesirable   w_u * (1 - sigmoid(beta * (z - r)))
where z, the KL term, is the mean over the micro-step's KL sequences of the same ratio, without gradient, clamped at
0. TRL takes z over each process's batch and then the mean of the processes' figures; here the mean is over every
rank's KL sequences of the micro-step (equal when the ranks hold as many examples, as they do in TRL's batches).

The window's figures carry TRL's names: kl, rewards/chosen and rewards/rejected (beta * r of the desirable and the
undesirable completions), rewards/margins (their difference), logps/chosen, logps/rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.data.batches import Batch
from pipeline.model.head import Head
from pipeline.objectives.objective import HeldOut
from pipeline.objectives.preference import OverPairs, Reference, sequence_logps

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
"""TRL's names for what a window of KTO examples averages."""


@dataclass(frozen=True)
class KTOSettings:
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def kto_losses(s: KTOSettings, logps: torch.Tensor, ref_logps: torch.Tensor, undesirable: torch.Tensor,
               kl: torch.Tensor) -> torch.Tensor:
    """Each example's loss from the policy's and the reference's summed log-probabilities of its completion, its
    label and the batch's KL term (a scalar, no gradient)."""
    ratio = logps - ref_logps
    desirable = s.desirable_weight * (1 - F.sigmoid(s.beta * (ratio - kl)))
    return torch.where(undesirable, s.undesirable_weight * (1 - F.sigmoid(s.beta * (kl - ratio))), desirable)


def balance_advice(desirable: int, undesirable: int, s: KTOSettings) -> str:
    """The weights to use where the labels are unbalanced and neither weight is in the range the KTO paper
    recommends (its eq. 8: w_d * n_d / (w_u * n_u) in [1, 4/3], TRL's check and rounding), "" where they are fine.
    Where one side is missing no weight balances them (TRL's check, counting it as 1, would advise one): that, said
    as such."""
    if (desirable == 0) != (undesirable == 0):
        has, lacks, label = ("desirable", "undesirable", "false") if desirable else ("undesirable", "desirable", "true")
        return (f"all {desirable or undesirable} examples are {has}, none {lacks}: one side of KTO is missing, so no "
                f"weight balances the two and the reward margin (desirable - undesirable) is undefined; the run trains "
                f"the {has} completions against the KL term alone (to train both sides, add {lacks} records, label "
                f"{label}, or pairs)")
    n_d, n_u = max(desirable, 1), max(undesirable, 1)
    if n_d == n_u:
        return ""
    des = (round(n_u * s.undesirable_weight / n_d, 2), round(n_u * s.undesirable_weight / n_d * 1.33, 2))
    und = (round(n_d * s.desirable_weight / n_u / 1.33, 2), round(n_d * s.desirable_weight / n_u, 2))
    if des[0] <= s.desirable_weight <= des[1] or und[0] <= s.undesirable_weight <= und[1]:
        return ""
    return (f"{desirable} desirable and {undesirable} undesirable examples at --kto-desirable-weight "
            f"{s.desirable_weight:g} and --kto-undesirable-weight {s.undesirable_weight:g}: the KTO paper's balance "
            f"(eq. 8) wants --kto-desirable-weight in [{des[0]:g}, {des[1]:g}] or --kto-undesirable-weight in "
            f"[{und[0]:g}, {und[1]:g}] (one of them, not both)")


class KTOObjective(OverPairs):
    """KTO over a batch of packed examples, strategy-blind: the head says how the model is run. Its window: examples,
    desirable ones, then the sums of their rewards and log-probabilities, and the KL terms of the micro-steps with
    their count."""

    counted = "examples"
    shown = (("rewards/margins", "margin"), ("kl", "kl"))

    def __init__(self, head: Head, settings: KTOSettings, reference: Reference):
        self.head, self.settings, self.reference = head, settings, reference

    def closing(self, base: HeldOut, final: HeldOut) -> str:
        b, f = base.metrics, final.metrics
        missing = [side for side, key in (("desirable", "rewards/chosen"), ("undesirable", "rewards/rejected"))
                   if math.isnan(f[key])]
        margin = (f"{b['rewards/margins']:.4f} -> {f['rewards/margins']:.4f}" if not missing else
                  f"undefined (the validation examples hold no {' and no '.join(missing)} completion)")
        return (f"kto loss {base.loss:.4f} -> {final.loss:.4f} over {final.tokens} examples; reward margin "
                f"(desirable - undesirable) {margin}, kl {b['kl']:.4f} -> {f['kl']:.4f}")

    def kl_term(self, ratios: torch.Tensor) -> torch.Tensor:
        """The mean of the KL sequences' log-probability ratios over every rank's examples of this micro-step, at
        least 0 (0 where there is none). A collective off the vocabulary-parallel path: every rank calls it once per
        micro-step, as it calls the objective."""
        total = torch.stack([ratios.sum(), ratios.new_tensor(float(len(ratios)))]).double()
        if not self.head.vocab_parallel and dist.is_initialized():  # there every rank saw every example already
            dist.all_reduce(total)
        kl = total[0] / total[1].clamp(min=1)
        return kl.clamp(min=0).to(ratios.dtype)

    def __call__(self, batch: Batch, num_items: float) -> torch.Tensor:
        got = sequence_logps(self.head, batch)
        with torch.no_grad():
            ref, ref_kl = self.reference(batch)
        keep = (got["chosen_len"] > 0) & (got["rejected_len"] > 0)  # a padding row's examples have no target
        logps, undesirable, ref = got["chosen"][keep], got["undesirable"][keep], ref[keep]
        with torch.no_grad():
            kl = self.kl_term(got["rejected"][keep] - ref_kl[keep])
        losses = kto_losses(self.settings, logps, ref, undesirable, kl)
        self._add(logps.detach(), ref, undesirable, kl)
        return self.head.rank_share(losses.sum() / max(float(num_items), 1.0))

    def _add(self, logps: torch.Tensor, ref: torch.Tensor, undesirable: torch.Tensor, kl: torch.Tensor) -> None:
        rewards = self.settings.beta * (logps - ref)
        good = ~undesirable
        values = torch.stack([logps.new_tensor(float(len(logps))), good.sum().to(logps.dtype), rewards[good].sum(),
                              rewards[undesirable].sum(), logps[good].sum(), logps[undesirable].sum(), kl,
                              logps.new_tensor(1.0)]).double()
        self.window = values if self.window is None else self.window + values

    def read_metrics(self, reduce: bool) -> dict[str, float]:
        """The window's figures, then reset: rewards and log-probabilities averaged over the desirable and the
        undesirable examples (NaN where the window has none of one), kl over its micro-steps. reduce: summed over the
        ranks first (not on the vocabulary-parallel path, where every rank saw every example). A collective when
        reduce."""
        window, self.window = self.window, None
        if window is None:
            window = torch.zeros(8, dtype=torch.float64, device=next(self.head.model.parameters()).device)
        if reduce and not self.head.vocab_parallel and dist.is_initialized():
            dist.all_reduce(window)
        n, good, r_good, r_bad, l_good, l_bad, kl, steps = window.tolist()  # a host sync, once per window
        bad = n - good

        def mean(total: float, count: float) -> float:
            return total / count if count else float("nan")

        chosen, rejected = mean(r_good, good), mean(r_bad, bad)
        return {"kl": mean(kl, steps), "rewards/chosen": chosen, "rewards/rejected": rejected,
                "rewards/margins": chosen - rejected, "logps/chosen": mean(l_good, good),
                "logps/rejected": mean(l_bad, bad)}
