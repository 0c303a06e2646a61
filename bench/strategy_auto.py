"""--strategy auto against the four strategies it chooses among: is its choice the fastest one that fits?

Each model trains a few steps under fsdp2, fsdp1, ddp and manual (2 ranks, fp32, CPU; steady-state seconds per
step: the median interval after --discard steps, and each rank's peak memory, glibc as it comes); auto's choice is
what `pipeline.strategies.auto.plan_memory` resolves for the same flags and launch. Cases: the head-heavy 2-layer model
with Llama 3's 128k vocabulary; SmolLM2-135M's shape with this machine's memory; the same model on a device of
--small-device-gb (passed as --memory-gb: the budget auto plans for), where a whole replica no longer fits.
Rewrites the strategy_auto table of BENCHMARKS.md.

    .venv/bin/python bench/strategy_auto.py [--seq 256 --steps 7]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import ROOT, build_model, demo_dataset, fsdp1, intervals, machine, memory_plan, table, update_section

STRATEGIES = ("ddp", "fsdp2", "fsdp1", "manual")


def timed(runs: Path, name: str, model: Path, data: Path, strategy: str, args: argparse.Namespace) -> dict:
    _, events = fsdp1(runs, f"{name}-{strategy}", model, data, "--strategy", strategy, "--seq-length", args.seq,
                      "--max-steps", args.steps, "--log-freq", 1)
    train = [e for e in events if e["event"] == "train"]
    comm = [e["time_ms"].get("comm") for e in train[args.discard:]]
    return {"step_s": statistics.median(intervals([e["time"] for e in train], args.discard)),
            "comm_s": None if None in comm else statistics.median(comm) / 1000,
            "peak_gb": max(max(e["mem_gb"]["peak_by_rank"]) for e in train[1:])}


def cell(r: dict, fits: bool) -> str:
    comm = "" if r["comm_s"] is None else f" (comm {r['comm_s']:.3f})"
    return f"{r['step_s']:.3f} s{comm}, {r['peak_gb']:.2f} GiB{'' if fits else ' (does not fit)'}"


def auto_choice(model: Path, seq: int, memory_gb: float) -> str:
    cfg, plan = memory_plan(model, 2, "--strategy", "auto", "--precision", "fp32", "--seq-length", seq,
                            "--memory-gb", memory_gb)
    return f"{cfg.model.strategy} ({plan.estimate.total / 2**30:.2f} GiB estimated; {plan.reason})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "auto")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--discard", type=int, default=2)
    p.add_argument("--small-device-gb", type=float, default=2.0)
    args = p.parse_args()
    from pipeline.prep.tiny import build_preset

    args.workdir.mkdir(parents=True, exist_ok=True)
    smol = args.workdir / "smollm2-135m"
    if not (smol / "config.json").exists():
        build_preset(smol, "smollm2-135m")
    head_heavy = build_model(argparse.Namespace(workdir=args.workdir, layers=2, hidden=256))
    data = demo_dataset(args.workdir / "dataset")
    runs = args.workdir / "runs"
    measured = {name: {s: timed(runs, name, model, data, s, args) for s in STRATEGIES}
                for name, model in (("head-heavy", head_heavy), ("smollm2", smol))}
    cases = [("2 layers x hidden 256, 128k vocabulary (head-heavy)", "head-heavy", head_heavy, 0.0),
             ("SmolLM2-135M shape, this machine's memory", "smollm2", smol, 0.0),
             (f"SmolLM2-135M shape, a {args.small_device_gb:g} GiB device", "smollm2", smol, args.small_device_gb)]
    rows = []
    for label, name, model, budget in cases:
        results = measured[name]
        fits = {s: r for s, r in results.items() if not budget or r["peak_gb"] <= budget}
        fastest = min(fits, key=lambda s: fits[s]["step_s"])
        cells = [cell(r, s in fits) for s, r in results.items()]
        rows.append([label, *cells, auto_choice(model, args.seq, budget), fastest])
        print(label, rows[-1][1:], flush=True)
    update_section("strategy_auto", "\n".join([
        f"Machine: {machine()}. Command: `.venv/bin/python bench/strategy_auto.py`. 2 ranks, fp32, batch 1 x seq "
        f"{args.seq}, {args.steps} steps (median interval after {args.discard}; comm: the median `time_ms.comm`, "
        "absent under fsdp1); peak: the largest rank's resident memory above what it held before the model was built, "
        "from step 2 on.",
        "",
        table(["model and device", *STRATEGIES, "--strategy auto chose", "fastest that fits (measured)"], rows),
    ]))


if __name__ == "__main__":
    main()
