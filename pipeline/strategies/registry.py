"""The strategies by name, and what is asked of them by name before any model exists: the config they accept, its
--sharding resolved, their memory estimate and traffic, the knobs they ignore, their out-of-memory hints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pipeline.config import VOCAB_PARALLEL_SHARDINGS, Config, ModelConfig
from pipeline.config_base import flag
from pipeline.distributed.runtime import Dist, compute_dtype
from pipeline.errors import UserError
from pipeline.model.packed_rows import PACKABLE_KERNELS
from pipeline.model.transforms import ModelTransform
from pipeline.strategies.base import Strategy
from pipeline.strategies.ddp import DDP
from pipeline.strategies.expert_parallel import EXPERT_PARALLEL_SHARDINGS, auto_blocked, expert_parallel_asked
from pipeline.strategies.fsdp1 import FSDP1
from pipeline.strategies.fsdp2 import FSDP2
from pipeline.strategies.manual import ManualZeRO3
from pipeline.strategies.memory import Estimate, Generation, Shape, Workload, shard_ranks
from pipeline.strategies.memory import estimate as estimate_with

STRATEGIES: dict[str, type[Strategy]] = {"fsdp2": FSDP2, "fsdp1": FSDP1, "ddp": DDP, "manual": ManualZeRO3}
"""Every strategy --strategy names (auto chooses among them): a new one is registered here."""
KNOB_DEFAULTS = {name: ModelConfig.__dataclass_fields__[name].default
                 for name in ("auto_wrap", "min_params", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
                              "use_orig_params")}


def with_sharding(m: ModelConfig) -> ModelConfig:
    """m with --sharding auto resolved for its named strategy (a copy; m itself when there is nothing to resolve)."""
    if m.strategy == "auto" or m.sharding != "auto":
        return m
    return replace(m, sharding=STRATEGIES[m.strategy].DEFAULT_SHARDING)


def make_strategy(cfg: ModelConfig, d: Dist, dtype: torch.dtype,
                  transforms: Sequence[ModelTransform] = ()) -> Strategy:
    """The strategy --strategy names, for this config (its --sharding auto resolved, in a copy, if not yet)."""
    if cfg.strategy == "auto":  # a programming error, not a user's: preflight resolves auto before any build
        raise ValueError("make_strategy needs a named strategy: resolve --strategy auto first (auto.plan_memory)")
    return STRATEGIES[cfg.strategy](with_sharding(cfg), d, dtype, transforms)


def _those_that(accept) -> str:
    """The strategies a predicate accepts, as "a, b or c"."""
    names = [name for name, cls in STRATEGIES.items() if accept(cls)]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def check(cfg: Config) -> None:
    """Combinations the chosen strategy cannot run, each refused in one line naming what would. Read-only. Under
    --strategy auto only what no strategy runs is refused: auto takes fsdp2 whenever the settings given need it."""
    m = cfg.model
    if m.strategy != "auto":
        _check_facts(cfg)
    if m.vocab_parallel == "on":  # after the strategy's facts: a strategy without it is named first
        if m.sharding not in (*VOCAB_PARALLEL_SHARDINGS, "auto"):
            raise UserError(f"--vocab-parallel on needs --sharding FULL_SHARD or SHARD_GRAD_OP, got {m.sharding}")
        if m.cpu_offload:
            raise UserError("--vocab-parallel on cannot be combined with --cpu-offload (the head would stay on the "
                            "GPU)")
    if expert_parallel_asked(m):
        _check_expert_parallel(m)
    if m.sequence_parallel > 1:
        check_sequence_parallel(cfg)
    if m.strategy != "auto":
        STRATEGIES[m.strategy].check(cfg)


def check_sequence_parallel(cfg: Config) -> None:
    """What --sequence-parallel cannot be combined with (its degree against the world, the sequence and the model:
    sequence_parallel.check_degree and refusal, once those are known; auto.split_degree asks it too)."""
    m, name = cfg.model, f"--sequence-parallel {cfg.model.sequence_parallel}"
    if m.strategy != "auto" and not STRATEGIES[m.strategy].SEQUENCE_PARALLEL:
        raise UserError(f"{name} needs --strategy {_those_that(lambda c: c.SEQUENCE_PARALLEL)}, got --strategy "
                        f"{m.strategy}")
    objective = cfg.objective.objective
    if cfg.objective.generates:
        raise UserError(f"{name} trains --objective sft, dpo, ipo, simpo, orpo, kto or reward, not {objective} yet "
                        "(its generation runs whole sequences); use --sequence-parallel 1")
    if cfg.objective.scores_answers and m.vocab_parallel == "on":
        raise UserError(f"{name} scores --objective {objective}'s answers through the model's own head: use "
                        "--vocab-parallel auto or off")
    if expert_parallel_asked(m):
        raise UserError(f"{name} cannot be combined with --expert-parallel {m.expert_parallel} yet; use one of them")
    if m.compile:  # the all-to-alls inside each compiled layer are untried
        raise UserError(f"{name} does not take --compile yet; use one of them")


def _check_expert_parallel(m: ModelConfig) -> None:
    """What --expert-parallel cannot be combined with (its degree against the model and mesh: expert_parallel.degree,
    once both are known)."""
    name = f"--expert-parallel {m.expert_parallel}"
    if m.strategy not in ("fsdp2", "auto"):
        raise UserError(f"{name} needs --strategy fsdp2 (the experts are split over its mesh), got --strategy "
                        f"{m.strategy}")
    if m.sharding not in (*EXPERT_PARALLEL_SHARDINGS, "auto"):
        raise UserError(f"{name} needs --sharding FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD (the experts are split "
                        "over the ranks FSDP shards over; NO_SHARD has none)")
    if m.cpu_offload:
        raise UserError(f"{name} cannot be combined with --cpu-offload (a rank's experts stay on its device)")


def _check_facts(cfg: Config) -> None:
    """What the named strategy's class attributes refuse."""
    m = cfg.model
    cls, name = STRATEGIES[m.strategy], f"--strategy {m.strategy}"
    if m.sharding != "auto" and m.sharding not in cls.SHARDINGS:
        raise UserError(f"{name} {cls.LAYOUT}; --sharding {m.sharding} needs --strategy "
                        f"{_those_that(lambda c: m.sharding in c.SHARDINGS)}")
    if m.cpu_offload and not cls.CPU_OFFLOAD:
        raise UserError(f"{name} cannot offload to the CPU; --cpu-offload needs --strategy "
                        f"{_those_that(lambda c: c.CPU_OFFLOAD)}")
    if m.vocab_parallel == "on" and not cls.VOCAB_PARALLEL:
        raise UserError(f"--vocab-parallel on needs --strategy {_those_that(lambda c: c.VOCAB_PARALLEL)}, got {name}")
    if m.adapter != "none" and not cls.ADAPTERS:
        raise UserError(f"{name} does not train adapters; --adapter {m.adapter} needs --strategy "
                        f"{_those_that(lambda c: c.ADAPTERS)}")
    for key in cls.UNSUPPORTED:
        if getattr(m, key):
            raise UserError(f"{name} does not support {flag(key)} yet; use --strategy fsdp2")


