"""Start-up: time to the first training step and peak host RSS per rank while loading, against
`from_pretrained` of the whole model in one process.

fsdp1.py builds the model on the meta device, shards it, allocates each rank's shards and reads only those
slices from the safetensors files. "While loading" is everything until each rank logs its model line, just
before the first step (train.log), so the optimizer states and gathered parameters of step 1 are not counted.
The constant (interpreter, torch, transformers, datasets, gloo, tokenizer, token cache) is measured the same
way with the bundled tiny model, whose weights are a few hundred KB.

    .venv/bin/python bench/startup.py --repeats 2
"""

from __future__ import annotations

import json
import statistics
import sys
from datetime import datetime
from pathlib import Path

from common import (
    bar_chart,
    bench_args,
    bench_env,
    build_model,
    demo_dataset,
    fsdp1,
    launch,
    machine,
    spread,
    table,
    update_section,
)

BASELINE = """
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def ours(work: Path, model: Path, data: Path, world: int) -> dict:
    out, events = fsdp1(work / "runs", "startup", model, data, "--seq-length", 128, "-b", 1, "--max-steps", 3,
                        "--log-freq", 1, "--ckpt-freq", 0, "--async-ckpt", "off", world=world)
    ends = [e["time"] for e in events if e["event"] == "train"]
    until = loaded(work / "runs" / "startup")
    peak = max(out.peak_rss_gb(until=until)[:world])
    return {"ready": until - out.started, "first_step": ends[0] - out.started, "peak_gb": peak}


def loaded(run: Path) -> float:
    """When the last rank logged its model line: built, loaded, resumed, about to train (train.log, local time)."""
    stamps = [line[:23] for line in (run / "train.log").read_text().splitlines() if " INFO model " in line]
    return max(datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp() for s in stamps)


def baseline(model: Path) -> dict:
    """RSS sampled from outside, as for fsdp1.py."""
    out = launch([sys.executable, "-c", BASELINE, str(model)], bench_env())
    seconds = json.loads(out.output.strip().splitlines()[-1])["seconds"]
    return {"seconds": seconds, "peak_rss_gb": max(out.peak_rss_gb())}


def model_gb(model: Path) -> float:
    return sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e9


def main() -> None:
    from pipeline.prep.tiny import build_tiny

    p = bench_args(__doc__, repeats=2, layers=4, hidden=1024)
    args = p.parse_args()
    work = args.workdir
    big = build_model(args)
    tiny = work / "tiny" if (work / "tiny" / "config.json").exists() else build_tiny(work / "tiny")
    data = demo_dataset(work / "dataset")
    ours(work, big, data, args.world)  # token caches built outside the measured runs
    ours(work, tiny, data, args.world)
    runs = {"big": [], "tiny": [], "baseline": []}
    for _ in range(args.repeats):
        runs["big"].append(ours(work, big, data, args.world))
        runs["tiny"].append(ours(work, tiny, data, args.world))
        runs["baseline"].append(baseline(big))
    report(args, big, runs)


def report(args, model: Path, runs: dict[str, list[dict]]) -> None:
    size = model_gb(model)
    constant = statistics.median(r["peak_gb"] for r in runs["tiny"])
    peak = statistics.median(r["peak_gb"] for r in runs["big"])
    bound = 1.2 * size / args.world + constant
    rows = [[f"fsdp1.py, {args.world} ranks (per rank)", spread([r["ready"] for r in runs["big"]], 1),
             spread([r["first_step"] for r in runs["big"]], 1), spread([r["peak_gb"] for r in runs["big"]], 2)],
            [f"fsdp1.py, {args.world} ranks, tiny model (C)", spread([r["ready"] for r in runs["tiny"]], 1),
             spread([r["first_step"] for r in runs["tiny"]], 1), spread([r["peak_gb"] for r in runs["tiny"]], 2)],
            ["from_pretrained, whole model, 1 process", spread([r["seconds"] for r in runs["baseline"]], 1), "-",
             spread([r["peak_rss_gb"] for r in runs["baseline"]], 2)]]
    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/startup.py --repeats {args.repeats}` (part of `make bench`).",
        f"- Model: Llama, {args.layers} layers, hidden {args.hidden}, vocab 128,256, tied, fp32 safetensors of "
        f"{size:.2f} GB; token cache already built.",
        "",
        table(["what", "launch to loaded, s", "launch to first step end, s", "peak RSS while loading, GB"], rows),
        "",
        f"Per-rank peak {peak:.2f} GB against the target 1.2 x {size:.2f} / {args.world} + C ({constant:.2f}) = "
        f"{bound:.2f} GB: **{'met' if peak <= bound else 'not met'}**. Weights above the constant: "
        f"{peak - constant:.2f} GB per rank for a {size / args.world:.2f} GB share.",
        "",
        bar_chart("startup_rss_cpu", "Peak host RSS while loading (GB, lower is better)",
                  [f"fsdp1.py per rank ({args.world} ranks)", "fsdp1.py constant C (tiny model)",
                   "from_pretrained, 1 process"],
                  [peak, constant, statistics.median(r["peak_rss_gb"] for r in runs["baseline"])], "GB"),
    ])
    update_section("startup_cpu", body)
    print(body)


if __name__ == "__main__":
    main()
