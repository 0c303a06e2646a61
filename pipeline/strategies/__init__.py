"""Ways of distributing the model over the ranks, behind one interface (base.Strategy)."""

from __future__ import annotations

import torch

from pipeline.config import ModelConfig
from pipeline.runtime import Dist
from pipeline.strategies.base import Strategy
from pipeline.strategies.fsdp2 import FSDP2


def make_strategy(cfg: ModelConfig, d: Dist, dtype: torch.dtype) -> Strategy:
    """The strategy for this config (FSDP2: the only one so far; issue 12 adds fsdp1, ddp and manual)."""
    return FSDP2(cfg, d, dtype)