def settle(cfg: Config) -> Config:
    """The config checked against its strategy, with --sharding auto resolved for a named strategy: a new Config,
    the given one unchanged. (--strategy auto is resolved by auto.plan_memory, which needs the model's shape.)"""
    check(cfg)
    m = with_sharding(cfg.model)
    return cfg if m is cfg.model else replace(cfg, model=m)


def uses_vocab_parallel(m: ModelConfig) -> bool:
    """--vocab-parallel resolved for a settled config."""
    return m.strategy in STRATEGIES and STRATEGIES[m.strategy].uses_vocab_parallel(m)


def workload(cfg: Config, device: str, world_size: int, local_world_size: int, resident_params: int = 0) -> Workload:
    """The workload of a settled config (its strategy and sharding chosen) on this launch; resident_params: other
    models' parameters held whole in the compute dtype on every rank (GRPO's reward models)."""
    m, r = cfg.model, cfg.rollouts
    dtype = compute_dtype(m.precision, torch.device(device))
    batch, seq, generation = cfg.train.batch_size, cfg.data.seq_length, None
    if r is not None:  # a micro-batch of B prompts is B x G completions
        generation = Generation(batch * r.group, r.prompt, r.completion, reference=r.reference, group=r.group,
                                packable=m.attn_implementation in ("auto", *PACKABLE_KERNELS))
        batch, seq = generation.completions, r.prompt + r.completion
    return Workload(m.strategy, m.sharding, world_size, local_world_size, dtype.itemsize, batch, seq,
                    cfg.train.grad_accum, m.activation_checkpointing, uses_vocab_parallel(m), m.cpu_offload, device,
                    m.adapter, m.lora_rank, m.lora_targets, generation, resident_params * dtype.itemsize,
                    m.selective_checkpointing, planned_degree(m, world_size, local_world_size), m.tiled_mlp == "on",
                    m.offload_activations == "on" and device == "cuda", m.sequence_parallel)


def planned_degree(m: ModelConfig, world_size: int, local_world_size: int) -> int:
    """--expert-parallel as the estimate counts it: the number given; under auto 1 where the settings or a launch
    over nodes keep it off, else 0 (the model's side decided by Shape.split_experts)."""
    if m.expert_parallel != "auto":
        return int(m.expert_parallel)
    return 1 if auto_blocked(m) or shard_ranks(m.sharding, world_size, local_world_size) > local_world_size else 0


def estimate(shape: Shape, work: Workload) -> Estimate:
    """Peak bytes per rank for one optimizer step of this workload (pipeline/strategies/memory.py)."""
    return estimate_with(shape, work, STRATEGIES[work.strategy])


def traffic_bytes(shape: Shape, work: Workload) -> int:
    """Bytes one rank sends per optimizer step under the workload's strategy (pipeline/strategies/traffic.py)."""
    return STRATEGIES[work.strategy].traffic_bytes(shape, work)


def ignored_knobs(cfg: ModelConfig) -> list[str]:
    """The FSDP1 knobs set away from their defaults that the chosen strategy does not apply, as "--flag value"."""
    honoured = STRATEGIES[cfg.strategy].honoured_knobs(cfg)
    return [f"{flag(k)} {('on' if v else 'off') if isinstance(v, bool) else v}" for k, default in KNOB_DEFAULTS.items()
            if k not in honoured and (v := getattr(cfg, k)) != default]


def out_of_memory_hints(cfg: Config) -> str:
    """What to change when a step does not fit."""
    hints = ["a smaller --batch-size (with --grad-accum to keep the global batch)"]
    if not cfg.model.activation_checkpointing:
        hints.append("--activation-checkpointing on")
    hints += STRATEGIES[cfg.model.strategy].memory_hints(cfg.model)
    return f"try {', '.join(hints)}"
