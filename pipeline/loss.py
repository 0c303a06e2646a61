"""Next-token loss of a causal LM: through the Hugging Face forward, or vocabulary-parallel and fused (see
pipeline/vocab_parallel.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipeline.vocab_parallel import (
    IGNORE,
    VocabParallelCrossEntropy,
    gather_rows,
    head_pass,
    shifted_labels,
    vocab_row_offset,
)


class CausalLMLoss:
    """Mean next-token cross-entropy of a batch of full blocks (labels are the inputs, shifted by one).

    HF path: the model's own forward and loss; the mean over this rank's tokens (FSDP averages gradients over
    ranks). Vocabulary-parallel path (pipeline/vocab_parallel.py): the mean over all ranks' tokens, identical on
    every rank, whose gradients FSDP sums. Either way the gradient is that of the global mean.
    """

    def __init__(self, model: nn.Module, vocab_parallel: bool, group: dist.ProcessGroup | None = None):
        self.model, self.vocab_parallel, self.group = model, vocab_parallel, group

    def __call__(self, ids: torch.Tensor, valid_rows: int | None = None) -> torch.Tensor:
        """Loss of ids [batch, seq]; rows from valid_rows on are padding and do not count. A collective in the
        vocabulary-parallel path: every rank calls it with the same shape."""
        if not self.vocab_parallel:
            labels = ids if valid_rows is None else torch.where(
                torch.arange(len(ids), device=ids.device)[:, None] < valid_rows, ids, IGNORE)
            return self.model(input_ids=ids, labels=labels, use_cache=False).loss
        h = self.model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        labels = gather_rows(shifted_labels(ids, valid_rows), self.group).flatten()
        head = self.model.get_output_embeddings().weight
        w = head.to_local()
        start = vocab_row_offset(head.shape[0], self.group)
        h = h.flatten(0, 1)
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            return VocabParallelCrossEntropy.apply(h, w, labels, start, self.group)
        return head_pass(gather_rows(h, self.group), w, labels, start, self.group, False)[0]
