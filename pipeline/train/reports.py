"""What a run reports besides its log windows: the profiled steps, a mixture's sources, and the completions an
online objective trained on."""

from __future__ import annotations

from pathlib import Path

from pipeline.data.sampler import MixtureSampler
from pipeline.train.telemetry import Telemetry, log


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
