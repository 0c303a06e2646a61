"""The preference losses, per pair, from per-sequence log-probabilities: DPO (TRL's `sigmoid`, torchtune's DPOLoss;
conservative with label smoothing), IPO (TRL's `ipo`), SimPO (reference-free, length-normalized) and ORPO (the odds
ratio beside the chosen answer's NLL, reference-free). Pure functions of tensors: no model, no distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
REFERENCED = ("dpo", "ipo")
"""The objectives that compare with a reference model."""


@dataclass(frozen=True)
class PreferenceSettings:
    objective: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1


@dataclass
class PairTerms:
    """Per pair: the loss, the implicit rewards of each answer (TRL's rewards/chosen and rewards/rejected) and the
    log-probabilities the objective compared (sums, or means over the answer's tokens where it normalizes)."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def pair_terms(s: PreferenceSettings, chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor,
               rejected_len: torch.Tensor, ref_chosen: torch.Tensor | None = None,
               ref_rejected: torch.Tensor | None = None) -> PairTerms:
    """The terms of each pair from the policy's summed log-probabilities of its chosen and rejected answers (and their
    token counts), and for DPO and IPO the reference's. As TRL computes them: IPO, SimPO and ORPO compare mean
    log-probabilities (a sum over the answer's tokens divided by their number), DPO the sums."""
    if s.objective == "dpo":
        logits = s.beta * ((chosen - rejected) - (ref_chosen - ref_rejected))
        loss = -F.logsigmoid(logits) * (1 - s.label_smoothing) - F.logsigmoid(-logits) * s.label_smoothing
        return PairTerms(loss, s.beta * (chosen - ref_chosen), s.beta * (rejected - ref_rejected), chosen, rejected)
    chosen, rejected = chosen / chosen_len, rejected / rejected_len
    if s.objective == "ipo":
        ref_chosen, ref_rejected = ref_chosen / chosen_len, ref_rejected / rejected_len
        logits = (chosen - rejected) - (ref_chosen - ref_rejected)
        loss = (logits - 1 / (2 * s.beta)) ** 2
        return PairTerms(loss, s.beta * (chosen - ref_chosen), s.beta * (rejected - ref_rejected), chosen, rejected)
    if s.objective == "simpo":
        logits = s.beta * (chosen - rejected) - s.simpo_gamma
        loss = -F.logsigmoid(logits) * (1 - s.label_smoothing) - F.logsigmoid(-logits) * s.label_smoothing
        return PairTerms(loss, s.beta * chosen, s.beta * rejected, chosen, rejected)
    if s.objective == "orpo":
        # log odds of each answer: log(p / (1 - p)) with p its mean token probability; log1p(-exp(x)) is log(1 - p)
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        loss = -chosen - s.orpo_lambda * F.logsigmoid(log_odds)  # the chosen answer's NLL per token, and the ratio
        return PairTerms(loss, s.orpo_lambda * chosen, s.orpo_lambda * rejected, chosen, rejected)
    raise ValueError(f"unknown preference objective {s.objective!r}")
