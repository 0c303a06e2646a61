"""The causal-LM objective (sft): next-token loss through the Hugging Face forward, or vocabulary-parallel and fused
(see pipeline/model/vocab_parallel.py)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from pipeline.data.batches import Batch, count_targets
from pipeline.model.head import Head
from pipeline.model.modeling import trunk
from pipeline.model.vocab_parallel import (
    VocabParallelCrossEntropy,
    gather_rows,
    head_pass,
    shifted_labels,
    vocab_row_offset,
)
from pipeline.objectives.objective import HeldOut, Offline


class CausalLMLoss(Offline):
    """Next-token cross-entropy of a batch, as a sum over its targets divided by num_items, the number of targets in
    the whole step (every rank, every micro-step): so micro-steps and ranks with more targets weigh more, and a
    step's loss is the token-weighted mean whatever the packing.

    HF path: the model's own forward and loss over this rank's tokens, times the world size, since FSDP averages
    gradients over ranks. Vocabulary-parallel path (pipeline/model/vocab_parallel.py): the sum over every rank's tokens,
    identical on every rank, whose gradients FSDP sums. Either way the mean of the returned values over ranks is the
    step's share of the global loss, and the gradient is that of the global loss.
    """

    counted = "trained_tokens"
    shown = ()

    def __init__(self, head: Head):
        self.head = head

    def items(self, ids: np.ndarray, flags: np.ndarray | None, valid_rows: int | None = None) -> int:
        return count_targets(ids, flags, valid_rows)

    def read_metrics(self, reduce: bool) -> dict[str, float]:
        return {}

    def window_apart(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def closing(self, base: HeldOut, final: HeldOut) -> str:
        return (f"loss {base.loss:.4f} -> {final.loss:.4f} (ppl {base.ppl:.2f} -> {final.ppl:.2f}) over "
                f"{final.tokens} tokens")

    def __call__(self, batch: Batch, num_items: float) -> torch.Tensor:
        """Loss of the batch over num_items targets. A collective in the vocabulary-parallel path: every rank calls it
        with the same shapes."""
        # use_cache=False, never left to the default: with a cache transformers no longer finds packed documents from
        # the restarting position ids (masking_utils), and each document would attend to the ones before it
        head = self.head
        if not head.vocab_parallel:
            # transformers' loss shifts labels itself unless given shift_labels (the targets, already shifted)
            shifted = {"shift_labels": batch.labels} if batch.shifted else {}
            with head.autocasting(batch.input_ids.device):
                out = head.model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids,
                                 use_cache=False, num_items_in_batch=num_items, **shifted)
            return out.loss * head.world_size
        h = trunk(head.model)(input_ids=batch.input_ids, position_ids=batch.position_ids,
                              use_cache=False).last_hidden_state
        labels = gather_rows(batch.labels if batch.shifted else shifted_labels(batch.labels), head.group).flatten()
        weight = head.model.get_output_embeddings().weight
        w = weight.to_local()
        start = vocab_row_offset(weight.shape[0], head.group)
        h = h.flatten(0, 1)
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            return VocabParallelCrossEntropy.apply(h, w, labels, start, head.group, num_items, head.compiled_loss)
        return head_pass(gather_rows(h, head.group), w, labels, start, head.group, False, num_items)[0]
