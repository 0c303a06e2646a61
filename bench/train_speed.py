"""Training throughput: fsdp1.py against the Hugging Face Trainer, and against the bare-PyTorch limit.

Same model (random weights, Llama 3's 128k vocabulary, a small body), the same packed blocks (fsdp1.py's token
cache, read by the HF worker too), batch, seq length, AdamW (betas 0.9/0.95, no decay), warmup+cosine lr,
clipping 1.0, precision and number of processes. Runs of the two systems alternate; each is launched fresh with
torchrun. Steady-state seconds per step are the median of the per-step intervals after --discard warm-up steps
(fsdp1.py logs every step; the HF worker records every step's end). Start-up is the time from launch to the end of
the first step. Peak memory is the largest peak RSS of a worker process, sampled every 20 ms from outside.

    .venv/bin/python bench/train_speed.py --repeats 3
    .venv/bin/python bench/train_speed.py --preset smollm2-135m --seq 256 --steps 10 --discard 3 --repeats 1

--preset trains a real model's shape instead (pipeline.tiny presets, random weights) and writes its own table,
train_speed_PRESET_PRECISION; --precision bf16 is autocast over fp32 weights on both sides; --strategy is passed to
fsdp1.py (default: its own default); --adapter lora trains LoRA r16 (alpha 32, every linear layer of the blocks) on
all three, the HF Trainer and the bare worker through peft's get_peft_model.

The HF Trainer reads the blocks in fsdp1.py's order (bench/hf_worker.py), so both train on the same batches and their
per-step losses are compared: the first step's (the same batch through the same initial model) and the largest
difference over the run. Every run's figures go to bench/data/SECTION.json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import (
    BENCH,
    ROOT,
    bar_chart,
    bench_args,
    bench_env,
    build_model,
    demo_dataset,
    fsdp1,
    intervals,
    launch,
    machine,
    spread,
    step_args,
    step_medians,
    table,
    torchrun_cmd,
    update_section,
)


def ours_flags(args) -> list[object]:
    strategy = ["--strategy", args.strategy] if args.strategy else []
    adapter = ["--adapter", args.adapter, "--lora-rank", 16, "--lora-alpha", 32] if args.adapter != "none" else []
    return ["--precision", args.precision, *strategy, *adapter]


def run_ours(args, work: Path, model: Path, data: Path, name: str) -> dict:
    out, events = fsdp1(work / "runs", name, model, data, "--seq-length", args.seq, "-b", args.batch, "--max-steps",
                        args.steps, "--log-freq", 1, "--ckpt-freq", 0, "--async-ckpt", "off", *ours_flags(args),
                        world=args.world)
    chosen = next((e["strategy"] for e in events if e["event"] == "memory"), "?")
    trains = [e for e in events if e["event"] == "train"]
    ends = [e["time"] for e in trains]
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    return {"steps": intervals(ends, args.discard), "first_step": ends[0] - out.started,
            "loss": [e["loss"] for e in trains],
            "peak_rss_gb": max(out.peak_rss_gb()[: args.world]), "strategy": chosen}


def token_cache(args, work: Path, model: Path, data: Path) -> Path:
    """train.npy of the cache fsdp1.py built for these runs (its defaults: val fraction 0.01, seed 0)."""
    from datasets import load_from_disk

    from pipeline.data.dataset import BlockSpec, dataset_fingerprint
    from pipeline.data.token_cache import token_cache_dir

    fingerprint = dataset_fingerprint(load_from_disk(str(data)))
    cache = token_cache_dir(work / "runs" / "token_cache", fingerprint, model, BlockSpec(args.seq, 0.01, 0))
    return cache / "train.npy"


def run_hf(args, work: Path, model: Path, blocks: Path) -> dict:
    result = work / "hf.json"
    cmd = torchrun_cmd(args.world, BENCH / "hf_worker.py", "--model", model, "--blocks", blocks, "--out", result,
                       "--batch-size", args.batch, "--max-steps", args.steps, "--lr", 3e-4, "--warmup-steps", 5,
                       "--seed", 0,
                       *(["--bf16"] if args.precision == "bf16" else []),
                       *(["--lora-rank", 16, "--lora-alpha", 32] if args.adapter != "none" else []))
    out = launch(cmd, bench_env())
    r = json.loads(result.read_text())
    ends = r["step_end"]
    return {"steps": intervals(ends, args.discard), "first_step": ends[0] - out.started, "loss": r["loss"],
            "peak_rss_gb": max(out.peak_rss_gb()[: args.world]), "wrapper": r["wrapper"],
            "distributed": r["distributed"]}


def run_bare(args, model: Path, blocks: Path, thp: bool, strategy: str) -> dict:
    """One rank's share of the step ours ran: its forward and backward, and its part of the update (all of it under
    ddp, which replicates the optimizer; 1/world where the strategy shards it)."""
    env = bench_env(THP_MEM_ALLOC_ENABLE="1" if thp else "0")
    proc = subprocess.run([sys.executable, str(BENCH / "bare_worker.py"), "--model", str(model), "--blocks",
                           str(blocks), "--batch-size", str(args.batch), "--world", str(args.world),
                           *(["--bf16"] if args.precision == "bf16" else []),
                           *(["--lora-rank", "16", "--lora-alpha", "32"] if args.adapter != "none" else [])],
                          env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    update_share = 1 if strategy == "ddp" else 1 / args.world
    return {"share": statistics.median(r["fwd_bwd_s"]) + statistics.median(r["update_s"]) * update_share,
            "fwd_bwd": statistics.median(r["fwd_bwd_s"]), "update": statistics.median(r["update_s"])}


def main() -> None:
    p = bench_args(__doc__, repeats=3, layers=2, hidden=256)
    step_args(p, seq=128, batch=2, steps=20, discard=5)
    p.add_argument("--preset", default=None, help="a real model's shape (pipeline.tiny presets) instead of the bench "
                   "model (--layers and --hidden ignored)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--strategy", default=None, help="fsdp1.py's --strategy (default: its default)")
    p.add_argument("--adapter", choices=("none", "lora"), default="none", help="LoRA r16 on both sides")
    args = p.parse_args()
    work = args.workdir
    model = build_model(args) if not args.preset else preset_model(work, args.preset)
    data = demo_dataset(work / "dataset")
    run_ours(args, work, model, data, "warmup")  # builds the token cache the HF worker reads too
    blocks = token_cache(args, work, model, data)
    ours, hf, bare, bare_thp = [], [], [], []
    for _ in range(args.repeats):
        ours.append(run_ours(args, work, model, data, "ours"))
        hf.append(run_hf(args, work, model, blocks))
        bare.append(run_bare(args, model, blocks, thp=False, strategy=ours[-1]["strategy"]))
        bare_thp.append(run_bare(args, model, blocks, thp=True, strategy=ours[-1]["strategy"]))
        print(json.dumps({"ours": ours[-1]["steps"], "hf": hf[-1]["steps"]}), flush=True)
    raw = BENCH / "data" / f"{section(args)}.json"
    raw.write_text(json.dumps({"command": command(args), "machine": machine(), "ours": ours, "hf": hf, "bare": bare,
                               "bare_thp": bare_thp}) + "\n")
    report(args, model, ours, hf, bare, bare_thp)


def section(args) -> str:
    name = "train_speed_cpu" if not args.preset else f"train_speed_{args.preset}_{args.precision}"
    name += f"_{args.adapter}" if args.adapter != "none" else ""
    return name if args.world == 2 else f"{name}_{args.world}ranks"


def command(args) -> str:
    world = f" --world {args.world}" if args.world != 2 else ""
    if not args.preset:
        return f"--repeats {args.repeats}{world}"
    flags = f"--preset {args.preset} --precision {args.precision} --seq {args.seq} --batch {args.batch} --steps " \
            f"{args.steps} --discard {args.discard} --repeats {args.repeats}{world}"
    return flags + (f" --strategy {args.strategy}" if args.strategy else "") + \
        (f" --adapter {args.adapter}" if args.adapter != "none" else "")


def preset_model(work: Path, preset: str) -> Path:
    from pipeline.prep.tiny import build_preset

    out = work / preset
    return out if (out / "config.json").exists() else build_preset(out, preset)


def crowded(args, share: float, ours: float) -> str:
    """More ranks than cores: each rank's share runs on a fraction of a core, so the floor is the share times the
    ranks per core (the bare worker measures one rank alone on a core)."""
    cores = os.cpu_count() or 1
    if args.world <= cores:
        return ""
    floor = share * args.world / cores
    return (f" With {args.world} ranks on {cores} cores the floor is the share times {args.world / cores:g} ranks per "
            f"core, {floor:.3f} s: **{floor / ours:.2f}** of it.")


def bare_lines(args, step: dict, med: dict, bare: list[dict], bare_thp: list[dict]) -> list[str]:
    """The bare-PyTorch limit's table, ratio and the chart."""
    share = [b["share"] for b in bare]
    share_thp = [b["share"] for b in bare_thp]
    return [
        "",
        table(["bare-PyTorch limit of one rank's share (1 thread)", "fwd+bwd s",
               "clip+AdamW s (adapters)" if args.adapter != "none" else "clip+AdamW s (all params)",
               "share s", "share / fsdp1.py step"],
              [["stock allocator (as fsdp1.py)", spread([b["fwd_bwd"] for b in bare]),
                spread([b["update"] for b in bare]), spread(share), f"{statistics.median(share) / med['ours']:.2f}"],
               ["huge pages (THP_MEM_ALLOC_ENABLE=1)", spread([b["fwd_bwd"] for b in bare_thp]),
                spread([b["update"] for b in bare_thp]), spread(share_thp),
                f"{statistics.median(share_thp) / med['ours']:.2f}"]]),
        "",
        "Fraction of the bare limit (share / our step, target 0.9), against the same allocator setting: "
        f"**{statistics.median(share) / med['ours']:.2f}**." + crowded(args, statistics.median(share), med["ours"]),
        "",
        bar_chart(section(args), f"CPU training step, {args.world} gloo ranks (s/step, lower is better)",
                  ["fsdp1.py", "HF Trainer", "bare limit (stock)", "bare limit (huge pages)"],
                  [med["ours"], med["hf"], statistics.median(share), statistics.median(share_thp)], "s/step",
                  [(min(step["ours"]), max(step["ours"])), (min(step["hf"]), max(step["hf"])),
                   (min(share), max(share)), (min(share_thp), max(share_thp))]),
    ]


