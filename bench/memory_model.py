"""The memory estimator (pipeline/strategies/memory.py) vs measured peaks: fsdp1.py runs on the CPU, each rank's peak
resident memory above what it held before the model was built (the trainer's `peak_by_rank`, read from Linux's
VmHWM, reset at every log window), against the estimate the run logged at start. Rewrites the memory_model table
of BENCHMARKS.md.

    .venv/bin/python bench/memory_model.py [--seq 256]
    .venv/bin/python bench/memory_model.py --group adapters --seq 512

The first group (the strategies and their options) rewrites the memory_model table; `--group adapters` (full
fine-tuning, LoRA and QLoRA under ddp and fsdp2 with activation checkpointing at batch 2) the memory_adapters one.

Each case runs twice. "live": glibc told to serve every allocation above 128 KiB from its own mapping
(MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and it follows the bytes in use, as the
CUDA allocator's peak does; 3 steps. "default": glibc as it comes, which keeps freed memory for reuse (what a user's
`top` shows); 5 steps, to see where it settles. The model has SmolLM2-135M's shape (30 layers, hidden 576, GQA 9/3
heads, tied 49,152-row vocabulary) with random weights: large enough that its memory stands well above the noise of
the process. Steady state: the largest peak from step 2 on (step 1 also allocates AdamW's states). The estimate is
what the trainer logs at start for the same flags, computed from the code as it is (so --reuse after a change to
the estimator compares the new estimate with the peaks already measured).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import ROOT, demo_dataset, fsdp1, machine, memory_plan, table, update_section

from pipeline.train.telemetry import read_metrics

CASES: dict[str, tuple[int, list[object]]] = {
    "ddp fp32": (2, ["--strategy", "ddp"]),
    "fsdp2 fp32": (2, ["--strategy", "fsdp2"]),
    "fsdp2 fp32, vocab-parallel off": (2, ["--strategy", "fsdp2", "--vocab-parallel", "off"]),
    "fsdp2 fp32, activation checkpointing, batch 2": (2, ["--strategy", "fsdp2", "--activation-checkpointing", "on",
                                                          "--batch-size", 2]),
    "fsdp2 fp32, gradient accumulation 2": (2, ["--strategy", "fsdp2", "--grad-accum", 2]),
    "fsdp2 fp32, SHARD_GRAD_OP": (2, ["--strategy", "fsdp2", "--sharding", "SHARD_GRAD_OP"]),
    "fsdp1 fp32": (2, ["--strategy", "fsdp1"]),
    "manual fp32": (2, ["--strategy", "manual"]),
    "fsdp2 fp32, LoRA r16": (2, ["--strategy", "fsdp2", "--adapter", "lora"]),
    "ddp fp32, LoRA r16": (2, ["--strategy", "ddp", "--adapter", "lora"]),
    "fsdp2 fp32, DoRA r16": (2, ["--strategy", "fsdp2", "--adapter", "dora"]),
    "fsdp2 fp32, QLoRA r16": (2, ["--strategy", "fsdp2", "--adapter", "qlora"]),
    "ddp fp32, QLoRA r16": (2, ["--strategy", "ddp", "--adapter", "qlora"]),
}
AC2 = ["--activation-checkpointing", "on", "--batch-size", 2]
ADAPTER_CASES: dict[str, tuple[int, list[object]]] = {
    f"{strategy} fp32, {adapter or 'full'}, activation checkpointing, batch 2": (
        2, ["--strategy", strategy, *AC2, *(["--adapter", adapter] if adapter else [])])
    for adapter in ("", "lora", "qlora") for strategy in ("ddp", "fsdp2")}
GROUPS = {"strategies": ("memory_model", CASES), "adapters": ("memory_adapters", ADAPTER_CASES)}


MODES = {"live": ({"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}, 3), "default": ({}, 5)}


def measure(runs: Path, name: str, model: Path, data: Path, world: int, flags: list[object], seq: int,
            mode: str, reuse: bool) -> tuple[float, list[float]]:
    """The run's steady-state peak (GiB, largest rank) and its peak by step; --reuse: a finished run's figures."""
    env, steps = MODES[mode]
    run = f"{name.replace(' ', '_').replace(',', '')}-{mode}"
    metrics = runs / run / "metrics.jsonl"
    events = read_metrics(metrics) if reuse and metrics.exists() else []
    if not any(e["event"] == "train" and e["step"] == steps for e in events):
        _, events = fsdp1(runs, run, model, data, *run_flags(seq, steps, flags), world=world, env=env)
    train = [e for e in events if e["event"] == "train"]
    by_step = [max(e["mem_gb"]["peak_by_rank"]) for e in train]
    return max(by_step[1:]), by_step


def run_flags(seq: int, steps: int, flags: list[object]) -> list[object]:
    return ["--seq-length", seq, "--max-steps", steps, "--log-freq", 1, *flags]


def estimated(model: Path, world: int, flags: list[object], seq: int) -> dict:
    """What the trainer logs at start for this run (GiB by part), from the code as it is now."""
    return memory_plan(model, world, "--precision", "fp32", *run_flags(seq, 3, flags))[1].estimate.gib()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "memory")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--group", choices=sorted(GROUPS), default="strategies")
    p.add_argument("--only", nargs="*", default=None, help="case names to run (default: all)")
    p.add_argument("--reuse", action="store_true", help="take the peaks of runs already finished in --workdir")
    args = p.parse_args()
    from pipeline.prep.tiny import build_preset

    model = args.workdir / "smollm2-135m"
    if not (model / "config.json").exists():
        build_preset(model, "smollm2-135m")
    data = demo_dataset(args.workdir / "dataset")
    rows, worst = [], 0.0
    section, cases = GROUPS[args.group]
    for name, (world, flags) in cases.items():
        if args.only and name not in args.only:
            continue
        est = estimated(model, world, flags, args.seq)
        live, _ = measure(args.workdir / "runs", name, model, data, world, flags, args.seq, "live", args.reuse)
        rss, by_step = measure(args.workdir / "runs", name, model, data, world, flags, args.seq, "default",
                               args.reuse)
        error = est["total"] / live - 1
        worst = max(worst, abs(error))
        print(f"{name}: estimate {est['total']:.2f} GiB, live {live:.2f} ({error:+.0%}), default {rss:.2f} GiB "
              f"(by step {by_step})", flush=True)
        parts = " / ".join(f"{est[k]:.2f}" for k in ("weights", "gradients", "copies", "activations", "logits",
                                                      "update"))
        rows.append([name, world, parts, f"{est['total']:.2f}", f"{live:.2f}", f"{error:+.0%}", f"{rss:.2f}",
                     " / ".join(f"{x:.2f}" for x in by_step)])
    if args.only:
        return
    body = "\n".join([
        f"Machine: {machine()}. Command: `.venv/bin/python bench/memory_model.py --group {args.group} "
        f"--seq {args.seq}`. SmolLM2-135M's shape (random weights), batch 1 x seq {args.seq} unless stated, fp32 "
        "unless stated; measured: the largest rank's peak resident memory above what it held before the model was "
        "built, from step 2 on.",
        "",
        table(["run", "ranks", "estimate: weights+AdamW / gradients / copies / activations / logits / AdamW step "
               "(GiB)", "estimate GiB", "measured live GiB", "estimate vs live", "measured default GiB",
               "default by step"], rows),
        "",
        f"Largest disagreement with the live peak: {worst:.0%}.",
    ])
    update_section(section, body)


if __name__ == "__main__":
    main()
