"""Ways of distributing the model over the ranks, behind one interface (base.Strategy)."""

from __future__ import annotations

import torch

from pipeline.config import ModelConfig, flag
from pipeline.runtime import Dist
from pipeline.strategies.base import Strategy
from pipeline.strategies.ddp import DDP
from pipeline.strategies.fsdp1 import FSDP1
from pipeline.strategies.fsdp2 import FSDP2
from pipeline.strategies.manual import ManualZeRO3

STRATEGIES: dict[str, type[Strategy]] = {"fsdp2": FSDP2, "fsdp1": FSDP1, "ddp": DDP, "manual": ManualZeRO3}
KNOB_DEFAULTS = {name: ModelConfig.__dataclass_fields__[name].default
                 for name in ("auto_wrap", "min_params", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
                              "use_orig_params")}


def make_strategy(cfg: ModelConfig, d: Dist, dtype: torch.dtype) -> Strategy:
    """The strategy --strategy names, for this config."""
    return STRATEGIES[cfg.strategy](cfg, d, dtype)


def ignored_knobs(cfg: ModelConfig) -> list[str]:
    """The FSDP1 knobs set away from their defaults that the chosen strategy does not apply, as "--flag value"."""
    honoured = STRATEGIES[cfg.strategy].KNOBS
    if cfg.strategy == "fsdp2" and cfg.backward_prefetch != "BACKWARD_PRE":
        honoured = honoured - {"backward_prefetch"}  # FSDP2 always prefetches as BACKWARD_PRE
    return [f"{flag(k)} {('on' if v else 'off') if isinstance(v, bool) else v}" for k, default in KNOB_DEFAULTS.items()
            if k not in honoured and (v := getattr(cfg, k)) != default]
