"""--strategy auto, and the memory plan of every run: which strategy fits and moves the fewest bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pipeline.config import Config
from pipeline.distributed.launch import Launch
from pipeline.distributed.launch import detect as detect_launch
from pipeline.distributed.runtime import Dist, gather_objects
from pipeline.errors import UserError
from pipeline.model.router import balancing_coef
from pipeline.strategies.expert_parallel import degree, expert_parallel_asked
from pipeline.strategies.memory import GIB, Estimate, Shape, ShapeUnknown, Workload, device_bytes
from pipeline.strategies.registry import check_sequence_parallel, estimate, settle, traffic_bytes, workload
from pipeline.strategies.sequence_parallel import check_degree, refusal

AUTO_MARGIN = 0.2
"""--strategy auto takes a whole replica only when its estimate plus this share fits: the estimate's largest error
against the bytes measured in use is 15% (BENCHMARKS.md section 10), and on CPU glibc keeps freed memory for reuse
(ddp's resident set settles 16% above its bytes in use there)."""


@dataclass(frozen=True)
class MemoryPlan:
    """The strategy a run uses, what one rank is estimated to need under it, and what it may use."""

    config: Config
    """The run's config with --strategy auto (and so --sharding auto) resolved."""
    estimate: Estimate | None
    """None where the model's shape cannot be read (memory.ShapeUnknown): the run goes on without it."""
    budget: int
    """Bytes per rank: --memory-gb, or the device's."""
    reason: str
    """Why --strategy auto chose as it did ("" when the strategy was given)."""
    longest: dict[str, int] = field(default_factory=dict)
    """The longest --seq-length whose estimate fits the budget under the run's settings (key ""), and under each
    change that lengthens it (key: the flags); empty where there is no estimate or no block length (GRPO)."""


def plan_memory(cfg: Config, hf_config, device: str, launch: Launch | None = None,
                resident_params: int = 0) -> MemoryPlan:
    """Resolve --strategy auto and estimate the peak memory per rank; cfg itself is left as it is. No collective:
    every rank computes the same from the same config, launch environment and hardware. launch: the one planned
    for (fsdp1.py --nproc-per-node checks its workers' plan before starting them), else this process's.
    resident_params: other models' parameters every rank holds in the compute dtype (GRPO's reward models)."""
    launch = launch or detect_launch()
    # before joining; a launcher that does not say how many ranks share this host: plan as if all of them do
    world, local_world, local_rank = launch.world_size, launch.local_world_size or launch.world_size, launch.local_rank
    m = cfg.model
    budget = int(m.memory_gb * GIB) if m.memory_gb else device_bytes(device, local_world, local_rank)
    try:
        shape = Shape.of(hf_config)
    except ShapeUnknown as why:  # no estimate: fsdp2, which fits what any strategy fits, and the reason said
        chosen = "fsdp2" if m.strategy == "auto" else m.strategy
        reason = f"fsdp2: the model's memory cannot be estimated ({why})" if m.strategy == "auto" else ""
        return MemoryPlan(settle(replace(cfg, model=replace(m, strategy=chosen))), None, budget, reason)
    reason = ""
    if m.strategy == "auto":
        chosen, reason = choose(cfg, shape, budget, device, world, local_world, resident_params)
        cfg = replace(cfg, model=replace(m, strategy=chosen))
    cfg = settle(cfg)
    if m.sequence_parallel > 1:
        check_degree(m.sequence_parallel, world, cfg.data.seq_length)
    work = workload(cfg, device, world, local_world, resident_params)
    if cfg.model.strategy == "fsdp2":  # a degree the model or mesh cannot take: one line before any work
        degree(cfg.model, hf_config, work.shard_ranks, local_world)
    longest = {} if work.generation else longest_sequences(shape, work, budget, split_degree(cfg, hf_config, world))
    return MemoryPlan(cfg, estimate(shape, work), budget, reason, longest)


def longest_sequence(shape: Shape, work: Workload, budget: int) -> int:
    """The longest sequence, in steps of lcm(256, degree) tokens, whose estimated peak per rank fits budget at the
    workload's batch (0: not even one step). The estimate grows with the length; found by bisection, no model."""
    unit = math.lcm(256, work.sequence_parallel)
    fits = lambda units: estimate(shape, replace(work, seq_length=units * unit)).total <= budget  # noqa: E731
    low, high = 0, 1 << 16  # 16M tokens at most
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * unit


def split_degree(cfg: Config, hf_config, world: int) -> int:
    """The --sequence-parallel degree the longest-sequence line offers: the largest that divides the ranks where the
    run could take it (the refusals a run at that degree meets: registry.check_sequence_parallel,
    sequence_parallel.refusal, preflight's balancing-loss line), else 1."""
    m, text = cfg.model, hf_config.get_text_config()
    try:
        check_sequence_parallel(replace(cfg, model=replace(m, sequence_parallel=2)))
    except UserError:
        return 1
    if balancing_coef(m, hf_config):
        return 1
    kernel = "sdpa" if m.attn_implementation == "auto" else m.attn_implementation  # auto: sdpa or eager, both split
    return max(n for n in range(1, world + 1) if world % n == 0 and (n == 1 or not refusal(text, n, kernel)))


def longest_sequences(shape: Shape, work: Workload, budget: int, degree: int) -> dict[str, int]:
    """MemoryPlan.longest: the run's own, and with each of activation checkpointing, the tiled MLP, sequence
    parallelism over the most ranks that divide (degree) and (on a GPU) activation offloading where the run has them
    off, and with all of them."""
    changes = {}
    if not work.activation_checkpointing:
        changes["--activation-checkpointing on"] = {"activation_checkpointing": True, "selective_checkpointing": False}
    if not work.tiled_mlp and not shape.layer_experts:  # a mixture of experts' MLP is not tiled
        changes["--tiled-mlp on"] = {"tiled_mlp": True}
    if work.sequence_parallel == 1 and degree > 1:
        changes[f"--sequence-parallel {degree}"] = {"sequence_parallel": degree}
    if not work.offload_activations and work.device == "cuda":
        changes["--offload-activations on"] = {"offload_activations": True}
    if len(changes) > 1:
        changes[" ".join(changes)] = {k: v for change in changes.values() for k, v in change.items()}
    return {"": longest_sequence(shape, work, budget),
            **{flags: longest_sequence(shape, replace(work, **change), budget) for flags, change in changes.items()}}


def check_agreed(cfg: Config, d: Dist) -> None:
    """Refuse, on every rank, ranks that resolved --strategy auto differently: each plans with its own device's memory
    before the group exists, so nodes whose memory differs near the boundary would build different wrappers whose
    collectives never match. A collective every rank must reach."""
    if d.world_size == 1:
        return
    views = gather_objects(f"{cfg.model.strategy} {cfg.model.sharding}")
    if len(set(views)) > 1:
        seen = "; ".join(f"rank(s) {', '.join(str(r) for r, v in enumerate(views) if v == choice)}: {choice}"
                         for choice in dict.fromkeys(views))
        raise UserError(f"--strategy auto chose differently on different ranks ({seen}), whose memory differs; "
                        "pass --strategy, or --memory-gb with the smallest rank's memory")


def choose(cfg: Config, shape: Shape, budget: int, device: str, world: int, local_world: int,
           resident_params: int = 0) -> tuple[str, str]:
    """--strategy auto: of ddp and fsdp2, the one that moves fewer bytes per step (ddp on a tie: it has no gather
    copies), among those whose estimated peak fits the budget; fsdp2 when the settings given need it, or on one rank.
    Checked against the four strategies by bench/strategy_auto.py (BENCHMARKS.md section 11)."""
    m = cfg.model
    if m.sharding not in ("auto", "NO_SHARD") or m.cpu_offload or m.vocab_parallel == "on" or \
            expert_parallel_asked(m):
        return "fsdp2", ("fsdp2: the settings given (sharding, CPU offload, vocabulary or expert parallelism) need "
                         "it")
    if world == 1 and m.adapter == "qlora":
        return "ddp", "ddp: fsdp2 on one rank cannot rebuild the NF4 weights of --adapter qlora"
    if world == 1:
        # Nothing to communicate either way; fsdp2's chunked loss keeps the full-width logits out of memory, which
        # let one H100 train Llama-3.2-1B at batch 8 x 2048 where the model's own loss ran out (BENCHMARKS.md 6).
        return "fsdp2", "fsdp2: one rank moves nothing, and fsdp2's chunked loss never builds full-width logits"
    ddp, fsdp2 = (workload(replace(cfg, model=replace(m, strategy=s, sharding=sh)), device, world, local_world,
                           resident_params) for s, sh in (("ddp", "NO_SHARD"), ("fsdp2", "FULL_SHARD")))
    need = estimate(shape, ddp).total
    if need * (1 + AUTO_MARGIN) > budget:
        return "fsdp2", (f"fsdp2: a whole replica would need {need / GIB:.2f} GiB per rank, {AUTO_MARGIN:.0%} more "
                         f"to be safe, of {budget / GIB:.2f} GiB")
    moved = {"ddp": traffic_bytes(shape, ddp), "fsdp2": traffic_bytes(shape, fsdp2)}
    pick = "ddp" if moved["ddp"] <= moved["fsdp2"] else "fsdp2"
    other = "fsdp2" if pick == "ddp" else "ddp"
    return pick, (f"{pick}: a whole replica fits ({need / GIB:.2f} GiB per rank, {AUTO_MARGIN:.0%} more to be safe, of "
                  f"{budget / GIB:.2f}) and {pick} "
                  f"moves {moved[pick] / 2**20:.0f} MiB per step per rank, {other} {moved[other] / 2**20:.0f} MiB")
