"""GRPO's math as TRL's GRPOTrainer (1.16) does it, as pure functions of tensors: the group-relative advantages, the
clipped surrogate per token with the k3 KL to a reference, and the four token aggregations (loss types dapo, dr_grpo,
grpo, bnpo), each scaled for our trainer's accumulation and data parallelism. No model, no distribution: what spans
ranks (the rewards' batch std, the step's token and completion counts) is gathered by the caller and passed in.

The contract with the trainer: it calls micro_loss once per micro-batch (micro_steps per optimizer step, gradients
summed) on each of world_size ranks, and DDP/FSDP averages the gradients over ranks. The mean over ranks of the sum
over a rank's micro-steps of micro_loss is TRL's loss for the same optimizer step (TRL with per_device_train_batch_size
= a micro-batch's completions, gradient_accumulation_steps = steps_per_generation = micro_steps, num_processes =
world_size), so the gradients are TRL's. Only the token-level importance ratio, no two-sided clipping (TRL's delta),
no entropy masking or bonus, no vLLM importance correction: TRL's defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("dapo", "dr_grpo", "grpo", "bnpo")
SCALES = ("group", "batch", "none")
EPS = 1e-4
"""Added to the std before dividing (TRL's constant): an all-equal group then gets advantage 0, not 0/0."""


def bessel_std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation with Bessel's correction over the values that are not NaN, computed as TRL's nanstd
    does (the mean of squared deviations times n / (n - 1)) so that advantages agree with TRL's to the last bit rather
    than to torch.std's rounding. NaN for fewer than 2 values. The caller's "batch" std is this over every rank's
    rewards (gathered)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    n = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    var = torch.nanmean((x - mean) ** 2, dim=dim) * (n / (n - 1))
    return var.sqrt()


def _groups(rewards: torch.Tensor, group: int) -> torch.Tensor:
    if rewards.dim() != 1 or group < 2 or rewards.numel() % group:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not whole groups of {group} completions "
                         "(a 1-D tensor, each prompt's completions consecutive, at least 2 per prompt: a group of one "
                         "has nothing to be relative to, its advantage is always 0)")
    if torch.isinf(rewards).any():
        raise ValueError("rewards hold inf: a completion's reward is finite, or NaN where no reward scored it")
    return rewards.view(-1, group)


def advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """Each completion's advantage: its reward minus its group's mean, divided by (std + EPS) where std is its group's
    (scale "group", TRL's default), batch_std (scale "batch": bessel_std over every rank's rewards, gathered by the
    caller, as TRL's std of the whole generation batch), or not divided (scale "none", Dr. GRPO's choice: the std
    favours prompts whose rewards barely differ). rewards: [prompts * group] float, each prompt's group consecutive,
    all of a group on this rank (the mean needs no gather); NaN for a completion no reward function scored, which
    TRL 1.16 leaves out of its group's mean and std and gives advantage 0. Hazard: a group whose rewards all agree
    gets advantage 0 under every scale, hence no gradient from the surrogate (only the KL term moves it)."""
    if scale not in SCALES:
        raise ValueError(f"unknown reward scale {scale!r}: one of {', '.join(SCALES)}")
    grouped = _groups(rewards, group)
    centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (bessel_std(grouped, dim=1)[:, None] + EPS)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError('scale "batch" needs batch_std: the std of every rank\'s rewards (bessel_std, gathered)')
        centred = centred / (batch_std + EPS)
    return torch.nan_to_num(centred.reshape(-1), nan=0.0)


