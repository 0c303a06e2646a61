"""A tied output layer (the LM head sharing the input embedding's weight) whose weight gradient the embedding's is
added into in place.

nn.Linear's product gives its weight's gradient as the transpose of a [hidden, vocab] product: not contiguous, so when
the embedding's gradient arrives (the last of the backward) autograd adds the two into a third [vocab, hidden]
tensor, beside both, at the moment every other gradient is already held. Here the weight's gradient is computed as a
[vocab, hidden] product directly (the same products, summed in another order: equal to fp32's rounding), which
autograd adds the embedding's into in place: one [vocab, hidden] tensor less at the backward's end (113 MB on
SmolLM2-135M in fp32, 1 GB on Llama-3.2-1B). Under autocast nn.Linear's gradient already comes out of the weight's
cast back to fp32, contiguous, and is summed in place: there this gives the same values the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


class _TiedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        # under autocast both are cast as autocast's own linear casts them, and the backward (which autocast does not
        # cover) runs in the same dtype, its gradients cast back to the inputs' dtypes as autocast's casts would be
        ctx.dtypes = hidden.dtype, weight.dtype
        if dtype is not None:
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        ctx.save_for_backward(hidden, weight)
        return F.linear(hidden, weight)

    @staticmethod
    @once_differentiable  # under autocast the weight saved is a cast copy, with no path back to the parameter
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        hidden, weight = ctx.saved_tensors
        grad = grad.to(hidden.dtype).reshape(-1, grad.shape[-1])
        d_hidden = d_weight = None
        if ctx.needs_input_grad[0]:
            d_hidden = (grad @ weight).view_as(hidden).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            d_weight = (grad.t() @ hidden.reshape(-1, hidden.shape[-1])).to(ctx.dtypes[1])
        return d_hidden, d_weight, None


class TiedHead(nn.Linear):
    """nn.Linear without bias whose weight is the input embedding's; its weight gradient built for an in-place sum."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kind = hidden.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        return _TiedProduct.apply(hidden, self.weight, dtype)


def tie_in_place(model: nn.Module) -> bool:
    """Make model's output layer a TiedHead where it is a plain nn.Linear without bias sharing the input embedding's
    weight (the module's class is swapped: its parameter, name and hooks stay as they are). Whether it did."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if type(head) is not nn.Linear or head.bias is not None or embed is None or head.weight is not embed.weight:
        return False
    head.__class__ = TiedHead
    return True
