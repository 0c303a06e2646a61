"""GRPO's loss math (pipeline/objectives/grpo_losses.py) against hand values and against TRL's aggregation formulas,
transcribed here from trl/trainer/grpo_trainer.py (1.16, _compute_loss) so that the test needs no TRL: bench/
grpo_vs_trl.py runs TRL's own code."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.objectives.grpo_losses import (
    EPS,
    GRPOLossSettings,
    StepCounts,
    advantages,
    bessel_std,
    masked_mean,
    micro_loss,
    token_terms,
    zero_std_groups,
)


def right_padded(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_one_group_of_alternating_rewards_gets_plus_or_minus_0_866():
    adv = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, "group")
    std = math.sqrt(1 / 3)  # Bessel: sum of squared deviations 4 * 0.25, over n - 1 = 3
    assert std == pytest.approx(0.5773503, abs=1e-7)
    expected = 0.5 / (std + 1e-4)
    assert expected == pytest.approx(0.8658754, abs=1e-7)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, expected, -expected]), rtol=0, atol=1e-7)


def test_an_all_equal_group_gets_zero_advantage_and_gives_its_completions_no_gradient():
    rewards = torch.tensor([2.0, 2.0, 2.0, 2.0, 1.0, 0.0, 1.0, 0.0])
    adv = advantages(rewards, 4, "group")
    assert adv[:4].eq(0).all() and adv[4:].abs().gt(0.8).all()
    assert zero_std_groups(rewards, 4).tolist() == [True, False]
    torch.manual_seed(0)
    logps = (-torch.rand(8, 5)).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(8, 5)  # off-policy: clipping and ratios != 1 change nothing for A = 0
    mask = right_padded([5, 3, 4, 1, 5, 2, 3, 4], 5)
    s = GRPOLossSettings()
    terms = token_terms(logps, old, adv, s)
    micro_loss(terms.loss, mask, s, StepCounts(int(mask.sum()), 8, 1, 1)).backward()
    assert logps.grad[:4].eq(0).all()
    assert logps.grad[4:].abs().sum() > 0.01  # the other group's do


def test_none_scaling_only_centres_and_batch_scaling_divides_by_the_gathered_std():
    rank0, rank1 = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([3.0, 3.0, 1.0, 1.0])
    torch.testing.assert_close(advantages(rank1, 2, "none"), torch.tensor([0.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(advantages(rank1, 4, "none"), torch.tensor([1.0, 1.0, -1.0, -1.0]))
    batch_std = bessel_std(torch.cat([rank0, rank1]))  # the caller gathers every rank's rewards
    torch.testing.assert_close(batch_std, torch.cat([rank0, rank1]).std())
    # mean 10/8, squared deviations 9.5 in all, over 7: std sqrt(19/14)
    assert batch_std.item() == pytest.approx(math.sqrt(19 / 14), abs=1e-6)
    got = advantages(rank1, 4, "batch", batch_std)
    torch.testing.assert_close(got, torch.tensor([1.0, 1.0, -1.0, -1.0]) / (math.sqrt(19 / 14) + EPS))
    assert not torch.allclose(got, advantages(rank1, 4, "group"))  # the group's std (1.1547) is another divisor
    with pytest.raises(ValueError, match="batch_std"):
        advantages(rank1, 4, "batch")


def test_the_k3_kl_is_exactly_zero_at_the_reference_and_positive_away_from_it():
    s = GRPOLossSettings(beta=0.1, kl_ratio_correction=False)
    logps = torch.tensor([[-1.0, -2.0, -0.5]])
    adv = torch.tensor([0.7])
    same = token_terms(logps, None, adv, s, ref_logps=logps.clone())
    assert same.kl.eq(0).all()
    torch.testing.assert_close(same.loss, torch.full((1, 3), -0.7))  # ratio 1: the loss is -A, no KL added
    ref = logps + torch.tensor([[0.5, -0.5, 1e-3]])
    away = token_terms(logps, None, adv, s, ref_logps=ref)
    d = torch.tensor([0.5, -0.5, 1e-3])
    torch.testing.assert_close(away.kl[0], d.exp() - d - 1)
    assert away.kl.gt(0).all()
    assert away.kl[0, 0].item() == pytest.approx(math.exp(0.5) - 1.5, abs=1e-7)  # 0.1487213
    torch.testing.assert_close(away.loss, -0.7 + 0.1 * away.kl)
    assert token_terms(logps, None, adv, GRPOLossSettings(), ref_logps=ref).kl is None  # beta 0: no KL at all


def test_the_kl_times_the_ratio_as_trl_defaults_to_changes_the_gradient_even_on_policy():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    d = torch.tensor([[0.5, -0.3]])  # ref - logps
    ref, adv = logps.detach() + d, torch.zeros(1)  # advantage 0: only the KL moves the policy
    k3 = d.exp() - d - 1
    grads = {}
    for correct in (True, False):
        s = GRPOLossSettings(beta=0.1, kl_ratio_correction=correct)
        terms = token_terms(logps, None, adv, s, ref_logps=ref)
        torch.testing.assert_close(terms.kl.detach(), k3)  # on-policy the ratio is 1: the same value
        (g,) = torch.autograd.grad(terms.loss.sum(), logps)
        grads[correct] = g
    # d k3 / d logps = 1 - exp(d); the ratio's gradient (itself, 1 here) adds k3 * 1
    torch.testing.assert_close(grads[False], 0.1 * (1 - d.exp()))
    torch.testing.assert_close(grads[True], 0.1 * (1 - d.exp() + k3))
    old = logps.detach() - 0.1  # off-policy: ratio e^0.1, and the value is scaled too
    corrected = token_terms(logps.detach(), old, adv, GRPOLossSettings(beta=0.1), ref_logps=ref)
    torch.testing.assert_close(corrected.kl, k3 * math.exp(0.1))


def test_the_clip_flags_and_the_clipped_gradient_follow_the_ratio_and_the_advantage_sign():
    ratios = torch.tensor([[0.7, 0.9, 1.1, 1.25, 1.3], [0.7, 0.9, 1.1, 1.25, 1.3]])
    old = torch.full((2, 5), -1.0)
    logps = (old + ratios.log()).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    terms = token_terms(logps, old, adv, GRPOLossSettings(epsilon=0.2, epsilon_high=0.28))
    # positive advantage: only a ratio above 1.28 is clipped; negative: only below 0.8
    assert terms.high_clipped.tolist() == [[False, False, False, False, True], [False] * 5]
    assert terms.low_clipped.tolist() == [[False] * 5, [True, False, False, False, False]]
    assert terms.region_clipped.tolist() == [[False, False, False, False, True], [True, False, False, False, False]]
    # -min(r A, clamp(r, 0.8, 1.28) A): A = 1 caps the gain at 1.28; A = -1 takes -max(r, clamp(r)): 0.8 at r 0.7
    torch.testing.assert_close(terms.loss.detach(), torch.tensor([[-0.7, -0.9, -1.1, -1.25, -1.28],
                                                                  [0.8, 0.9, 1.1, 1.25, 1.3]]))
    terms.loss.sum().backward()
    assert logps.grad[0, 4] == 0 and logps.grad[1, 0] == 0  # the clipped tokens
    # elsewhere d(-r A)/d logps = -r A; clamp(0.7) = 0.8 on the positive row is not the min there, so r A flows
    torch.testing.assert_close(logps.grad[0, :4], -ratios[0, :4])
    torch.testing.assert_close(logps.grad[1, 1:], ratios[1, 1:])
    symmetric = token_terms(logps.detach(), old, adv, GRPOLossSettings(epsilon=0.2, epsilon_high=0.2))
    assert symmetric.high_clipped[0].tolist() == [False, False, False, True, True]


def trl_step_loss(loss_type: str, batches: list[list[tuple[torch.Tensor, torch.Tensor]]],
                  max_completion_length: int) -> torch.Tensor:
    """TRL's loss for one optimizer step: per rank (batches[rank]) and micro-step, _compute_loss's value, as in
    grpo_trainer.py (accumulation = steps_per_generation = micro-steps, num_items_in_batch = the generation batch's
    tokens over every process); Trainer adds nothing (loss_is_scaled_for_ga), a rank's gradients sum over its
    micro-steps, and DDP averages the ranks'."""
    world, accum = len(batches), len(batches[0])
    num_items_in_batch = sum(m.sum() for rank in batches for _, m in rank)
    per_rank = []
    for rank in batches:
        total = torch.tensor(0.0)
        for per_token_loss, mask in rank:
            if loss_type == "grpo":
                loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accum
            elif loss_type == "bnpo":
                loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accum
            elif loss_type == "dr_grpo":
                loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / accum
            else:  # dapo
                normalizer = num_items_in_batch.clamp(min=1.0) / world * accum / accum
                loss = (per_token_loss * mask).sum() / normalizer
            total = total + loss
        per_rank.append(total)
    return torch.stack(per_rank).mean()


