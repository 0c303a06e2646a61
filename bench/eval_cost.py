"""What validating the base at step 0 (--eval-base on, the default) and --sample-prompts cost against a training step.

Each model trains a few steps under ddp (2 ranks, fp32, CPU) with the step-0 validation and the bundled text prompts
(examples/prompts/text.jsonl, --sample-max-tokens 16); the figures are the eval events' own clocks (`seconds`: the
pass over the validation blocks; `sample_seconds`: the greedy completions) and the median interval between steps
after --discard. Cases: the demo's tiny model at its config's shape (seq 128, batch 2) and SmolLM2-135M's shape
(30 layers, hidden 576, random weights) at --seq. Rewrites the eval_cost table of BENCHMARKS.md.

    .venv/bin/python bench/eval_cost.py [--seq 256 --steps 6]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import ROOT, demo_dataset, fsdp1, intervals, machine, table, update_section

PROMPTS = ROOT / "examples" / "prompts" / "text.jsonl"
SAMPLE_TOKENS = 16


def measured(runs: Path, name: str, model: Path, data: Path, seq: int, batch: int, args: argparse.Namespace) -> list:
    """One table row: the validation blocks, step-0 validation and sampling seconds, the step, and their ratio."""
    _, events = fsdp1(runs, name, model, data, "--strategy", "ddp", "--seq-length", seq, "-b", batch,
                      "--val-fraction", 0.05, "--max-steps", args.steps, "--log-freq", 1, "--sample-prompts", PROMPTS,
                      "--sample-max-tokens", SAMPLE_TOKENS)
    base = next(e for e in events if e["event"] == "eval" and e["step"] == 0)
    train = [e for e in events if e["event"] == "train"]
    step = statistics.median(intervals([e["time"] for e in train], args.discard))
    blocks = _val_blocks(runs / name / "train.log")
    prompts = sum(1 for e in events if e["event"] == "sample" and e["step"] == 0)
    return [f"{batch} x {seq}", blocks, f"{base['seconds']:.2f}", f"{base['sample_seconds']:.2f} ({prompts} x up "
            f"to {SAMPLE_TOKENS} tokens)", f"{step:.3f}", f"{base['seconds'] / step:.1f}",
            f"{base['sample_seconds'] / step:.1f}"]


def _val_blocks(log: Path) -> str:
    """The validation block count the run logged at start ("936 train / 49 val blocks")."""
    for line in log.read_text().splitlines():
        if " val blocks of " in line:
            return line.split(" val blocks of ")[0].rsplit("/ ", 1)[1]
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "eval_cost")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--discard", type=int, default=2)
    args = p.parse_args()
    from pipeline.prep.tiny import build_preset, build_tiny

    args.workdir.mkdir(parents=True, exist_ok=True)
    smol, tiny = args.workdir / "smollm2-135m", args.workdir / "tiny-llama"
    if not (smol / "config.json").exists():
        build_preset(smol, "smollm2-135m")
    if not (tiny / "config.json").exists():
        build_tiny(tiny)
    data = demo_dataset(args.workdir / "dataset")
    runs = args.workdir / "runs"
    rows = [["the demo's tiny model (2 layers, hidden 64)", *measured(runs, "tiny", tiny, data, 128, 2, args)],
            ["SmolLM2-135M shape (30 layers, hidden 576)", *measured(runs, "smollm2", smol, data, args.seq, 1, args)]]
    for row in rows:
        print(row, flush=True)
    update_section("eval_cost", "\n".join([
        f"Machine: {machine()}. Command: `.venv/bin/python bench/eval_cost.py`. ddp, 2 ranks, fp32, the demo corpus "
        f"(--val-fraction 0.05, the demo's), {args.steps} steps (the step: the median interval after {args.discard}); "
        "the step-0 validation and the samples are timed by the run itself (the eval event's `seconds` and "
        "`sample_seconds`). Samples have no KV cache: each token is one forward over the sequence so far.",
        "",
        table(["model", "batch x seq", "val blocks", "step-0 validation (s)", "samples (s)", "step (s)",
               "validation in steps", "samples in steps"], rows),
    ]))


if __name__ == "__main__":
    main()
