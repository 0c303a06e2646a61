"""The reference model of DPO and IPO, without a second model resident while training: with adapters (LoRA, DoRA,
QLoRA) the base is the reference, the model with its adapters switched off (as peft, TRL and torchtune do), one
forward without gradient per micro-step and no extra weights. Full fine-tuning against a reference (a pass of the
base over every pair before the first step, kept beside the token cache) is not built yet: preflight refuses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from pipeline.data.batches import Batch
from pipeline.model.head import Head
from pipeline.model.vocab_parallel import gather_rows
from pipeline.objectives.preference import answers
from pipeline.objectives.token_logps import token_logps


def adapters_off(head: Head, disabled: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    """The reference of an adapter run: the same model with its adapters switched off (disabled: the adapter
    transform's context), no gradient. Called by the objective inside torch.no_grad, on the batch it trains on."""

    def reference(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with disabled():
            logps, labels = token_logps(head, batch)
        flags = batch.flags if not head.vocab_parallel else gather_rows(batch.flags, head.group)
        got = answers(flags, labels, logps)
        return got["chosen"], got["rejected"]

    return reference