def ours_step_loss(s: GRPOLossSettings, batches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
    counts = StepCounts(tokens=int(sum(m.sum() for rank in batches for _, m in rank)),
                        sequences=sum(m.shape[0] for rank in batches for _, m in rank),
                        micro_steps=len(batches[0]), world_size=len(batches))
    return torch.stack([sum(micro_loss(x, m, s, counts) for x, m in rank) for rank in batches]).mean()


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo", "bnpo"])
def test_each_loss_type_over_two_micro_steps_on_two_ranks_is_trls_step_loss(loss_type):
    torch.manual_seed(1)
    lengths = [[[6, 1], [3, 3]], [[2, 2], [6, 5]]]  # [rank][micro-step][completion]: micro-batches of unequal tokens
    batches = [[(torch.randn(2, 6), right_padded(rows, 6)) for rows in rank] for rank in lengths]
    s = GRPOLossSettings(loss_type=loss_type, max_completion_length=8)
    torch.testing.assert_close(ours_step_loss(s, batches), trl_step_loss(loss_type, batches, 8))


def test_the_loss_types_weigh_tokens_as_each_defines_it():
    # token loss 1 on rank 0 (micro-steps of 1 and 3 tokens, one completion each), 0 on rank 1 (4 tokens each)
    ones = [(torch.ones(1, 4), right_padded([1], 4)), (torch.ones(1, 4), right_padded([3], 4))]
    zeros = [(torch.zeros(1, 4), right_padded([4], 4)), (torch.zeros(1, 4), right_padded([4], 4))]
    batches = [ones, zeros]
    expected = {"dapo": 4 / 12,  # 4 tokens of loss 1 among the step's 12
                "dr_grpo": 4 / (4 * 8),  # over 4 completions of 8 tokens
                "grpo": 2 / 4,  # 2 of 4 completions have mean 1
                "bnpo": (1 + 1) / 2 / 2}  # each micro-batch's token mean / micro-steps, averaged over 2 ranks
    for loss_type, value in expected.items():
        got = ours_step_loss(GRPOLossSettings(loss_type=loss_type, max_completion_length=8), batches)
        assert got.item() == pytest.approx(value, abs=1e-7), loss_type


def test_on_policy_dapo_is_minus_the_token_weighted_mean_advantage_and_its_gradient_minus_a_over_tokens():
    torch.manual_seed(2)
    logps = (-torch.rand(4, 6)).requires_grad_()
    adv = advantages(torch.tensor([1.0, 0.0, 0.0, 0.5]), 4, "group")
    lengths = [6, 2, 4, 3]
    mask = right_padded(lengths, 6)
    s = GRPOLossSettings(loss_type="dapo")
    loss = micro_loss(token_terms(logps, logps.detach(), adv, s).loss, mask, s, StepCounts(15, 4, 1, 1))
    expected = -sum(a * n for a, n in zip(adv.tolist(), lengths, strict=True)) / 15
    assert abs(expected) > 0.1
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logps.grad, -adv[:, None] * mask / 15)
    with pytest.raises(ValueError, match="autograd"):
        token_terms(logps, logps, adv, s)


