"""GRPO's KL reference under full fine-tuning: a frozen copy of the base beside the policy (with adapters the base
is the policy with its adapters off, and no copy is needed)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pipeline.config import Config
from pipeline.distributed.runtime import Dist
from pipeline.model.head import Head
from pipeline.model.registry import transforms_for
from pipeline.objectives.grpo import KLReference
from pipeline.strategies.registry import make_strategy


def frozen_copy(cfg: Config, model_dir: Path, hf_config, d: Dist, dtype: torch.dtype) -> KLReference | None:
    """GRPO's KL reference under full fine-tuning (the policy moves, so the base must be kept): the base's weights,
    frozen, beside the policy. Under fsdp2 a second build sharded as the policy is (each rank holds its share, the
    whole gathered for each step's reference pass and released after it); under the other strategies the whole model
    on each rank, fp32 under autocast as ddp runs the policy (ddp holds a whole replica of the policy anyway). A
    collective under fsdp2. None where the run needs none (no KL penalty, or adapters to switch off)."""
    if not cfg.grpo.grpo_beta or cfg.model.adapter != "none":
        return None
    if cfg.model.strategy == "fsdp2":
        strategy = make_strategy(cfg.model, d, dtype, transforms_for(cfg.model, dtype))
        strategy.build(hf_config)
        strategy.load_weights(model_dir)
        strategy.model.requires_grad_(False)
        strategy.model.eval()
        return KLReference(strategy.head(), strategy.gathered)
    from transformers import AutoModelForCausalLM

    # as the policy computes: fp32 weights under autocast to the compute dtype (a bf16 copy would differ from the
    # policy by bf16's rounding, and its KL pull the policy toward it from the first step)
    kernel = {} if cfg.model.attn_implementation == "auto" else {"attn_implementation": cfg.model.attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kernel).to(d.device).eval()
    model.requires_grad_(False)
    autocast = None if dtype == torch.float32 else dtype
    return KLReference(Head(model, False, d.world_size, autocast=autocast), contextlib.nullcontext)
