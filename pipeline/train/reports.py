"""What a run reports besides its log windows: its plan and data at the start, the profiled steps, a mixture's
sources, and the completions an online objective trained on."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import Config
from pipeline.data.sampler import MixtureSampler
from pipeline.model.modeling import untested_family
from pipeline.strategies.base import Strategy
from pipeline.strategies.memory import GIB
from pipeline.strategies.registry import ignored_knobs, out_of_memory_hints
from pipeline.train.telemetry import Telemetry, log

if TYPE_CHECKING:
    from pipeline.train.preflight import Plan


def log_plan(plan: Plan, cfg: Config) -> None:
    """Rank 0's start: the strategy (and why, when auto chose it), knobs it ignores, and the memory estimate."""
    mem, m = plan.memory, cfg.model
    if why := untested_family(plan.hf_config):
        log.warning("%s; attempting it", why)
    if mem.reason:
        log.info("--strategy auto chose %s", mem.reason)
    if ignored := ignored_knobs(m):
        log.warning("%s: no effect under --strategy %s", ", ".join(ignored), m.strategy)
    if mem.estimate is None:
        log.info("estimated peak memory per rank: not available for this model; budget %.2f GiB", mem.budget / GIB)
        return
    longest = f"; the longest sequence that fits it: {mem.longest['']:,} tokens at batch {cfg.train.batch_size}" \
        if mem.longest else ""
    log.info("estimated peak memory per rank: %s; budget %.2f GiB%s", mem.estimate.describe(), mem.budget / GIB,
             longest)
    if mem.estimate.total > mem.budget:
        log.warning("the estimate is above the budget: %sif a step runs out of memory, %s",
                    longer_with(mem.longest, cfg.data.seq_length), out_of_memory_hints(cfg))


def longer_with(longest: dict[str, int], seq_length: int) -> str:
    """The flags that would fit this --seq-length by the estimate, each with the longest it would then fit ("" where
    none would, or there is no block length)."""
    fitting = [f"{flags} ({n:,})" for flags, n in longest.items() if flags and n >= seq_length]
    if not fitting:
        return ""
    return f"--seq-length {seq_length:,} would fit with {'; or '.join(fitting)}; "


def data_line(train: int, val: int, seq_length: int, global_batch: int, generations: int) -> str:
    """The start line's data part: blocks of --seq-length tokens, or (an objective that generates: generations > 0
    completions per prompt) prompts."""
    if generations:
        return (f"{train} train / {val} val prompts; global batch {global_batch} prompts "
                f"({global_batch * generations} completions)")
    return f"{train} train / {val} val blocks of {seq_length} tokens; global batch {global_batch} blocks"


def experts_part(strategy: Strategy) -> str:
    """The start line's note on a mixture of experts' routed experts: how many of the trainable parameters are
    theirs ("" for a dense model), so experts left frozen show as 0."""
    if not strategy.num_expert_params:
        return ""
    return f", of which {strategy.num_trainable_experts:,} in experts"


def log_profile(telemetry: Telemetry, summary: dict, step: int, run_dir: Path) -> None:
    """The profiled steps' split by kind of work and memory, as an event and a log line (the kernels: the file)."""
    split = {kind: part["share"] for kind, part in summary["split"].items()}
    telemetry.event("profile", step, step_ms=summary["step_ms"], split=split, memory=summary.get("memory"),
                    path=str(run_dir / "profile" / "profile.json"))
    shares = ", ".join(f"{kind} {share:.0%}" for kind, share in split.items() if share >= 0.005)
    log.info("profile of steps %d-%d: %.1f ms a step (%s); kernels and trace in %s", summary["first_step"],
             step, summary["step_ms"], shares, run_dir / "profile")


def log_mixture(telemetry: Telemetry, sampler: MixtureSampler, sources: list, seq: int, step: int,
                is_main: bool) -> None:
    """What each source of a mixture gave the run: blocks, tokens, their share and the epochs of it."""
    drawn, sizes = sampler.drawn, sampler.sizes
    total = max(sum(drawn), 1)
    shares = {s.name: {"blocks": n, "tokens": n * seq, "share": round(n / total, 6), "epochs": round(n / size, 4)}
              for s, n, size in zip(sources, drawn, sizes, strict=True)}
    telemetry.event("mixture", step, sources=shares)
    if is_main:
        log.info("mixture over %d steps: %s", step, "; ".join(
            f"{name} {v['tokens']:,} tokens ({100 * v['share']:.1f}%, {v['epochs']:.2f} epochs of it)"
            for name, v in shares.items()))


def log_samples(telemetry: Telemetry, samples: list[dict], step: int) -> None:
    """Completions an online objective trained on (rank 0's first), with their rewards: to the samples log and
    TensorBoard's text tab (the trackers' text where they have it)."""
    for index, sample in enumerate(samples):
        telemetry.event("sample", step, tracked=False, index=index, **sample)
        rewards = ", ".join(f"{k} {v}" for k, v in sample["rewards"].items())
        telemetry.text(f"completion/{index}", step, f"{sample['prompt']}\n-> {sample['completion']}\n"
                                                    f"reward {sample['reward']:.4f} ({rewards})")
