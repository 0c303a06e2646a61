"""The reference log-probabilities of a DPO or IPO run that has no adapters to switch off (or names
--reference-model), as the ranks meet them: found beside the token cache or computed, before the model is filled for
training; and GRPO's reference under full fine-tuning, a frozen copy of the base beside the policy."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal

import torch
import torch.distributed as dist

from pipeline.config import Config
from pipeline.data.pair_tokens import count_pairs
from pipeline.data.token_cache import Blocks
from pipeline.distributed.runtime import Dist
from pipeline.model.adapters import adapters_disabled
from pipeline.model.head import Head
from pipeline.model.registry import transforms_for
from pipeline.objectives.grpo import KLReference
from pipeline.objectives.reference_pass import ensure_reference, reference_folder
from pipeline.signals import Interrupted, StopRequest, agreed_stop
from pipeline.strategies.base import Strategy
from pipeline.strategies.registry import make_strategy
from pipeline.train.preflight import Plan, ReferencePlan
from pipeline.train.telemetry import log


def stop_in_pass(saved: int, chunks: int) -> None:
    """A signal on any rank stops the pass before its next round of forwards (a pass over many pairs takes minutes:
    a scheduler's grace period would kill it first); the chunks saved are kept. One small all-reduce per round:
    every rank calls it."""
    if agreed_stop():
        # said once, by rank 0; the others keep it in their log (their console shows warnings only)
        (log.warning if dist.get_rank() == 0 else log.info)(
            "stopped by signal during the reference pass, with %d of %d chunks saved (kept); rerun the same command "
            "to resume", saved, chunks)
        raise Interrupted(StopRequest.signum or signal.SIGTERM)


def with_reference(blocks: Blocks, ref: ReferencePlan, strategy: Strategy, dtype: torch.dtype,
                   batch_size: int) -> Blocks:
    """The blocks with the reference's log-probabilities of their pairs: found beside the token cache, or computed
    by the model with the reference's weights loaded into it (an adapter run's with its adapters off). The model's
    weights are then the reference's: the checkpoint or the base must fill it after. A collective."""
    folder = reference_folder(blocks.path, ref.weights, dtype)
    splits = {name: blocks.part(name) for name in ("train", "val")}
    off = functools.partial(adapters_disabled, strategy.model) if strategy.freezes_base else contextlib.nullcontext
    # whole sequences on each rank, dealt over every rank (a pass without gradients keeps no activations: under
    # --sequence-parallel it is not split)
    whole = dataclasses.replace(strategy.head(), sequence_group=None)
    with strategy.whole_sequences():
        found, how = ensure_reference(whole, blocks.path, folder, splits, batch_size, strategy.dist,
                                      lambda: strategy.load_weights(ref.model_dir), off, stop_in_pass)
    strategy.release()  # the root stays gathered after forwards without backward
    if strategy.dist.is_main:
        pairs = sum(count_pairs(part.flags) for part in splits.values())
        log.info("reference log-probabilities of %d pairs under %s: %s (%s)", pairs, ref.name, how, folder)
    return dataclasses.replace(blocks, train_ref=found["train"], val_ref=found["val"])


def frozen_copy(cfg: Config, plan: Plan, d: Dist, dtype: torch.dtype) -> KLReference | None:
    """GRPO's KL reference under full fine-tuning (the policy moves, so the base must be kept): the base's weights,
    frozen, beside the policy. Under fsdp2 a second build sharded as the policy is (each rank holds its share, the
    whole gathered for each step's reference pass and released after it); under the other strategies the whole model
    on each rank, fp32 under autocast as ddp runs the policy (ddp holds a whole replica of the policy anyway). A
    collective under fsdp2. None where the run needs none (not GRPO, no KL penalty, or adapters to switch off)."""
    if not plan.rewards or not cfg.grpo.grpo_beta or cfg.model.adapter != "none":
        return None
    if cfg.model.strategy == "fsdp2":
        strategy = make_strategy(cfg.model, d, dtype, transforms_for(cfg.model, dtype))
        strategy.build(plan.hf_config)
        strategy.load_weights(plan.model_dir)
        strategy.model.requires_grad_(False)
        strategy.model.eval()
        return KLReference(strategy.head(), strategy.gathered)
    from transformers import AutoModelForCausalLM

    # as the policy computes: fp32 weights under autocast to the compute dtype (a bf16 copy would differ from the
    # policy by bf16's rounding, and its KL pull the policy toward it from the first step)
    kernel = {} if cfg.model.attn_implementation == "auto" else {"attn_implementation": cfg.model.attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(plan.model_dir, dtype=torch.float32, **kernel).to(d.device).eval()
    model.requires_grad_(False)
    autocast = None if dtype == torch.float32 else dtype
    return KLReference(Head(model, False, d.world_size, autocast=autocast), contextlib.nullcontext)