def test_masked_mean_counts_only_the_masks_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    assert masked_mean(x, right_padded([2, 1], 3)).item() == pytest.approx(2.0)
    assert masked_mean(x > 1.5, right_padded([2, 1], 3)).item() == pytest.approx(2 / 3)
    assert masked_mean(x, torch.zeros(2, 3)).item() == 0.0


def test_what_cannot_be_a_group_or_a_setting_is_refused():
    with pytest.raises(ValueError, match="whole groups"):
        advantages(torch.tensor([1.0, 0.0, 1.0]), 2, "group")
    with pytest.raises(ValueError, match="whole groups"):
        advantages(torch.tensor([1.0, 0.0]), 1, "none")
    with pytest.raises(ValueError, match="inf"):
        advantages(torch.tensor([1.0, float("inf")]), 2, "group")
    with pytest.raises(ValueError, match="reward scale"):
        advantages(torch.tensor([1.0, 0.0]), 2, "rank")
    with pytest.raises(ValueError, match="loss type"):
        GRPOLossSettings(loss_type="cispo")
    with pytest.raises(ValueError, match="ref_logps"):
        token_terms(torch.zeros(1, 2), None, torch.ones(1), GRPOLossSettings(beta=0.1))


def test_a_completion_no_reward_scored_is_left_out_of_its_group_and_gets_advantage_0():
    """TRL 1.16: NaN (every reward function abstained) is left out of the group's mean and std, and its advantage is
    0; a group that is all NaN teaches nothing."""
    nan = float("nan")
    got = advantages(torch.tensor([1.0, 0.0, nan, 1.0, nan, nan]), 3, "group")
    std = math.sqrt(0.5)  # of [1, 0]: the NaN left out (mean 0.5); a group with one scored value has no std
    assert got.tolist() == pytest.approx([0.5 / (std + EPS), -0.5 / (std + EPS), 0.0, 0.0, 0.0, 0.0])
    assert zero_std_groups(torch.tensor([1.0, 1.0, nan, 2.0, 3.0, 4.0]), 3).tolist() == [True, False]
    assert zero_std_groups(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, torch.tensor(0.0)).tolist() == [True, True]


