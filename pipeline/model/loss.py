"""Next-token loss of a causal LM: through the Hugging Face forward, or vocabulary-parallel and fused (see
pipeline/model/vocab_parallel.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from pipeline.data.batches import Batch
from pipeline.model.modeling import trunk
from pipeline.model.vocab_parallel import (
    VocabParallelCrossEntropy,
    gather_rows,
    head_pass,
    shifted_labels,
    vocab_row_offset,
)


class CausalLMLoss:
    """Next-token cross-entropy of a batch, as a sum over its targets divided by num_items, the number of targets in
    the whole step (every rank, every micro-step): so micro-steps and ranks with more targets weigh more, and a
    step's loss is the token-weighted mean whatever the packing.

    HF path: the model's own forward and loss over this rank's tokens, times the world size, since FSDP averages
    gradients over ranks. Vocabulary-parallel path (pipeline/model/vocab_parallel.py): the sum over every rank's tokens,
    identical on every rank, whose gradients FSDP sums. Either way the mean of the returned values over ranks is the
    step's share of the global loss, and the gradient is that of the global loss.
    """

    def __init__(self, model: nn.Module, vocab_parallel: bool, world_size: int,
                 group: dist.ProcessGroup | None = None, autocast: torch.dtype | None = None):
        self.model, self.vocab_parallel, self.world_size, self.group = model, vocab_parallel, world_size, group
        self.autocast = autocast
        """Run the forward under torch.autocast in this dtype (a strategy whose parameters stay fp32: ddp)."""

    def __call__(self, batch: Batch, num_items: float) -> torch.Tensor:
        """Loss of the batch over num_items targets. A collective in the vocabulary-parallel path: every rank calls it
        with the same shapes."""
        # use_cache=False, never left to the default: with a cache transformers no longer finds packed documents from
        # the restarting position ids (masking_utils), and each document would attend to the ones before it
        if not self.vocab_parallel:
            device = batch.input_ids.device.type
            autocast = torch.autocast(device, self.autocast) if self.autocast else contextlib.nullcontext()
            with autocast:
                out = self.model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids,
                                 use_cache=False, num_items_in_batch=num_items)
            return out.loss * self.world_size
        h = trunk(self.model)(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                  use_cache=False).last_hidden_state
        labels = gather_rows(shifted_labels(batch.labels), self.group).flatten()
        head = self.model.get_output_embeddings().weight
        w = head.to_local()
        start = vocab_row_offset(head.shape[0], self.group)
        h = h.flatten(0, 1)
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            return VocabParallelCrossEntropy.apply(h, w, labels, start, self.group, num_items)
        return head_pass(gather_rows(h, self.group), w, labels, start, self.group, False, num_items)[0]
