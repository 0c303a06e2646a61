"""GPU training throughput on a real model's shape: fsdp1.py against the Hugging Face Trainer, one GPU.

Model: Llama-3.2-1B's config (pipeline.tiny --preset llama-3.2-1b: random weights, bf16 file, tied 128k vocabulary),
seq 2048, bf16 compute over fp32 weights, AdamW, clipping 1.0, warmup+cosine lr, on the same packed blocks (our
token cache, read by the HF worker too). Each variant is launched fresh with torchrun; steady state is the median
over windows of 5 steps after the first --discard steps (compilation and allocator warm-up). fsdp1.py logs once per
window (its only host sync); the HF worker syncs the GPU at the same window ends. A run of ours is stopped once it
has logged --steps steps (its final checkpoint and export are not part of a step). MFU: 6 x the parameters of the
matrix products (the tied LM head included) + 12 x layers x heads x head_dim x seq FLOPs per token, over the
GPU's dense bf16 peak (989 TFLOPS for the H100 and H200). Memory: the largest torch.cuda.max_memory_allocated
of any window (ours), of the whole run (HF).

Results are appended as JSON lines to --results, and the table is written from every line of that file, so
variants may be measured in several invocations (e.g. several lease windows) and reported together:

    python bench/train_speed_gpu.py --variants all --results .bench/gpu/results.jsonl --write
    python bench/train_speed_gpu.py --report-only --results FILE --write
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from common import BENCH, ROOT, bench_env, machine, table, torchrun_cmd, update_section

from pipeline.train.telemetry import read_metrics

SEQ = 2048
OURS_FLAGS = ["--precision", "bf16", "--log-freq", 5, "--ckpt-freq", 0, "--eval-freq", 0, "--lr", 3e-4,
              "--warmup-steps", 5, "--max-steps", 10**6, "--async-ckpt", "off"]
VARIANTS: dict[str, tuple[str, list, str]] = {
    "ours-default": ("ours", [], "fsdp1.py, its defaults"),
    "ours-default-compile": ("ours", ["--compile", "on"], "fsdp1.py, its defaults, compile per layer"),
    "ours-lora": ("ours", ["--adapter", "lora", "--lora-rank", 16, "--activation-checkpointing", "on"],
                  "fsdp1.py, LoRA r16 on every linear layer, activation checkpointing"),
    "ours-qlora": ("ours", ["--adapter", "qlora", "--lora-rank", 16, "--activation-checkpointing", "on"],
                   "fsdp1.py, QLoRA r16 (NF4 base), activation checkpointing"),
    "hf-peft-lora": ("hf", ["--lora-rank", 16, "--grad-ckpt"],
                     "HF Trainer + peft LoRA r16 on every linear layer, gradient checkpointing"),
    "ours-hfloss": ("ours", ["--vocab-parallel", "off"], "fsdp1.py, HF model loss (full logits)"),
    "ours-chunked": ("ours", ["--vocab-parallel", "on"], "fsdp1.py, chunked fused loss"),
    "ours-chunked-compile": ("ours", ["--vocab-parallel", "on", "--compile", "on"],
                             "fsdp1.py, chunked fused loss, compile per layer"),
    "ours-hfloss-compile": ("ours", ["--vocab-parallel", "off", "--compile", "on"],
                            "fsdp1.py, HF model loss, compile per layer"),
    "ours-chunked-compile-ac": ("ours", ["--vocab-parallel", "on", "--compile", "on", "--activation-checkpointing",
                                         "on"], "fsdp1.py, chunked loss, compile, activation checkpointing"),
    "ours-estimator": ("ours", ["--vocab-parallel", "off", "--activation-checkpointing", "on"],
                       "fsdp1.py, HF model loss, activation checkpointing (the estimator's setting)"),
    "ours-ckpt-async": ("ours", ["--vocab-parallel", "on", "--ckpt-freq", 10, "--async-ckpt", "on"],
                        "fsdp1.py, chunked loss, async checkpoint every 10 steps"),
    "ours-ckpt-sync": ("ours", ["--vocab-parallel", "on", "--ckpt-freq", 10, "--async-ckpt", "off"],
                       "fsdp1.py, chunked loss, sync checkpoint every 10 steps"),
    "hf": ("hf", [], "HF Trainer (FSDP2, bf16, fused AdamW)"),
    "hf-compile": ("hf", ["--compile"], "HF Trainer + torch_compile"),
    "hf-ac": ("hf", ["--grad-ckpt"], "HF Trainer + gradient checkpointing"),
    "hf-compile-ac": ("hf", ["--compile", "--grad-ckpt"], "HF Trainer + torch_compile + gradient checkpointing"),
}
"""name -> (system, extra flags, label in the table)."""


@dataclass
class Inputs:
    model: Path
    data: Path
    blocks: Path
    """train.npy of the token cache, which the HF worker reads too."""


def prepare(work: Path, preset: str = "llama-3.2-1b", seq: int = SEQ, corpus_mb: int = 16,
            model: Path | None = None) -> Inputs:
    """A preset-shaped model ("tiny": pipeline.tiny's 2-layer model, for rehearsals on CPU; or the model folder
    given), a dataset of real text (this machine's Python sources, corpus_mb MB; 0: the bundled demo corpus) and its
    token cache at seq as fsdp1.py's defaults key it, once each."""
    from data_prep import gather
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from pipeline.data.dataset import BlockSpec, dataset_fingerprint
    from pipeline.data.token_cache import build_blocks, token_cache_dir
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    model = model or preset_model(work, preset)
    data = work / "dataset"
    if not data.exists():
        raw = work / "raw"
        if corpus_mb:
            raw.mkdir(parents=True, exist_ok=True)
            gather(raw, corpus_mb * 2**20)
        else:
            shutil.copytree(ROOT / "examples" / "raw", raw, ignore=shutil.ignore_patterns("chats"), dirs_exist_ok=True)
        build_dataset(CorpusConfig(raw, data, num_proc=os.cpu_count() or 1))
    ds = load_from_disk(str(data))
    cache = token_cache_dir(work / "runs" / "token_cache", dataset_fingerprint(ds), model, BlockSpec(seq, 0.01, 0))
    if not (cache / "meta.json").exists():
        build_blocks(ds, AutoTokenizer.from_pretrained(model), BlockSpec(seq, 0.01, 0), os.cpu_count() or 1, cache)
    return Inputs(model, data, cache / "train.npy")


def preset_model(work: Path, preset: str) -> Path:
    """WORK/PRESET: a random-weight model of the preset's config ("tiny": pipeline.tiny's 2-layer model), built once."""
    from pipeline.prep.tiny import build_preset, build_tiny

    model = work / preset
    if not (model / "config.json").exists():
        build_tiny(model) if preset == "tiny" else build_preset(model, preset)
    return model


def launch_until(cmd: list[str], env: dict, metrics: Path, done, timeout: float) -> tuple[int | None, str]:
    """Run cmd in its own process group; kill the group once done(events) is true. Returns (exit code or None if
    killed by us, output tail)."""
    log = metrics.parent.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        code = None
        while proc.poll() is None and time.time() < deadline:
            if metrics.exists() and done(read_metrics(metrics)):
                break
            time.sleep(0.5)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            code = proc.returncode
    return code, log.read_text()[-3000:]


def windows(events: list[dict], discard: int) -> list[dict]:
    return [e for e in events if e["event"] == "train" and e["step"] > discard]


PROFILED = 3
"""Steps profiled (torch.profiler) after the measured ones, when a variant is profiled."""


def kept_profile(run: Path, workdir: Path, name: str) -> dict | None:
    """The profile's summary, its trace kept as WORKDIR/profiles/NAME.trace.json.gz (the run's folder is removed)."""
    summary = run / "profile.json"
    if not summary.exists():
        return None
    kept = workdir / "profiles"
    kept.mkdir(parents=True, exist_ok=True)
    if (run / "trace.json.gz").exists():
        shutil.move(run / "trace.json.gz", kept / f"{name}.trace.json.gz")
    return json.loads(summary.read_text())


def run_ours(args, name: str, flags: list, inputs: Inputs, batch: int, profile: bool = False, nproc: int = 1) -> dict:
    """fsdp1.py on nproc ranks until it has logged args.steps steps (and, with profile, profiled the PROFILED steps
    after them)."""
    runs = args.workdir / "runs"
    metrics = runs / name / "metrics.jsonl"
    profiling = ["--profile-from", args.steps + 1, "--profile-steps", PROFILED] if profile else []
    cmd = torchrun_cmd(nproc, ROOT / "fsdp1.py", "-e", name, "--save-dir", runs, "-d", inputs.data, "-m", inputs.model,
                       "-b", batch, "--seq-length", args.seq, *OURS_FLAGS, *flags, *profiling)
    shutil.rmtree(runs / name, ignore_errors=True)
    started = time.time()
    saves = 2 if "--ckpt-freq" in flags else 0  # checkpoint variants run until two saves are complete

    def done(evs: list[dict]) -> bool:
        return (any(e["event"] == "train" and e["step"] >= args.steps for e in evs)
                and sum(e["event"] == "checkpoint" for e in evs) >= saves
                and (not profile or any(e["event"] == "profile" for e in evs)))

    code, tail = launch_until(cmd, bench_env(), metrics, done, args.timeout)
    events = read_metrics(metrics) if metrics.exists() else []
    profiled = kept_profile(runs / name / "profile", args.workdir, name) if profile else None
    shutil.rmtree(runs / name, ignore_errors=True)  # a 1B model's checkpoint is 15 GB: the next run needs the disk
    steady = [e for e in windows(events, args.discard) if e["step"] <= args.steps]  # not the profiled steps' window
    if not steady:
        return {"error": error_of(tail, code)}
    first = next(e for e in events if e["event"] == "train")
    train = [e for e in events if e["event"] == "train"]
    return {"tokens_per_s": [e["tokens_per_s"] for e in steady],
            "peak_alloc_gib": max(e["mem_gb"].get("peak_alloc") or 0 for e in train),
            "peak_reserved_gib": max(e["mem_gb"].get("peak_reserved") or 0 for e in train),
            "time_ms": {k: statistics.median(e["time_ms"][k] for e in steady) for k in steady[0]["time_ms"]},
            "first_window_end_s": round(first["time"] - started, 1), "loss": train[-1]["loss"],
            "losses": [[e["step"], e["loss"]] for e in train],
            "checkpoints": [{k: e[k] for k in ("step", "seconds", "stall_seconds", "bytes")}
                            for e in events if e["event"] == "checkpoint"],
            **({"profile": profiled} if profiled else {})}


def run_hf(args, name: str, flags: list, inputs: Inputs, batch: int, profile: bool = False) -> dict:
    """The HF worker for args.steps steps (and, with profile, PROFILED more under the profiler)."""
    out = args.workdir / f"{name}.json"
    out.unlink(missing_ok=True)
    profiling = ["--profile-from", args.steps + 1, "--profile-steps", PROFILED] if profile else []
    cmd = torchrun_cmd(1, BENCH / "hf_worker.py", "--model", inputs.model, "--blocks", inputs.blocks, "--out", out,
                       "--bf16", "--batch-size", batch, "--max-steps", args.steps + (PROFILED if profile else 0),
                       "--lr", 3e-4, "--warmup-steps", 5, "--sync-every", 5, *flags, *profiling)
    proc = subprocess.run(cmd, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        return {"error": error_of(proc.stdout + proc.stderr, proc.returncode)}
    r = json.loads(out.read_text())
    profiled = kept_profile(out.with_suffix(".profile"), args.workdir, name) if profile else None
    ends = [t for s, t in zip(r["steps"], r["step_end"], strict=True) if args.discard <= s <= args.steps]
    tokens = batch * args.seq * 5
    return {"tokens_per_s": [tokens / (b - a) for a, b in zip(ends[:-1], ends[1:], strict=True)],
            "peak_alloc_gib": r["peak_alloc_gib"], "peak_reserved_gib": r["peak_reserved_gib"],
            "wrapper": r["wrapper"], **({"profile": profiled} if profiled else {})}


def error_of(output: str, code: int | None) -> str:
    if "OutOfMemoryError" in output or "out of memory" in output.lower():  # NCCL: "Cuda failure 'out of memory'"
        return "out of memory"
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return f"exit {code}: {lines[-1][:200] if lines else 'no output'}"


def model_figures(model: Path, seq: int = SEQ) -> tuple[float, float]:
    """FLOPs per token as the trainer counts them, and pipeline/strategies/memory.py's estimate in GiB for the estimator
    variant (fsdp2 on 1 GPU, bf16, batch 1, the model's own loss, activation checkpointing), without the CUDA
    context (max_memory_allocated, which it is compared with, does not include it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.model.modeling import param_counts
    from pipeline.strategies.memory import GIB, Shape, Workload
    from pipeline.strategies.registry import estimate
    from pipeline.train.telemetry import flops_per_token

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    work = Workload("fsdp2", "FULL_SHARD", 1, 1, 2, 1, seq, activation_checkpointing=True)
    return flops_per_token(config, param_counts(meta)[1], seq), estimate(Shape.of(config), work).total / GIB


def shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


FULL = "fp32 master weights and AdamW states"
ADAPTERS = "frozen bf16 base (NF4 under QLoRA), fp32 adapters and their AdamW states"


def report(args, results: list[dict], model: str = "Llama-3.2-1B's config", command: str = "",
           trained: str = FULL) -> str:
    """The table of results (one JSON line each); command: how it was made (default: this script's); trained: what
    the rows keep and update."""
    peak = 989e12
    rows = []
    hf_best: dict[int, float] = {}
    for r in results:
        if "tokens_per_s" in r and r["system"] == "hf":
            hf_best[r["batch"]] = max(hf_best.get(r["batch"], 0), statistics.median(r["tokens_per_s"]))
    for r in results:
        label = VARIANTS[r["variant"]][2] if r["variant"] in VARIANTS else r["variant"]
        label += f" ({r['note']})" if r.get("note") else ""
        if "error" in r:
            rows.append([label, r["batch"], r["error"], "-", "-", "-", "-"])
            continue
        tps = r["tokens_per_s"]
        med = statistics.median(tps)
        ratio = f"{med / hf_best[r['batch']]:.2f}" if r["system"] == "ours" and hf_best.get(r["batch"]) else "-"
        reserved = f"{r['peak_reserved_gib']:.1f}" if r.get("peak_reserved_gib") else "-"
        alloc = f"{r['peak_alloc_gib']:.1f}" if r.get("peak_alloc_gib") else "-"  # the HF worker's on CPU: none
        mfu = f"{med * r['flops_per_token'] / peak:.1%}" if r.get("flops_per_token") else "-"
        rows.append([label, r["batch"], f"{med:,.0f} ({min(tps):,.0f}-{max(tps):,.0f})",
                     f"{r['batch'] * r.get('seq', SEQ) / med:.3f}", mfu,
                     f"{alloc} / {reserved}", ratio])
    first = results[0]
    command = command or ("`make bench-gpu` (`python bench/train_speed_gpu.py --variants all --write`); this table: "
                          f"`--report-only --results {shown(args.results)}`")
    counted = max(r.get("flops_per_token") or 0 for r in results)
    lines = [
        f"- Machine: {first['machine']}.",
        f"- Command: {command} ({len({r['session'] for r in results})} invocations).",
        f"- Model: {model} ({f'{counted / 1e9:.2f} GFLOPs per token counted' if counted else 'no MFU: adapters'}),"
        f" random weights, bf16 file; seq {first.get('seq', SEQ)}, bf16 compute, {trained}, 1 GPU; steady state over "
        f"steps {args.discard + 1}-{args.steps} in windows of 5.",
        "",
        table(["system", "batch", "tokens/s median (min-max of windows)", "s/step", "MFU",
               "peak GiB alloc / reserved", "x best HF Trainer at this batch"], rows),
    ]
    for r in results:
        if r.get("checkpoints"):
            saves = ", ".join(f"step {c['step']}: {c['bytes'] / 1e9:.1f} GB in {c['seconds']:.1f} s, loop stalled "
                              f"{c['stall_seconds']:.3f} s" for c in r["checkpoints"])
            lines += ["", f"Checkpoints of `{r['variant']}`: {saves}."]
        if r["variant"] == "ours-estimator" and r.get("estimate_gib"):
            lines += ["", f"Memory estimator (pipeline/strategies/memory.py, 1 GPU, without the CUDA context): "
                          f"{r['estimate_gib']:.2f} GiB against {r['peak_alloc_gib']:.2f} GiB measured."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "gpu")
    p.add_argument("--variants", default="all", help=f"comma-separated, or all: {', '.join(VARIANTS)}")
    p.add_argument("--batch", default="8", help="comma-separated batch sizes per GPU, each variant at each")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--discard", type=int, default=10)
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--results", type=Path, default=None, help="JSON lines file of results (appended)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--write", action="store_true", help="rewrite the GPU table of BENCHMARKS.md")
    args = p.parse_args()
    args.results = args.results or args.workdir / "results.jsonl"
    if not args.report_only:
        measure(args)
    results = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    body = report(args, results)
    if args.write:
        update_section("train_speed_gpu", body)
    print(body)


def measure(args) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/train_speed_gpu.py needs a CUDA GPU")
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    inputs = prepare(args.workdir, seq=args.seq)
    fpt, estimate = model_figures(inputs.model, args.seq)
    session = f"{os.uname().nodename}-{int(time.time())}"
    args.results.parent.mkdir(parents=True, exist_ok=True)
    for batch in (int(b) for b in args.batch.split(",")):
        for name in names:
            system, flags, _ = VARIANTS[name]
            run = run_ours if system == "ours" else run_hf
            t0 = time.time()
            b = 1 if name == "ours-estimator" else batch
            r = run(args, name, flags, inputs, b)
            r.update(variant=name, system=system, batch=b, seq=args.seq, flops_per_token=fpt, machine=machine(),
                     session=session, wall_s=round(time.time() - t0, 1), estimate_gib=estimate)
            with open(args.results, "a") as f:
                f.write(json.dumps(r) + "\n")
            med = statistics.median(r["tokens_per_s"]) if "tokens_per_s" in r else None
            print(json.dumps({"variant": name, "batch": b, "checkpoints": r.get("checkpoints"),
                              "tokens_per_s": med, "error": r.get("error"),
                              "peak_alloc_gib": r.get("peak_alloc_gib"), "time_ms": r.get("time_ms"),
                              "wall_s": r["wall_s"]}), flush=True)


if __name__ == "__main__":
    main()
