"""The preference objective of a batch of packed pairs (pipeline/data/pair_tokens.py): each answer's summed
log-probability through the model's head (pipeline/objectives/token_logps.py), the reference's for the same answers,
and the loss of each pair (pipeline/objectives/preference_losses.py), summed over the batch's pairs and divided by the
pairs of the whole step, as the causal-LM loss divides by its targets.

What the trainer reads besides the loss: the window's TRL-named figures (rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies, logps/chosen, logps/rejected), summed pair by pair and averaged when read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from pipeline.data import packing
from pipeline.data.batches import Batch
from pipeline.data.pair_tokens import CHOSEN, REJECTED, UNDESIRABLE, count_pairs
from pipeline.model.head import Head
from pipeline.model.vocab_parallel import IGNORE
from pipeline.objectives.objective import HeldOut, Offline
from pipeline.objectives.preference_losses import PairTerms, PreferenceSettings, pair_terms
from pipeline.objectives.token_logps import token_logps

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
"""TRL's names for what a window of pairs averages."""

Reference = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]
"""The reference's summed log-probabilities of the batch's chosen and rejected answers (every pair in the rows the
objective reads, in their order): objectives/reference.py."""


def sequences(flags: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The packed sequences of the rows: each position's sequence ([rows, seq], numbered in order over the rows),
    how many there are, and each one's first flags (which answer it is)."""
    starts = (flags & packing.START) > 0
    seq = torch.cumsum(starts.flatten().long(), 0).view(flags.shape) - 1  # every row begins with a START
    n = int(seq.max().item()) + 1 if seq.numel() else 0  # a host sync per micro-step: how many sequences
    return seq, n, flags.flatten()[starts.flatten()]


def answers(flags: torch.Tensor, labels: torch.Tensor, logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per pair of the rows (in order), the summed log-probability and the target count of its chosen and rejected
    answers, and whether its chosen place holds a KTO completion labelled undesirable. A position's log-probability
    is its next token's, which belongs to the sequence that token is in."""
    seq, n, first = sequences(flags)
    owner = torch.cat([seq[:, 1:], seq[:, -1:]], 1)  # position t predicts token t + 1
    counted = (labels != IGNORE).to(logps.dtype)
    sums = logps.new_zeros(n).index_add(0, owner.flatten(), logps.flatten())
    lengths = logps.new_zeros(n).index_add(0, owner.flatten(), counted.flatten())
    chosen, rejected = (first & CHOSEN) > 0, (first & REJECTED) > 0
    return {"chosen": sums[chosen], "rejected": sums[rejected], "chosen_len": lengths[chosen],
            "rejected_len": lengths[rejected], "undesirable": (first[chosen] & UNDESIRABLE) > 0}


def sequence_logps(head: Head, batch: Batch) -> dict[str, torch.Tensor]:
    """answers() of the batch under the model the head runs: per pair, each answer's summed log-probability and
    target count (every rank's pairs on the vocabulary-parallel path). A collective there."""
    logps, labels = token_logps(head, batch)
    return answers(head.every_row(batch.flags), labels, logps)


class OverPairs(Offline):
    """What the objectives over packed pairs (preference, KTO, reward) share: their items are the blocks' pairs
    (KTO's examples), and their window of figures, set aside for a validation pass."""

    window: torch.Tensor | None = None
    """The figures summed since the window was last read (on the device: read once per window)."""

    def items(self, ids: np.ndarray, flags: np.ndarray | None, valid_rows: int | None = None) -> int:
        return count_pairs(flags, valid_rows)

    @contextlib.contextmanager
    def window_apart(self) -> Iterator[None]:
        """A pass whose figures are read on their own (validation): the training window is set aside meanwhile."""
        kept, self.window = self.window, None
        try:
            yield
        finally:
            self.window = kept


class PreferenceObjective(OverPairs):
    """DPO, IPO, SimPO or ORPO over a batch of packed pairs, strategy-blind: the head says how the model is run. Its
    window: pairs, then each metric summed over them."""

    counted = "pairs"
    shown = (("rewards/accuracies", "accuracy"), ("rewards/margins", "margin"))

    def __init__(self, head: Head, settings: PreferenceSettings, reference: Reference | None):
        self.head, self.settings, self.reference = head, settings, reference

    def closing(self, base: HeldOut, final: HeldOut) -> str:
        b, f = base.metrics, final.metrics
        return (f"{self.settings.objective} loss {base.loss:.4f} -> {final.loss:.4f} over {final.tokens} pairs; "
                f"preference accuracy {b['rewards/accuracies']:.3f} -> {f['rewards/accuracies']:.3f}, mean margin "
                f"{b['rewards/margins']:.4f} -> {f['rewards/margins']:.4f}")

    def __call__(self, batch: Batch, num_items: float) -> torch.Tensor:
        got = sequence_logps(self.head, batch)
        ref_c = ref_r = None
        if self.reference is not None:
            with torch.no_grad():
                ref_c, ref_r = self.reference(batch)
        keep = (got["chosen_len"] > 0) & (got["rejected_len"] > 0)  # a padding row's pairs have no target
        terms = pair_terms(self.settings, got["chosen"][keep], got["rejected"][keep], got["chosen_len"][keep],
                           got["rejected_len"][keep], None if ref_c is None else ref_c[keep],
                           None if ref_r is None else ref_r[keep])
        self._add(terms)
        return self.head.rank_share(terms.loss.sum() / max(float(num_items), 1.0))

    def _add(self, t: PairTerms) -> None:
        with torch.no_grad():
            values = torch.stack([t.loss.new_tensor(float(len(t.loss))), t.chosen_rewards.sum(),
                                  t.rejected_rewards.sum(), (t.chosen_rewards - t.rejected_rewards).sum(),
                                  (t.chosen_rewards > t.rejected_rewards).sum(), t.chosen_logps.sum(),
                                  t.rejected_logps.sum()]).double()
            self.window = values if self.window is None else self.window + values

    def read_metrics(self, reduce: bool) -> dict[str, float]:
        """The window's figures, averaged over its pairs, then reset. reduce: sum them over the ranks first (each
        rank saw its own pairs; not on the vocabulary-parallel path, where every rank saw every pair). A collective
        when reduce."""
        window, self.window = self.window, None
        if window is None:  # no pair in this window on this rank: zeros where the others' are
            window = torch.zeros(1 + len(METRICS), dtype=torch.float64,
                                 device=next(self.head.model.parameters()).device)
        if reduce and not self.head.vocab_parallel and dist.is_initialized():
            dist.all_reduce(window)
        pairs, *sums = window.tolist()  # a host sync, once per window
        return {name: (total / pairs if pairs else float("nan")) for name, total in zip(METRICS, sums, strict=True)}