def loss_line(ours: list[dict], hf: list[dict]) -> str:
    """The two systems' losses on the same batches (both log every step): the first step's, the largest gap between
    them, and, with two runs or more, each system's gap to itself (what an unseeded initialisation alone moves)."""
    def gap(a: dict, b: dict) -> float:
        return max(abs(x - y) for x, y in zip(a["loss"], b["loss"], strict=True))

    line = (f"Loss on the same batches: first step {ours[0]['loss'][0]:.6f} (fsdp1.py) against "
            f"{hf[0]['loss'][0]:.6f} (HF Trainer); the largest gap over {len(ours[0]['loss'])} steps: "
            f"{max(gap(o, h) for o, h in zip(ours, hf, strict=True)):.2e}")
    if len(ours) > 1:
        line += (f", against {gap(hf[0], hf[1]):.2e} between the HF Trainer's first two runs and "
                 f"{gap(ours[0], ours[1]):.2e} between fsdp1.py's")
    return line + "."


def report(args, model: Path, ours: list[dict], hf: list[dict], bare: list[dict], bare_thp: list[dict]) -> None:
    tokens = args.world * args.batch * args.seq
    step, med = step_medians({"ours": ours, "hf": hf})
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    n_params = cfg.vocab_size * cfg.hidden_size  # embedding (tied: also the lm_head)
    rows = []
    for name, label, runs in (("ours", f"fsdp1.py (--strategy {args.strategy or 'default'}: ran "
                                       f"{ours[0]['strategy']})", ours),
                              ("hf", f"HF Trainer ({hf[0]['wrapper']}, {hf[0]['distributed']})", hf)):
        mean = statistics.mean(s for r in runs for s in r["steps"])
        rows.append([label, spread(step[name]), f"{mean:.3f}", f"{tokens / med[name]:,.0f}",
                     spread([r["first_step"] for r in runs], 1), spread([r["peak_rss_gb"] for r in runs], 2)])
    lines = [
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/train_speed.py {command(args)}`"
        + (" (part of `make bench`)." if not args.preset else "."),
        f"- Model: Llama, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size:,} "
        f"(tied; embedding {n_params:,} parameters), random weights. {args.world} gloo processes, batch "
        f"{args.batch} x seq {args.seq} per rank ({tokens} tokens per step), {args.precision}, AdamW, clipping 1.0, "
        f"{args.steps} steps per run of which the first {args.discard} are left out"
        + (", LoRA r16 (alpha 32) on every linear layer of the blocks, the HF Trainer's through peft." if
           args.adapter != "none" else "."),
        "",
        table(["system", "s/step median (min-max of run medians)", "s/step mean", "tokens/s (median)",
               "launch to first step end, s", "peak RSS per rank, GB"], rows),
        "",
        f"Ratio of tokens/s, fsdp1.py / HF Trainer: **{med['hf'] / med['ours']:.2f}** (target 1.25).",
        "",
        loss_line(ours, hf),
    ]
    if bare:
        lines += bare_lines(args, step, med, bare, bare_thp)
    body = "\n".join(lines)
    update_section(section(args), body)
    print(body)


if __name__ == "__main__":
    main()
