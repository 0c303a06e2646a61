"""A reward model's objective over blocks of packed pairs (pipeline/data/pair_tokens.py): each answer's reward is the
score (pipeline/model/reward_head.py) at its sequence's last token that is not padding, where transformers'
AutoModelForSequenceClassification reads it, and each pair's loss TRL's RewardTrainer's: the Bradley-Terry
-logsigmoid(r_chosen - r_rejected), plus center_rewards_coefficient * (r_chosen + r_rejected)^2 where set.

The window's figures carry TRL's names: accuracy (the share of pairs whose chosen reward is strictly the higher),
margin (the mean of r_chosen - r_rejected), mean_reward, min_reward and max_reward (over both answers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.data.batches import Batch
from pipeline.data.pair_tokens import CHOSEN, REJECTED
from pipeline.model.head import Head
from pipeline.model.vocab_parallel import IGNORE
from pipeline.objectives.objective import HeldOut
from pipeline.objectives.preference import OverPairs, sequences
from pipeline.objectives.token_logps import sequence_rows, whole_rows

METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def scored_positions(flags: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, pad_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected, kept): per pair of the rows, in order, the flat index of each answer's last token that is
    not pad_id (its last token where every token is pad_id), and whether the pair is trained (a padding row repeats
    a real one with no target)."""
    seq, n, first = sequences(flags)
    seq = seq.flatten()
    index = torch.arange(seq.numel(), device=flags.device)
    real = torch.where(input_ids.flatten() != pad_id, index, -1)
    last_any = index.new_full((n,), -1).scatter_reduce(0, seq, index, "amax")
    last_real = index.new_full((n,), -1).scatter_reduce(0, seq, real, "amax")
    last = torch.where(last_real >= 0, last_real, last_any)
    trained = index.new_zeros(n).index_add(0, seq, (labels.flatten() != IGNORE).long())
    chosen, rejected = (first & CHOSEN) > 0, (first & REJECTED) > 0
    return last[chosen], last[rejected], (trained[chosen] > 0) & (trained[rejected] > 0)


class RewardObjective(OverPairs):
    """The Bradley-Terry loss of a reward model over a batch of packed pairs, strategy-blind: the model's forward
    gives every position's score (the reward head's transform), read at each answer's last token. Its window: pairs,
    pairs ranked right, the sums of margins and of rewards, the least and the greatest reward."""

    counted = "pairs"
    shown = (("accuracy", "accuracy"), ("margin", "margin"))

    def __init__(self, head: Head, pad_id: int, center_rewards_coefficient: float = 0.0):
        self.head, self.pad_id, self.center = head, pad_id, center_rewards_coefficient

    def closing(self, base: HeldOut, final: HeldOut) -> str:
        b, f = base.metrics, final.metrics
        return (f"accuracy {b['accuracy']:.3f} -> {f['accuracy']:.3f} over {final.tokens} pairs; reward loss "
                f"{base.loss:.4f} -> {final.loss:.4f}, mean margin {b['margin']:.4f} -> {f['margin']:.4f}")

    def rewards(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each trained pair's (chosen, rejected) rewards, this rank's rows (a reward head is never
        vocabulary-parallel)."""
        with self.head.autocasting(batch.input_ids.device):
            scores = self.head.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                     use_cache=False).logits
        scores, ids, labels = scores[..., 0].float(), batch.input_ids, batch.labels
        if self.head.sequence_group is not None:  # a slice of each row: the whole rows, as the pairs are read
            group = self.head.sequence_group
            scores, ids, labels = sequence_rows(scores, group), whole_rows(ids, group), whole_rows(labels, group)
            # back to the model-input convention scored_positions reads (a row's first token is never a target)
            labels = torch.cat([torch.full_like(labels[:, :1], IGNORE), labels[:, :-1]], 1)
        chosen, rejected, kept = scored_positions(batch.flags, ids, labels, self.pad_id)
        scores = scores.flatten()
        return scores[chosen[kept]], scores[rejected[kept]]

    def __call__(self, batch: Batch, num_items: float) -> torch.Tensor:
        chosen, rejected = self.rewards(batch)
        losses = -F.logsigmoid(chosen - rejected)
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        self._add(chosen.detach(), rejected.detach())
        return self.head.rank_share(losses.sum() / max(float(num_items), 1.0))

    def _add(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        both = torch.cat([chosen, rejected]).double()
        margins = (chosen - rejected).double()
        values = torch.stack([both.new_tensor(float(len(chosen))), (margins > 0).sum().double(), margins.sum(),
                              both.sum(), both.min() if len(both) else both.new_tensor(float("inf")),
                              both.max() if len(both) else both.new_tensor(float("-inf"))])
        if self.window is None:
            self.window = values
        else:
            w = self.window
            self.window = torch.cat([w[:4] + values[:4], torch.minimum(w[4:5], values[4:5]),
                                     torch.maximum(w[5:], values[5:])])

    def read_metrics(self, reduce: bool) -> dict[str, float]:
        """The window's figures, then reset. reduce: over every rank first (three collectives: the sums, the least,
        the greatest; every rank calls it)."""
        window, self.window = self.window, None
        if window is None:
            device = next(self.head.model.parameters()).device
            window = torch.tensor([0, 0, 0, 0, float("inf"), float("-inf")], dtype=torch.float64, device=device)
        if reduce and dist.is_initialized():
            sums, low, high = window[:4].clone(), window[4:5].clone(), window[5:].clone()
            dist.all_reduce(sums)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            window = torch.cat([sums, low, high])
        pairs, right, margin, total, low, high = window.tolist()  # a host sync, once per window
        if not pairs:
            return dict.fromkeys(METRICS, float("nan"))
        return {"accuracy": right / pairs, "margin": margin / pairs, "mean_reward": total / (2 * pairs),
                "min_reward": low, "max_reward": high}