def zero_std_groups(rewards: torch.Tensor, group: int, batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """Per group: whether its rewards all agree (std close to 0 as torch.isclose has it, as TRL tests), so it teaches
    nothing: its mean is TRL's frac_reward_zero_std. Under scale "batch" (batch_std given) TRL tests the batch's one
    std instead: every group alike."""
    std = bessel_std(_groups(rewards, group), dim=1) if batch_std is None else \
        batch_std.expand(rewards.numel() // group)
    return torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True)
class GRPOLossSettings:
    loss_type: str = "dapo"
    """How the per-token losses are aggregated (micro_loss): TRL's default dapo divides by the step's token count."""
    epsilon: float = 0.2
    """The ratio's lower clip: below 1 - epsilon a token with a negative advantage stops pulling (TRL's epsilon)."""
    epsilon_high: float = 0.2
    """The ratio's upper clip, 1 + epsilon_high, for tokens with a positive advantage (TRL's epsilon_high, which
    defaults to epsilon there; DAPO's clip-higher uses 0.28)."""
    beta: float = 0.0
    """The KL term's weight; 0 (TRL's default) needs no reference model at all."""
    max_completion_length: int = 256
    """dr_grpo's constant denominator per completion: set it to the generation's limit, as TRL uses its own (whose
    default is 512): a different value rescales the loss and so the learning rate."""
    kl_ratio_correction: bool = True
    """Multiply the k3 KL by the (differentiable) ratio, as TRL 1.16 does by default (use_bias_correction_kl): the
    KL gradient becomes the unbiased reverse-KL gradient (DeepSeek-V3.2). It changes the gradient even on-policy,
    where the ratio is 1 but its gradient is not 0: k3 * grad(log p) is added. False: the GRPO paper's plain k3.
    Last of the fields, so that the others keep their positions."""
    sequence_level: bool = False
    """GSPO (TRL's importance_sampling_level="sequence"): one ratio per completion, the exp of its tokens' mean log
    ratio, clipped and weighting every token of it (and its KL, under kl_ratio_correction) alike; False: one ratio per
    token (TRL's default, "token")."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown GRPO loss type {self.loss_type!r}: one of {', '.join(LOSS_TYPES)}")
        if not (0 <= self.epsilon < 1 and self.epsilon_high >= 0 and self.beta >= 0 and self.max_completion_length > 0):
            raise ValueError(f"GRPO settings out of range: epsilon {self.epsilon} (0 to 1), epsilon_high "
                             f"{self.epsilon_high} (>= 0), beta {self.beta} (>= 0), max_completion_length "
                             f"{self.max_completion_length} (> 0)")


@dataclass
class TokenTerms:
    """Per completion token, [completions, tokens]: the loss to aggregate (surrogate plus beta times the KL), the KL
    term as TRL logs it (the k3, times the ratio under kl_ratio_correction; None when beta is 0), and where the clip
    took the gradient away (a ratio below 1 - epsilon with a negative advantage, above 1 + epsilon_high with a
    positive one, either): TRL's clip_ratio/low, high and region. Padding positions hold values too: average them
    with masked_mean."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    region_clipped: torch.Tensor


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
                s: GRPOLossSettings, ref_logps: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> TokenTerms:
    """TRL's clipped surrogate per token: with ratio = exp(logps - old_logps), -min(ratio * A, clamp(ratio, 1 - eps,
    1 + eps_high) * A), plus beta * kl, kl the k3 estimator exp(ref - logps) - (ref - logps) - 1 (>= 0, exactly 0
    where the policy is its reference), times the ratio under kl_ratio_correction (TRL's default). logps: [n, T] the
    policy's, with autograd; old_logps: the sampling policy's, detached (None: on-policy, logps.detach(), as TRL when
    each generation serves one optimizer step: ratio 1, the surrogate's gradient -A * grad logps); advantages: [n];
    ref_logps: [n, T], needed when beta > 0; mask: [n, T], the completion tokens, needed under sequence_level
    (GSPO: the ratio is exp of the masked mean log ratio, [n, 1], and the loss and clip flags are [n, 1] too, the
    loss [n, T] again where the KL term is added, as TRL's shapes are).

    Hazards: old_logps carrying autograd (e.g. logps itself) would make the ratio a constant 1 and the gradient 0, so
    it is refused; the log-probabilities at padding must be finite (TRL's are 0 there), since an inf there turns the
    masked sum into NaN, the mask multiplying after the fact."""
    if old_logps is None:
        old_logps = logps.detach()
    elif old_logps.requires_grad:
        raise ValueError("old_logps carries autograd: detach it (with logps itself the ratio is constant, no gradient)")
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    if s.sequence_level:
        if mask is None:
            raise ValueError("sequence-level importance sampling needs the completion mask")
        mask = mask.to(log_ratio.dtype)
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"beta {s.beta} needs the reference's log-probabilities (ref_logps)")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if s.kl_ratio_correction:
            kl = kl * ratio
        loss = loss + s.beta * kl
    low = (ratio < 1 - s.epsilon) & (adv < 0)
    high = (ratio > 1 + s.epsilon_high) & (adv > 0)
    return TokenTerms(loss, kl, low, high, low | high)


@dataclass(frozen=True)
class StepCounts:
    """What micro_loss needs of the whole optimizer step (every rank, every micro-step), gathered by the caller once
    per step, before the first micro-step's backward."""

    tokens: int
    """Completion tokens (the loss mask's sum) over every rank and micro-step: dapo's denominator."""
    sequences: int
    """Completions over every rank and micro-step, a completion with no token left in its mask included (TRL's mean
    over rows counts it): grpo's and dr_grpo's denominator."""
    micro_steps: int
    world_size: int

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.sequences < 1 or self.micro_steps < 1 or self.world_size < 1:
            raise ValueError(f"step counts out of range: {self}")


def micro_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, s: GRPOLossSettings,
               counts: StepCounts) -> torch.Tensor:
    """This rank's micro-batch's share of the step's loss (see the module's contract), per loss type:

    - dapo: sum of the micro-batch's masked token losses * world_size / counts.tokens: every token of the step
      weighs alike (TRL: num_items_in_batch, the generation batch's tokens, / num_processes * accumulation /
      steps_per_generation).
    - dr_grpo: the masked sum * world_size / (counts.sequences * max_completion_length) (TRL: / (rows *
      max_completion_length) / accumulation).
    - grpo: the sum of the micro-batch's per-completion token means * world_size / counts.sequences (TRL: the mean
      over rows / accumulation): short completions' tokens weigh more.
    - bnpo: the micro-batch's own token mean / micro_steps, as TRL does. Hazard: the normaliser is local, so unless
      every micro-batch holds as many tokens, this is not the step's token mean (a micro-batch of short completions
      weighs as much as one of long ones); it is kept for TRL parity only.

    For grpo and dr_grpo TRL divides by the local rows and the accumulation steps; the global counts give the same
    value whenever every micro-batch holds as many completions (always so in TRL), and the step's mean otherwise.
    mask: [n, T], 1 for a completion token that counts (0 at padding)."""
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    w = counts.world_size
    if s.loss_type == "dapo":
        return masked.sum() * w / max(counts.tokens, 1)
    if s.loss_type == "dr_grpo":
        return masked.sum() * w / (counts.sequences * s.max_completion_length)
    if s.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() * w / counts.sequences
    if s.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / counts.micro_steps
    raise ValueError(f"unknown GRPO loss type {s.loss_type!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of x over the mask's tokens (0 with none), for the metrics (kl, clip ratios; bool x counts as 0/1).
    TRL's metrics are means over every rank's tokens: to match, all-reduce the sum and the count, not this mean."""
    mask = mask.to(torch.float32)
    return (x.to(torch.float32) * mask).sum() / mask.sum().clamp(min=1.0)
