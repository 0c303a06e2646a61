"""--selective-checkpointing: torch's selective activation checkpointing, per decoder layer, by operator. The
outputs of the operators that cost compute (matrix products, attention) are kept from the forward; everything else
a layer does (norms, activation functions, rotary embedding, residual adds, casts) is run again in the backward from
them. Autograd without checkpointing keeps the inputs of those cheap operations too (the MLP's activation and product
at the intermediate width, each norm's input and output), about half of a layer's saved bytes on Llama's shape.

The recomputation reads the same inputs with the same operators, so values and gradients are bitwise those of no
checkpointing wherever whole-layer checkpointing's are (every family pipeline.tiny builds but Qwen 3.5's, whose
reference linear-attention kernel gives gradients 4e-8 apart under either); dropout's random numbers are replayed
(torch.utils.checkpoint restores the RNG state)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_ATEN = torch.ops.aten
SAVED_OPS = frozenset(op for op in (
    _ATEN.mm.default, _ATEN.addmm.default, _ATEN.bmm.default, getattr(_ATEN, "_grouped_mm", None),
    _ATEN._scaled_dot_product_flash_attention.default, _ATEN._scaled_dot_product_efficient_attention.default,
    _ATEN._scaled_dot_product_cudnn_attention.default, _ATEN._scaled_dot_product_flash_attention_for_cpu.default,
    getattr(_ATEN, "_scaled_mm", None)) if op is not None)
"""Operators whose outputs are kept (the rest is recomputed): matrix products, grouped ones (MoE experts) and
float8's, and every fused attention kernel. An op overload packet (_grouped_mm, _scaled_mm) stands for all its
overloads."""


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", None)
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS or packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(selective: bool) -> dict:
    """torch.utils.checkpoint's arguments for each decoder layer (transformers' gradient_checkpointing_enable passes
    them on): non-reentrant, and under --selective-checkpointing the operator policy above."""
    kwargs = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _policy)
    return kwargs
