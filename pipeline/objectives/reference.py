"""The reference model of DPO and IPO, without a second model resident while training:
- with adapters (LoRA, DoRA, QLoRA) the base is the reference, the model with its adapters switched off (as peft, TRL
  and torchtune do): one forward without gradient per micro-step and no extra weights;
- full fine-tuning, or another model named by --reference-model: every pair's log-probabilities computed once before
  the first step (pipeline/objectives/reference_pass.py) and carried by the batch (Batch.ref);
- none, for pipeline.evaluate's preference accuracy of a model alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from pipeline.data.batches import Batch
from pipeline.data.pair_tokens import pair_starts
from pipeline.model.head import Head
from pipeline.objectives.preference import sequence_logps


def adapters_off(head: Head, disabled: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    """The reference of an adapter run: the same model with its adapters switched off (disabled: the adapter
    transform's context), no gradient. Called by the objective inside torch.no_grad, on the batch it trains on."""

    def reference(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with disabled():
            got = sequence_logps(head, batch)
        return got["chosen"], got["rejected"]

    return reference


def precomputed(head: Head) -> Callable:
    """The reference of the pass before training: the log-probabilities the batch carries (Batch.ref, [rows, pairs,
    2], NaN past a row's pairs), in the order answers() lists the rows' pairs (every rank's rows on the
    vocabulary-parallel path, as the policy's)."""

    def reference(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        flat = head.every_row(batch.ref).flatten(0, 1)
        flat = flat[~torch.isnan(flat[:, 0])]
        return flat[:, 0], flat[:, 1]

    return reference


def none(head: Head) -> Callable:
    """No reference: every answer's reference log-probability 0, so the rewards are beta times the model's own
    log-probabilities and the preference accuracy is how often it gives the chosen answer the higher one
    (pipeline.evaluate of a model without --reference)."""

    def reference(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = int(pair_starts(head.every_row(batch.flags)).sum())  # a host sync per batch
        zeros = torch.zeros(pairs, device=batch.flags.device)
        return zeros, zeros

    return reference