def test_sampling_draws_each_token_as_often_as_its_probability_and_stops_on_non_finite_logits():
    """pick's inverse transform over unnormalised float32 weights summed in float64: each token's frequency over
    60,000 rows is its softmax probability (within 4 standard errors), at temperature 1 and 2 and under top-k and
    top-p (the nucleus renormalised); non-finite logits stop generation in one line."""
    from pipeline.rl.generation import Sampling, pick, seeded

    rows = 60_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    for s, keep in ((Sampling(1), 5), (Sampling(1, temperature=2.0), 5), (Sampling(1, top_k=3), 3),
                    (Sampling(1, top_p=0.8), 3)):  # top-p 0.8: 0.53 + 0.19 < 0.8, with the third 0.87
        drawn = pick(logits.expand(rows, -1), s, seeded(0, keep, s.temperature))
        p = torch.zeros(5, dtype=torch.float64)
        p[:keep] = (logits[:keep].double() / s.temperature).softmax(-1)
        freq = torch.bincount(drawn, minlength=5).double() / rows
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / rows).sqrt() + 1e-12).all(), (s, freq, p)
    with pytest.raises(RuntimeError, match="non-finite logits"):
        pick(torch.tensor([[0.0, float("nan")]]), Sampling(1), seeded(0))


def trl_sequence_terms(logps, old, adv, mask, ref, eps_low, eps_high, beta):
    """TRL 1.16's _compute_loss from the log ratio to per_token_loss under importance_sampling_level="sequence"
    (use_bias_correction_kl, its default), and its clip flags, transcribed."""
    log_ratio = logps - old
    log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = None
    if beta != 0.0:
        per_token_kl = (torch.exp(ref - logps) - (ref - logps) - 1) * coef_1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    advantages = adv.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    low = (coef_1 < 1 - eps_low) & (advantages < 0)
    high = (coef_1 > 1 + eps_high) & (advantages > 0)
    return per_token_loss, per_token_kl, low, high


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_is_trls_sequence_level_loss_value_gradient_and_clip_flags(beta):
    """--importance-sampling-level sequence: one ratio per completion (its tokens' mean log ratio, padding left out),
    clipped as one; the loss, its gradient, the KL and the clip flags are TRL's, and under the grpo loss type the
    micro-batch's loss is TRL's step loss (each completion's mean, then their mean)."""
    torch.manual_seed(0)
    mask = right_padded([5, 2, 4], 5).float()
    logps = (torch.randn(3, 5) - 2).requires_grad_()
    old = logps.detach() + torch.tensor([[0.3], [-0.4], [0.05]])  # one row clipped low, one high, one inside
    adv, ref = torch.tensor([-1.0, 2.0, 0.5]), logps.detach() + 0.1 * torch.randn(3, 5)
    s = GRPOLossSettings(loss_type="grpo", epsilon=0.2, epsilon_high=0.28, beta=beta, sequence_level=True)
    ours = token_terms(logps, old, adv, s, ref if beta else None, mask)
    theirs, kl, low, high = trl_sequence_terms(logps, old, adv, mask, ref, 0.2, 0.28, beta)
    torch.testing.assert_close(ours.loss, theirs)
    assert (ours.low_clipped.tolist(), ours.high_clipped.tolist()) == (low.tolist(), high.tolist()) == (
        [[True], [False], [False]], [[False], [True], [False]])
    if beta:
        torch.testing.assert_close(ours.kl, kl)
    counts = StepCounts(tokens=int(mask.sum()), sequences=3, micro_steps=1, world_size=1)
    loss = micro_loss(ours.loss, mask, s, counts)
    trl = ((theirs * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    torch.testing.assert_close(loss, trl)
    (ours_grad,) = torch.autograd.grad(loss, logps, retain_graph=True)
    (trl_grad,) = torch.autograd.grad(trl, logps)
    torch.testing.assert_close(ours_grad, trl_grad)
    if not beta:  # the clipped rows (a ratio below 0.8 with A < 0, above 1.28 with A > 0) give no gradient
        assert (ours_grad[:2] == 0).all() and (ours_grad[2, :4] != 0).all() and (ours_grad[2, 4:] == 0).all()
    with pytest.raises(ValueError, match="sequence-level importance sampling needs the completion mask"):
        token_terms(logps, old, adv, s, ref)
