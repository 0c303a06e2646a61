"""GRPO speed and memory: fsdp1.py --objective grpo against TRL's GRPOTrainer, both generating in the training
processes.

Section `grpo_speed`: SmolLM2-135M's shape (random weights, the bundled tokenizer), fp32, 2 gloo processes on CPU,
full fine-tuning under DDP (TRL's default under torchrun), ours without checkpointing and with
--selective-checkpointing (TRL checkpoints whole layers by default), and also under fsdp2 (parameters, gradients
and AdamW state sharded; gathered once per generation, Strategy.gathered), the bundled arithmetic prompts
(examples/grpo/prompts), G completions per prompt of exactly --max-completion-length tokens (a random model never
stops early, so both generate the same number of tokens), 2 prompts per process per step, the same reward
(examples/grpo/rewards.py's digits), beta 0, dapo, constant learning rate. Per system: completions per second over
the steady steps (the median step's), the median step's seconds spent generating (and scoring) and training, and each
process's peak RSS (the largest of the two).

    .venv/bin/python bench/grpo_speed.py              # rewrites BENCHMARKS.md's grpo_speed section
    .venv/bin/python bench/grpo_speed.py --rounds 2   # each system twice, in reversed order the second time
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import BENCH, ROOT, bench_env, fsdp1, launch, machine, table, torchrun_cmd, update_section

PROMPTS = ROOT / "examples" / "grpo" / "prompts" / "prompts.jsonl"


def prompts_dataset(work: Path) -> Path:
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    out = work / "prompts"
    if not (out / "state.json").exists():
        build_dataset(CorpusConfig(PROMPTS.parent, out, num_proc=1, overwrite=True))
    return out


def rollout_flags(group: int, length: int, prompts: int, steps: int) -> list[object]:
    """fsdp1.py's GRPO flags of this bench and gpu-check's grpo part: the digits reward on the bundled prompts, a
    constant small learning rate, a log line per step, no checkpoints and no validation."""
    return ["--objective", "grpo", "--reward", ROOT / "examples" / "grpo" / "rewards.py:digits", "--num-generations",
            group, "--max-completion-length", length, "-b", prompts, "--max-steps", steps, "--log-freq", 1,
            "--ckpt-freq", 0, "--async-ckpt", "off", "--val-fraction", 0, "--lr", 1e-6, "--warmup-steps", 0,
            "--lr-schedule", "constant", "--max-grad-norm", 1.0]


def step_seconds(steady: list[dict]) -> tuple[float, float]:
    """(step, generating and scoring) in seconds: the median gap between consecutive train events, and the median
    generation of the steps those gaps end with."""
    gaps = [b["time"] - a["time"] for a, b in zip(steady[:-1], steady[1:], strict=True)]
    return statistics.median(gaps), statistics.median(e["time_ms"]["generate"] / 1000 for e in steady[1:])


def ours(args, model: Path, data: Path, strategy: str, *flags: str) -> dict:
    out, events = fsdp1(args.workdir / "runs", "grpo-speed", model, data, *flags, "--strategy", strategy,
                        *rollout_flags(args.group, args.length, args.prompts, args.steps))
    step, generate = step_seconds([e for e in events if e["event"] == "train"][args.discard:])
    return {"step_s": step, "generate_s": generate, "completions": args.group * args.prompts * args.world,
            "peak_rss_gb": max(out.peak_rss_gb()[:args.world])}


def trl(args, model: Path) -> dict:
    result = args.workdir / "trl_grpo.json"
    result.unlink(missing_ok=True)
    out = launch(torchrun_cmd(args.world, BENCH / "trl_grpo_worker.py", "--model", model, "--prompts", PROMPTS,
                              "--out", result, "--num-generations", args.group, "--max-completion-length",
                              args.length, "--prompts-per-process", args.prompts, "--max-steps", args.steps),
                 bench_env(), timeout=3600)
    r = json.loads(result.read_text())
    ends = r["step_end"][args.discard:]
    gaps = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]
    return {"step_s": statistics.median(gaps), "generate_s": statistics.median(r["generate_s"][args.discard + 1:]),
            "completions": r["completions_per_step"], "peak_rss_gb": max(out.peak_rss_gb()[:args.world])}


def over_rounds(runs: list[dict]) -> dict:
    """One system's figures over its rounds: the median step and generation, the largest peak."""
    return {"step_s": statistics.median(r["step_s"] for r in runs),
            "generate_s": statistics.median(r["generate_s"] for r in runs),
            "completions": runs[0]["completions"], "peak_rss_gb": max(r["peak_rss_gb"] for r in runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "grpo")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--length", type=int, default=32, help="tokens per completion")
    p.add_argument("--prompts", type=int, default=2, help="prompts per process per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--discard", type=int, default=2, help="warm-up steps left out")
    p.add_argument("--rounds", type=int, default=1, help="every system run this many times, the order reversed each "
                   "round (the machine's drift between runs moved the ratio by 10%%); figures are medians over rounds")
    args = p.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    from pipeline.prep.tiny import build_preset

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.workdir / "smollm2-135m"
    if not (model / "config.json").exists():
        build_preset(model, "smollm2-135m")
    data = prompts_dataset(args.workdir)
    selective = ("--selective-checkpointing", "on")
    systems = {"ours, ddp": ("ddp",), "ours, ddp, selective checkpointing": ("ddp", *selective),
               "ours, fsdp2 (FULL_SHARD), selective checkpointing": ("fsdp2", *selective),
               "TRL GRPOTrainer (DDP)": None}
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(args.rounds):
        for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
            spec = systems[name]
            rounds[name].append(trl(args, model) if spec is None else ours(args, model, data, *spec))
            print(f"round {r + 1}", name, rounds[name][-1], flush=True)
    results = {name: over_rounds(runs) for name, runs in rounds.items()}
    rows = []
    for name, r in results.items():
        rows.append([name, f"{r['completions'] / r['step_s']:.2f}", f"{r['step_s']:.2f}", f"{r['generate_s']:.2f}",
                     f"{r['step_s'] - r['generate_s']:.2f}", f"{r['peak_rss_gb']:.2f}"])
        print(name, r, flush=True)
    t = results["TRL GRPOTrainer (DDP)"]

    def against_trl(name: str) -> str:
        o = results[name]
        speed = (o["completions"] / o["step_s"]) / (t["completions"] / t["step_s"])
        each = [trl_run["step_s"] / run["step_s"] for run, trl_run in
                zip(rounds[name], rounds["TRL GRPOTrainer (DDP)"], strict=True)]
        per_round = f" (round by round: {', '.join(f'{x:.3f}x' for x in each)})" if args.rounds > 1 else ""
        return f"{name}: {speed:.3f}x TRL's completions per second{per_round} at " \
               f"{o['peak_rss_gb'] / t['peak_rss_gb']:.3f}x its peak memory per process."

    body = "\n".join([
        "`.venv/bin/python bench/grpo_speed.py` on " + machine() + ".",
        "",
        f"SmolLM2-135M's shape (random weights), fp32, {args.world} processes (DDP, gloo), {args.prompts} prompts per "
        f"process per step x G {args.group} completions of {args.length} tokens, {args.steps} steps (the first "
        f"{args.discard} left out), the digits reward, beta 0, dapo"
        + (f"; {args.rounds} rounds, the systems' order reversed each round, medians over rounds." if args.rounds > 1
           else "."),
        "",
        table(["system", "completions/s", "step (s)", "generating and scoring (s)", "training (s)",
               "peak RSS per process (GB)"], rows),
        "",
        *(line for name in results if name.startswith("ours") for line in (against_trl(name), "")),
        "TRL runs at its defaults but those named (its gradient checkpointing on: each layer recomputed whole); ours "
        "without checkpointing, and with --selective-checkpointing (each layer's matrix products and attention kept, "
        "the rest recomputed).",
    ])
    update_section("grpo_speed", body)


if __name__ == "__main__":
    main()
