"""Tiled MLP (--tiled-mlp on, ALST's TiledMLP): each decoder layer's MLP computed over chunks of the sequence, each
chunk under activation checkpointing, so the MLP's intermediate activations ([batch, seq, intermediate] three times
over for a gated MLP, the largest activation of a long sequence) exist for one chunk at a time, forward and backward.
Each token's output is the MLP's own (an MLP mixes no positions). Chunks of about hidden-size tokens, as ALST's
(ceil(seq / hidden) of them): a chunk's matrix products stay as large as the model's width."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.config import ModelConfig
from pipeline.errors import UserError
from pipeline.model.modeling import decoder_layers, in_routed_experts
from pipeline.model.transforms import ModelTransform

FEED_FORWARD = ("mlp", "feed_forward")
"""What transformers' decoder layers call their feed-forward module (Llama 4: feed_forward)."""


def chunks_for(seq: int, hidden: int) -> int:
    """How many chunks a sequence of seq tokens is cut into for a model of this width (1: not tiled)."""
    return max(1, math.ceil(seq / hidden))


def _tiled(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The MLP's forward over chunks of the sequence (dim 1), each checkpointed; whole where there is nothing to keep
    for a backward (no gradient) or one chunk would do."""
    n = chunks_for(x.shape[1], x.shape[-1]) if x.dim() == 3 else 1
    if n == 1 or not torch.is_grad_enabled():
        return forward(x)
    return torch.cat([checkpoint(forward, part, use_reentrant=False) for part in x.chunk(n, dim=1)], dim=1)


class TiledMLP(ModelTransform):
    name = "tiled_mlp"

    def __init__(self) -> None:
        self.layers = 0
        """The decoder layers whose MLP is tiled (the start line says it)."""

    def apply(self, model: nn.Module) -> None:
        """Each decoder layer's feed-forward module's forward tiled; a mixture of experts' layer is refused in one
        line (its router would route each chunk apart: its load-balancing statistics are the whole sequence's)."""
        for layer in decoder_layers(model):
            mlp = next((m for m in (getattr(layer, n, None) for n in FEED_FORWARD) if isinstance(m, nn.Module)), None)
            if mlp is None:
                raise UserError(f"--tiled-mlp on: {type(layer).__name__} has no feed-forward module to tile (none "
                                f"named {' or '.join(FEED_FORWARD)}); use --tiled-mlp off")
            if any(in_routed_experts(name) for name, _ in mlp.named_modules()):
                raise UserError(f"--tiled-mlp on: {type(model).__name__}'s MLP is a mixture of experts, whose router "
                                "must see the whole sequence; use --tiled-mlp off")
            mlp.forward = functools.partial(_tiled, mlp.forward)
            self.layers += 1


def tiled_mlp_transform(cfg: ModelConfig, dtype: torch.dtype) -> TiledMLP | None:
    """--tiled-mlp on's transform, or None."""
    return TiledMLP() if cfg.tiled_mlp == "on" else None
