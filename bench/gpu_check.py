"""make gpu-check: everything that only a GPU can check or measure, in halves that each fit a lent GPU's window.

    make gpu-wheels                      # here, before the GPU call: the wheels the GPU image lacks, into .whl/
    make gpu-check HALF=1                # on the GPU (carry .whl): setup, adapters; at most 300 s
    make gpu-check HALF=2                # on the GPU, the next call: setup, correctness, full_speed, grpo; <= 300 s
    make gpu-check HALF=3                # on the GPU, a third call: setup, long_context; <= 300 s
    make gpu-check HALF=4                # on 2 or more GPUs: setup, moe (expert parallelism); <= 300 s
    make gpu-check                       # both halves in one call (at most 600 s)
    make gpu-check PARTS=adapters        # one part again
    make gpu-check DRY=1                 # the rehearsal: every part on the CPU, tiny shapes, a few steps

Parts, in order (a rehearsal runs correctness beside the speed parts), each in its own process under its own time
budget and under what is left of the half's (a part that runs out is killed, the rows it finished stay, and the next
part runs), each writing its results to the results file (JSON lines) as they complete, so what finished comes back
even when a later part runs out of time.
Every process a part starts gets the caller's environment (PYTHONPATH included: the GPU image finds the carried
wheels through it).

    setup        every import the run needs, with versions, and the device; nothing else runs without it
    correctness  fsdp2, ddp, LoRA and QLoRA on the tiny model, each killed after a checkpoint and resumed, its
                 losses equal to an uninterrupted run's; beside them fp16 with dynamic loss scaling and the tests
                 that need CUDA (tests/test_gpu.py; CPU offload under fsdp1 and fsdp2) in concurrent groups
    full_speed   Llama-3.2-1B's shape, seq 2048, bf16, 30 steps: fsdp1.py with its defaults, compile off and on,
                 against the compiled HF Trainer at the same batch (tokens/s, MFU, peak memory); the compiled pair
                 profiled over three steady steps (top kernels, the step split by kind of work)
    adapters     LoRA and QLoRA on Llama-3.1-8B's shape at batch 1 x 2048 against HF Trainer + peft LoRA (tokens/s,
                 peak memory; the QLoRA goal: 8B in 10 GiB), QLoRA's peak broken down from its profile
    grpo         GRPO with LoRA on Llama-3.2-1B's shape: the generation's tokens/s and each step's split between
                 generating and training (the bundled arithmetic prompts, the digits reward)
    long_context LoRA on Llama-3.1-8B's shape at batch 1 x 131,072 tokens with activation checkpointing, the tiled
                 MLP and activation offloading: whether a step fits one GPU, its peak memory and seconds, and the
                 start line's longest sequence for the card (issue 76's goal: >= 256K on one H200)
    moe          fsdp2 on a Qwen3-30B-A3B-shaped slice (bench/moe_speed.py's, 2 layers, bf16) on 2 GPUs with expert
                 parallelism off and on (tokens/s per GPU, peak memory); with one GPU
                 only off, and the part says so (NCCL takes one rank per device, expert parallelism needs two)

Then BENCHMARKS.md's GPU sections (train_speed_gpu, adapters_gpu, gpu_profile, grpo_gpu) are rewritten from the
results (not in a dry run, whose tables go to its work folder). Exit status: 0 when every part passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, bench_env, machine, table, torchrun_cmd, update_section

REQUIRED = ("torch", "transformers", "tokenizers", "datasets", "pyarrow", "safetensors", "peft", "torchao",
            "accelerate", "huggingface_hub", "yaml", "psutil", "tqdm")
"""What fsdp1.py and the HF worker import; the GPU image lacks some (make gpu-wheels fetches them)."""


@dataclass(frozen=True)
class Part:
    budget_s: int
    """Seconds on the GPU before the part is killed."""
    dry_budget_s: int
    """Seconds in the CPU rehearsal."""


PARTS = {"setup": Part(40, 60), "correctness": Part(120, 300), "full_speed": Part(190, 240),
         "adapters": Part(270, 240), "grpo": Part(60, 120), "long_context": Part(250, 180), "moe": Part(240, 180)}
"""Budgets, 25% or more above what the parts took on an H200. Setup: 11.7-15.1 s, 20.2 s on a fresh machine's
first imports (2026-11-28, killed at its then 20 s). Correctness: 71.6 s (2026-11-28; the CUDA tests in five groups,
the slowest 67 s). Full_speed: 150.8 s for three variants, the 1B model built and the dataset kept from the first
half. Adapters: 226.5 s for three variants with the 8B model and the dataset built (2026-11-28). A half took 240 s
(1) and 237 s (2) of its 300. GRPO: not yet run on a GPU; its 60 s are what half 2 had left. Long context: not yet
run on a GPU; the 8B model's build (as adapters', about 60 s), the token cache at 131,072 and two steps, each about
25 s by the FLOPs (attention 5.6e14 per layer at 128K) at 40% of the peak. MoE: not yet run on a GPU; the slice's
random build (1.3B parameters, on the GPU) and two runs of 12 steps, each step's 1.6 GFLOP per token small beside
the runs' start-up (about 30 s each, as the speed parts')."""
HALVES = {"1": ("setup", "adapters"), "2": ("setup", "correctness", "full_speed", "grpo"),
          "3": ("setup", "long_context"), "4": ("setup", "moe")}
"""Each half is one device call: at most HALF_S seconds of parts, setup first in each (a fresh machine may come)."""
HALF_S = 300


@dataclass(frozen=True)
class Load:
    """What a speed part trains and for how long."""

    preset: str
    batch: int
    steps: int
    discard: int
    """Steps left out of the steady state (compilation, allocator warm-up)."""


@dataclass(frozen=True)
class Rollouts:
    """What the GRPO part trains: LoRA r16, every prompt's group of completions generated in the training process."""

    preset: str
    prompts: int
    """Prompts per step (one rank)."""
    group: int
    """Completions per prompt (G)."""
    length: int
    """--max-completion-length: a random model seldom stops early, so most completions are this long."""
    steps: int
    discard: int
    """Steps left out of the steady state (the first generation's warm-up)."""


@dataclass(frozen=True)
class Shapes:
    """What each part trains: the real shapes on a GPU, tiny ones in a dry run."""

    seq: int
    corpus_mb: int
    """Real text to train on: this machine's Python sources, in MB (0: the bundled demo corpus); one dataset for
    both speed parts."""
    full_speed: Load
    adapters: Load
    """8B at batch 1 x 2048 with activation checkpointing: the shape of the 10 GiB QLoRA goal; HF + peft's bf16 base
    beside its activations fits one GPU there too."""
    grpo: Rollouts
    long_seq: int
    """The long-context part's sequence length."""
    long_context: Load
    moe: Load
    """The slice's layer count in place of a preset (bench/moe_speed.SLICE)."""
    moe_slice: dict
    """SLICE's fields overridden (a dry run's smaller experts)."""


GPU = Shapes(2048, 16, Load("llama-3.2-1b", 8, 30, 10), Load("llama-3.1-8b", 1, 15, 5),
             Rollouts("llama-3.2-1b", 4, 8, 128, 6, 2), 131072, Load("llama-3.1-8b", 1, 2, 0),
             Load("2", 4, 12, 4), {})
DRY = Shapes(64, 0, Load("tiny", 2, 10, 5), Load("tiny", 2, 10, 5), Rollouts("tiny", 2, 4, 16, 4, 1), 512,
             Load("tiny", 1, 2, 0), Load("1", 2, 4, 1),
             {"hidden_size": 256, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})


class Results:
    """The results file: one JSON object per line, each with the part, the session and the time it was written."""

    def __init__(self, path: Path, session: str, part: str) -> None:
        self.path, self.session, self.part = path, session, part

    def write(self, **record: object) -> None:
        line = json.dumps({"part": self.part, "session": self.session, "time": round(time.time(), 1), **record})
        with open(self.path, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------- parts


def setup(args, out: Results) -> None:
    """Every import satisfied, with its version; the device named. Raises (the part fails) when one is missing."""
    import importlib

    versions, missing = {}, []
    for name in REQUIRED:
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # an ImportError, or a wheel built against another torch failing at import
            missing.append(f"{name} ({type(exc).__name__}: {str(exc)[:120]})")
    import torch

    cuda = torch.cuda.is_available()
    out.write(item="imports", versions=versions, missing=missing, cuda=cuda,
              device=torch.cuda.get_device_name(0) if cuda else "cpu", machine=machine())
    if missing:
        raise SystemExit(f"missing: {', '.join(missing)}; fetch wheels with `make gpu-wheels` and carry .whl")
    if not cuda and not args.dry:
        raise SystemExit("no CUDA GPU here: run `make gpu-check DRY=1` for the rehearsal on CPU")


def tiny_inputs(work: Path) -> dict:
    """The demo corpus as a dataset and the tiny model in an HF_HOME of the work folder, once."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.prep.hub import import_local
    from pipeline.prep.tiny import build_tiny

    data, hf = work / "tiny-dataset", work / "tiny-hf"
    if not (data / "state.json").exists():
        shutil.copytree(ROOT / "examples" / "raw", work / "tiny-raw", ignore=shutil.ignore_patterns("chats"),
                        dirs_exist_ok=True)
        build_dataset(CorpusConfig(work / "tiny-raw", data, num_proc=1, overwrite=True))
    if not (hf / "hub").exists():
        import_local(build_tiny(work / "tiny-model"), "local/tiny", "main", hf / "hub")
    return {"dataset": data, "env": {**bench_env(), "HF_HOME": str(hf)}}


RESUME_CASES = {"fsdp2": ["--strategy", "fsdp2"], "ddp": ["--strategy", "ddp"],
                "lora": ["--strategy", "fsdp2", "--adapter", "lora"],
                "qlora": ["--strategy", "ddp", "--adapter", "qlora"]}
DRY_RESUME_CASES = ("fsdp2", "qlora")
RESUME_STEPS, DRY_RESUME_STEPS = 100, 20
"""Steps of each resumed run: on a GPU 100 (2 s of steps after the first checkpoint), on the CPU 20."""
"""A dry run's cases: the two furthest apart (sharded full fine-tuning; 4-bit adapters under ddp); the others
differ from them by their flags alone."""
GPU_TEST_GROUPS = (("tests/test_gpu.py", "-k", "bf16_async"), ("tests/test_gpu.py", "-k", "sigkill"),
                   ("tests/test_gpu.py", "-k", "chunked_loss"),
                   ("tests/test_strategies.py", "-k", "cpu_offload and fsdp1"),
                   ("tests/test_strategies.py", "-k", "cpu_offload and fsdp2"))
"""The tests that need CUDA, one group each, side by side (on an H200: 30 to 55 s each, 92 s for the slowest of
three groups): test_gpu.py's three, and CPU offload under fsdp1 and fsdp2 with pinned memory."""
DRY_TEST_GROUPS = (("tests/test_gpu.py",),)
"""On the CPU test_gpu.py skips every test, which is the rehearsal's pass (the offload tests run in make test)."""


def tiny_run(work: Path, inputs: dict, name: str, flags: list[str], steps: int, *extra: object) -> list[str]:
    return [sys.executable, str(ROOT / "fsdp1.py"), "-e", name, "--save-dir", str(work), "-d", str(inputs["dataset"]),
            "-m", "local/tiny", "--config", str(ROOT / "configs" / "demo.yaml"), "--log-freq", "1", "--eval-freq",
            "0", "--max-steps", str(steps), "--ckpt-freq", "2", "--async-ckpt", "off", *flags, *map(str, extra)]


def train_losses(run: Path) -> dict[int, float]:
    from pipeline.train.telemetry import read_metrics

    metrics = run / "metrics.jsonl"
    return {e["step"]: e["loss"] for e in read_metrics(metrics) if e["event"] == "train"} if metrics.exists() else {}


def started(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """cmd in a session of its own (killed as a group), its output appended to log (a pipe left unread would block
    it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1][:300] if lines else ""


def killed_and_resumed(work: Path, inputs: dict, cases: dict[str, list[str]], steps: int) -> dict[str, dict]:
    """Every case run to the end and, beside it, the same run killed (SIGKILL, its process group) once its step-2
    checkpoint is complete, then rerun to the end: the steps after the checkpoint must give the uninterrupted run's
    losses. The cases run side by side (tiny models: launch time is all there is), so the part costs two launches.
    The steps after the first checkpoint must outlast the poll: on an H200 a tiny step takes 20 ms and 18 steps
    ended before eight processes starting beside the poll let it see the checkpoint, hence RESUME_STEPS there."""
    for name in cases:
        shutil.rmtree(work / name, ignore_errors=True)
    def run(name: str, flags: list[str], which: str) -> subprocess.Popen:
        return started(tiny_run(work / name, inputs, which, flags, steps), inputs["env"], work / f"{name}-{which}.log")

    refs = {n: run(n, f, "ref") for n, f in cases.items()}
    cuts = {n: run(n, f, "cut") for n, f in cases.items()}
    killed = dict.fromkeys(cases, False)
    while any(p.poll() is None and not killed[n] for n, p in cuts.items()):
        for name, proc in cuts.items():
            # state.json is written once the checkpoint is complete (pipeline/train/checkpoint.py)
            if proc.poll() is None and not killed[name] and (work / name / "cut" / "state.json").exists():
                os.killpg(proc.pid, signal.SIGKILL)
                killed[name] = True
        time.sleep(0.01)
    for proc in [*refs.values(), *cuts.values()]:
        proc.wait()
    resumes = {n: run(n, f, "cut") for n, f in cases.items()}
    out, log = {}, lambda name, which: last_line(work / f"{name}-{which}.log")
    for name, proc in resumes.items():
        proc.wait()
        reference, resumed = train_losses(work / name / "ref"), train_losses(work / name / "cut")
        worst = max((abs(resumed.get(s, math.inf) - v) / abs(v) for s, v in reference.items()), default=math.inf)
        ok = (refs[name].returncode == 0 and proc.returncode == 0 and killed[name] and len(reference) == steps
              and sorted(resumed) == sorted(reference) and worst <= 1e-5)
        out[name] = {"ok": ok, "flags": cases[name], "killed_after_checkpoint": killed[name],
                     "exit": [refs[name].returncode, proc.returncode], "largest_relative_loss_difference": worst,
                     "first_loss": reference.get(1), "last_loss": reference.get(steps),
                     "error": None if ok else log(name, "cut") or log(name, "ref") if killed[name] else
                     "the run ended before it could be killed"}
    return out


def correctness(args, out: Results) -> None:
    """The CUDA tests, every case killed and resumed and fp16, side by side (tiny models: launch time is all there
    is); raises when one fails."""
    cases = {n: RESUME_CASES[n] for n in DRY_RESUME_CASES} if args.dry else RESUME_CASES
    if args.dry:
        # the processes side by side on the CPU (each case's two runs, fp16, the tests): with a thread per core each
        # they spin against each other (58 s for the part on 2 cores, 29 s with one thread each); a caller's own
        # setting is kept
        side_by_side = 2 * len(cases) + 1 + len(DRY_TEST_GROUPS)
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // side_by_side)))
    tests = CudaTests(args)
    inputs = tiny_inputs(args.workdir)
    fp16 = Fp16(args.workdir / "fp16", inputs)
    steps = DRY_RESUME_STEPS if args.dry else RESUME_STEPS
    failed = []
    for name, result in killed_and_resumed(args.workdir / "resume", inputs, cases, steps).items():
        out.write(item=f"resume {name}", **result)
        if not result["ok"]:
            failed.append(name)
    result = fp16.result()
    out.write(item="fp16", **result)
    if not result["ok"]:
        failed.append("fp16")
    failed += tests.results(out)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


class Fp16:
    """fp16 with dynamic loss scaling: a few steps that must be finite, fall, and log the scale. Started at once,
    read by result()."""

    STEPS = 8

    def __init__(self, work: Path, inputs: dict) -> None:
        shutil.rmtree(work, ignore_errors=True)
        self.work, self.log = work, work.parent / "fp16.log"
        self.log.unlink(missing_ok=True)
        self.proc = started(tiny_run(work, inputs, "fp16", [], self.STEPS, "--precision", "fp16", "--ckpt-freq", "0"),
                            inputs["env"], self.log)

    def result(self) -> dict:
        from pipeline.train.telemetry import read_metrics

        self.proc.wait()
        metrics = self.work / "fp16" / "metrics.jsonl"
        events = read_metrics(metrics) if metrics.exists() else []
        train = [e for e in events if e["event"] == "train"]
        # a step whose fp16 gradients overflow is skipped and the scale halved (on an H200 the tiny model's first
        # step overflows at 65536): every step is trained or skipped for overflow, none lost
        overflowed = [e["step"] for e in events if e["event"] == "skipped" and e.get("overflow")]
        loss = [e["loss"] for e in train]
        ok = (self.proc.returncode == 0 and len(loss) + len(overflowed) == self.STEPS and len(loss) >= 6
              and all(map(math.isfinite, loss)) and loss[-1] < loss[0] and all(e.get("loss_scale") for e in train))
        return {"ok": ok, "exit": self.proc.returncode, "losses": loss, "overflowed_steps": overflowed,
                "loss_scale": [e.get("loss_scale") for e in train],
                "error": None if self.proc.returncode == 0 else last_line(self.log)}


class CudaTests:
    """The CUDA-only tests, their groups side by side, each with its own pytest folder and log (a part killed at its
    budget still shows how far they got). Started at once, read by results()."""

    def __init__(self, args) -> None:
        # bench_env keeps PYTHONPATH: on the GPU image the carried wheels (datasets, peft, torchao) are found through it
        self.dry = args.dry
        self.runs = []
        for i, group in enumerate(DRY_TEST_GROUPS if args.dry else GPU_TEST_GROUPS):
            log = args.workdir / f"cuda-tests-{i + 1}.log"
            log.unlink(missing_ok=True)
            shutil.rmtree(args.workdir / f"pytest-{i + 1}", ignore_errors=True)
            cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations", "0", "--basetemp",
                   str(args.workdir / f"pytest-{i + 1}"), *group]
            self.runs.append((group, log, started(cmd, bench_env(), log)))

    def results(self, out: Results) -> list[str]:
        """One row per group; the groups that failed."""
        failed = []
        for group, log, proc in self.runs:
            proc.wait()
            output = log.read_text(errors="replace")
            summary = (output.strip().splitlines() or ["no output"])[-1]
            # a dry run has no CUDA: every test is skipped, which is its pass
            passed = proc.returncode == 0 and (not self.dry or "passed" not in summary)
            # the assertion lines too: the results file comes back from a device call when its logs may not
            out.write(item=f"CUDA tests: {' '.join(group)}", ok=passed, summary=summary,
                      failures=[line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))][:20],
                      errors=[line[:300] for line in output.splitlines() if line.startswith("E ")][:30])
            if not passed:
                failed.append(" ".join(group))
        return failed


def speed(args, out: Results, load: Load, variants: list[str], profiled: tuple[str, ...]) -> None:
    """Each variant measured as bench/train_speed_gpu.py does, one result line each (its format); those in profiled
    also profiled over three steps after the measured ones. The dataset is the two parts' own (built once); the
    model and its token cache the preset's."""
    import statistics

    import train_speed_gpu as tsg

    shapes = DRY if args.dry else GPU
    if args.variants:
        variants = [v for v in variants if v in args.variants]
    inputs = tsg.prepare(args.workdir, load.preset, shapes.seq, shapes.corpus_mb)
    fpt, _ = tsg.model_figures(inputs.model, shapes.seq)
    run_args = argparse.Namespace(workdir=args.workdir, steps=args.steps or load.steps, discard=load.discard,
                                  timeout=budget_of(args, out.part), seq=shapes.seq)
    preset = load.preset
    errors = []
    for name in variants:
        system, flags, _ = tsg.VARIANTS[name]
        t0 = time.time()
        r = (tsg.run_ours if system == "ours" else tsg.run_hf)(run_args, name, flags, inputs, load.batch,
                                                               profile=name in profiled)
        adapter = "lora" in name
        out.write(item=name, variant=name, system=system, batch=load.batch, seq=shapes.seq, steps=run_args.steps,
                  preset=preset,
                  flops_per_token=None if adapter else fpt, machine=machine(), wall_s=round(time.time() - t0, 1),
                  **r)
        if "error" in r:
            errors.append(f"{name}: {r['error']}")
        else:
            print(f"{name}: {statistics.median(r['tokens_per_s']):,.0f} tokens/s", flush=True)
    if errors:
        raise SystemExit("; ".join(errors))


def full_speed(args, out: Results) -> None:
    # a dry run leaves compilation out (minutes of C++ builds on 2 cores); its flags are all that differs
    # the peer first, then ours at its best: a part cut by the half's time loses the least telling row
    if args.dry:
        speed(args, out, DRY.full_speed, ["hf", "ours-default"], ("hf", "ours-default"))
    else:
        speed(args, out, GPU.full_speed, ["hf-compile", "ours-default-compile", "ours-default"],
              ("hf-compile", "ours-default-compile"))


def adapters(args, out: Results) -> None:
    # the peer first, then the goal's row (QLoRA in 10 GiB), then our LoRA: a part cut by the half's time loses the
    # row an earlier window measured (LoRA 1.12x HF + peft on an H200, 2026-11-26) and not the goal's
    variants = ["hf-peft-lora", "ours-qlora"] if args.dry else ["hf-peft-lora", "ours-qlora", "ours-lora"]
    speed(args, out, (DRY if args.dry else GPU).adapters, variants, ("ours-qlora",))


def grpo(args, out: Results) -> None:
    """GRPO with LoRA on one GPU: per steady step the seconds generating (and scoring) and training, the generated
    tokens per second of generating, completions per second, peak memory; one result line."""
    import statistics

    import train_speed_gpu as tsg
    from grpo_speed import PROMPTS, prompts_dataset, rollout_flags, step_seconds

    from pipeline.train.telemetry import read_metrics

    start, load = time.time(), (DRY if args.dry else GPU).grpo
    steps = args.steps or load.steps
    model, name, runs = tsg.preset_model(args.workdir, load.preset), "ours-grpo-lora", args.workdir / "runs"
    shutil.rmtree(runs / name, ignore_errors=True)
    cmd = torchrun_cmd(1, ROOT / "fsdp1.py", "-e", name, "--save-dir", runs, "-d", prompts_dataset(args.workdir),
                       "-m", model, "--adapter", "lora", "--lora-rank", 16, "--eval-freq", 0,
                       "--precision", "fp32" if args.dry else "bf16",
                       *rollout_flags(load.group, load.length, load.prompts, steps))
    metrics = runs / name / "metrics.jsonl"
    # the run stops a few seconds before the part's budget (spent partly on the model and prompts), so that the steps
    # it finished are written rather than killed with the part
    left = budget_of(args, out.part) - (time.time() - start) - 5
    code, tail = tsg.launch_until(cmd, bench_env(), metrics, lambda evs: any(
        e["event"] == "train" and e["step"] >= steps for e in evs), left)
    train = [e for e in read_metrics(metrics) if e["event"] == "train"] if metrics.exists() else []
    shutil.rmtree(runs / name, ignore_errors=True)
    steady = train[load.discard:]
    if len(steady) < 2:
        raise SystemExit(f"{name}: {tsg.error_of(tail, code)}")
    completions = load.prompts * load.group
    step_s, generate_s = step_seconds(steady)
    tokens = statistics.median(e["completions/mean_length"] * completions for e in steady[1:])
    out.write(item=name, variant=name, preset=load.preset, prompts=load.prompts, group=load.group,
              length=load.length, steps=train[-1]["step"], discard=load.discard,
              prompts_file=str(PROMPTS.relative_to(ROOT)),
              step_s=round(step_s, 3), generate_s=round(generate_s, 3), train_s=round(step_s - generate_s, 3),
              completions_per_s=round(completions / step_s, 2), generated_tokens_per_s=round(tokens / generate_s, 1),
              mean_completion_tokens=round(tokens / completions, 1), machine=machine(),
              peak_alloc_gib=max(e["mem_gb"].get("peak_alloc") or 0 for e in train))
    print(f"{name}: {tokens / generate_s:,.0f} generated tokens/s, {completions / step_s:.2f} completions/s",
          flush=True)
    if train[-1]["step"] < steps:  # the row stays; the part says it was cut
        raise SystemExit(f"{name}: stopped by the part's budget at step {train[-1]['step']} of {steps}")


def grpo_report(rows: list[dict], command: str) -> str:
    """BENCHMARKS.md's grpo_gpu section from the latest GRPO row."""
    r = rows[-1]
    return "\n".join([
        f"- Machine: {r['machine']}; command: {command}.",
        f"- {r['preset']}'s config, random weights, LoRA r16 on every linear layer, one process; {r['prompts']} "
        f"prompts per step x G {r['group']} completions of at most {r['length']} tokens ({r['prompts_file']}, the "
        f"digits reward), generated in the training process; the median of steps {r['discard'] + 2}-{r['steps']}.",
        "",
        table(["system", "completions/s", "generated tokens per second of generating and scoring", "step (s)",
               "generating and scoring (s)", "training (s)", "mean completion (tokens)", "peak GiB alloc"],
              [["fsdp1.py --objective grpo --adapter lora", f"{r['completions_per_s']:.2f}",
                f"{r['generated_tokens_per_s']:,.0f}", f"{r['step_s']:.2f}", f"{r['generate_s']:.2f}",
                f"{r['train_s']:.2f}", f"{r['mean_completion_tokens']:.1f}", f"{r['peak_alloc_gib']:.1f}"]]),
    ])


LONG_FLAGS = ["--adapter", "lora", "--lora-rank", 16, "--activation-checkpointing", "on", "--tiled-mlp", "on",
              "--offload-activations", "on", "--log-freq", 1]


def long_context(args, out: Results) -> None:
    """One LoRA run at batch 1 x long_seq (LONG_FLAGS): its steps' tokens/s, peak memory, and what the start line
    said of the longest sequence that fits the card; one result line (an error line where it did not fit)."""
    import train_speed_gpu as tsg

    shapes = DRY if args.dry else GPU
    load, name = shapes.long_context, "ours-long-context-lora"
    inputs = tsg.prepare(args.workdir, load.preset, shapes.long_seq, shapes.corpus_mb)
    run_args = argparse.Namespace(workdir=args.workdir, steps=args.steps or load.steps, discard=load.discard,
                                  timeout=budget_of(args, out.part), seq=shapes.long_seq)
    t0 = time.time()
    r = tsg.run_ours(run_args, name, LONG_FLAGS, inputs, load.batch)
    out.write(item=name, variant=name, system="ours", batch=load.batch, seq=shapes.long_seq, steps=run_args.steps,
              preset=load.preset, flags=[str(f) for f in LONG_FLAGS], machine=machine(),
              wall_s=round(time.time() - t0, 1), **r)
    if "error" in r:
        raise SystemExit(f"{name}: {r['error']}")


def long_context_report(rows: list[dict], command: str) -> str:
    """BENCHMARKS.md's long_context_gpu section from the latest long-context row."""
    import statistics

    r = rows[-1]
    return "\n".join([
        f"- Machine: {r['machine']}; command: {command}.",
        f"- {r['preset']}'s config, random weights, one GPU, batch {r['batch']} x {r['seq']:,} tokens, bf16: "
        f"fsdp1.py {' '.join(r['flags'][:-2])}.", "",
        table(["sequence", "tokens/s", "peak GiB alloc", "peak GiB reserved", "loss"],
              [[f"{r['seq']:,}", f"{statistics.median(r['tokens_per_s']):,.0f}", f"{r['peak_alloc_gib']:.1f}",
                f"{r['peak_reserved_gib']:.1f}", f"{r['loss']:.4f}"]]),
    ])


MOE_VARIANTS = {"ours-moe": ["--expert-parallel", "1"], "ours-moe-ep": ["--expert-parallel", "2"]}
MOE_FLAGS = ["--strategy", "fsdp2", "--log-freq", 1]


def moe(args, out: Results) -> None:
    """The slice under fsdp2 with expert parallelism off and on over 2 ranks (one GPU each; 2 CPU processes in a dry
    run): a result line each, and one saying why the second was not run where the machine has one GPU."""
    import torch
    import train_speed_gpu as tsg
    from moe_speed import build

    shapes = DRY if args.dry else GPU
    load, ranks = shapes.moe, 2 if args.dry else min(2, torch.cuda.device_count())
    layers = int(load.preset)
    model = build(args.workdir / f"qwen3-30b-a3b-slice-{layers}{'-dry' if args.dry else ''}", layers,
                  "cpu" if args.dry else "cuda", **shapes.moe_slice, **({} if args.dry else {"dtype": "bfloat16"}))
    inputs = tsg.prepare(args.workdir, load.preset, shapes.seq, shapes.corpus_mb, model)
    run_args = argparse.Namespace(workdir=args.workdir, steps=args.steps or load.steps, discard=load.discard,
                                  timeout=budget_of(args, out.part), seq=shapes.seq)
    errors = []
    for name, degree in MOE_VARIANTS.items():
        flags = [*MOE_FLAGS, *(["--precision", "fp32"] if args.dry else []), *degree]
        common = dict(item=name, variant=name, system="ours", batch=load.batch, seq=shapes.seq, ranks=ranks,
                      layers=layers, flags=[str(f) for f in flags], machine=machine())
        if degree[-1] != "1" and ranks < 2:
            out.write(**common, skipped="one GPU: NCCL takes one rank per device, expert parallelism needs two")
            continue
        t0 = time.time()
        r = tsg.run_ours(run_args, name, flags, inputs, load.batch, nproc=ranks)
        out.write(**common, steps=run_args.steps, wall_s=round(time.time() - t0, 1), **r)
        if "error" in r:
            errors.append(f"{name}: {r['error']}")
    if errors:
        raise SystemExit("; ".join(errors))


def moe_report(rows: list[dict], command: str) -> str:
    """BENCHMARKS.md's moe_gpu section from the latest row of each variant."""
    import statistics

    latest = {r["variant"]: r for r in rows}
    first = next(iter(latest.values()))
    body = [[r["variant"], str(r["ranks"]), "not run: " + r["skipped"]] if "skipped" in r else
            [r["variant"], str(r["ranks"]), f"{statistics.median(r['tokens_per_s']) / r['ranks']:,.0f}",
             f"{r['peak_alloc_gib']:.1f}", f"{dict(r['losses'])[r['steps']]:.4f}"]
            for r in latest.values()]
    return "\n".join([
        f"- Machine: {first['machine']}; command: {command}.",
        f"- Qwen3-30B-A3B's shape (bench/moe_speed.py's slice; {first['layers']} layer(s)), batch {first['batch']} x "
        f"{first['seq']:,} per rank: fsdp1.py {' '.join(first['flags'][:-2])}"
        f"{'' if '--precision' in first['flags'] else ' (bf16, the default on a GPU)'} with --expert-parallel 1 or 2; "
        "the loss of both at the same step (equal: the same function).",
        "",
        table(["variant", "GPUs", "tokens/s per GPU", "peak GiB alloc", f"loss at step {first['steps']}"], body),
    ])


RUN = {"setup": setup, "correctness": correctness, "full_speed": full_speed, "adapters": adapters, "grpo": grpo,
       "long_context": long_context, "moe": moe}


# ------------------------------------------------------------------------------------------------- the driver


def budgets(text: str) -> dict[str, int]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if bad := [item for item in pairs if len(item) != 2 or item[0] not in PARTS or not item[1].isdigit()]:
        raise argparse.ArgumentTypeError(f"{'='.join(bad[0])}: want PART=SECONDS with PART one of {', '.join(PARTS)}")
    return {name: int(seconds) for name, seconds in pairs}


def passed_on(args) -> list[str]:
    """The overrides a part's child process needs."""
    return [*(["--variants", ",".join(args.variants)] if args.variants else []),
            *(["--steps", str(args.steps)] if args.steps else []),
            *(["--budget", ",".join(f"{k}={v}" for k, v in args.budget.items())] if args.budget else [])]


def budget_of(args, part: str) -> int:
    if args.part_budget:  # a child: what its parent gave it (the half's time left may have cut it)
        return args.part_budget
    return args.budget.get(part) or (PARTS[part].dry_budget_s if args.dry else PARTS[part].budget_s)


def kill_tree(pid: int) -> None:
    """SIGKILL a part and every process below it. The runs a part starts have sessions of their own (so that each
    can be killed as a group), which killing the part's group alone leaves running: on 2026-11-26 a QLoRA run outlived
    its part and shared the GPU with the next half, halving its figures. Everything below is frozen first (a
    launcher cannot start a replacement), read again until nothing new appears, then killed."""
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGSTOP)
    frozen: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        while new := [p for p in psutil.Process(pid).children(recursive=True) if p.pid not in frozen]:
            for p in new:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.suspend()
                frozen[p.pid] = p
    for p in frozen.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_part(args, name: str, session: str, left: float) -> dict:
    """The part in a child process under its budget or the time left, whichever is less; what it wrote stays in the
    results file either way."""
    budget = int(min(budget_of(args, name), left))
    if budget < 5:
        return {"status": "not run", "seconds": 0.0, "budget_s": budget, "last_line": "no time left in this half"}
    cmd = [sys.executable, __file__, "--part", name, "--session", session, "--workdir", str(args.workdir),
           "--results", str(args.results), "--part-budget", str(budget), *(["--dry"] if args.dry else []),
           *passed_on(args)]
    log = args.workdir / f"{name}.log"
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=bench_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            code = None
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    status = "passed" if code == 0 else "timed out" if code is None else "failed"
    return {"status": status, "seconds": round(time.time() - start, 1), "budget_s": budget,
            "last_line": tail[0][:300] if tail else ""}


def write_tables(args, results: list[dict]) -> list[Path]:
    """The GPU sections from the latest result of each speed variant and the latest profiles: into BENCHMARKS.md,
    or the work folder's SECTION.md files in a dry run."""
    import gpu_profile
    import train_speed_gpu as tsg

    shapes = DRY if args.dry else GPU
    command = f"`make gpu-check` (bench/gpu_check.py; results: {tsg.shown(args.results)})"
    written = []

    def put(section: str, body: str) -> None:
        if args.dry:
            path = args.workdir / f"{section}.md"
            path.write_text(body + "\n")
            written.append(path)
        else:
            update_section(section, body)

    for part, section, load, trained in (("full_speed", "train_speed_gpu", shapes.full_speed, tsg.FULL),
                                         ("adapters", "adapters_gpu", shapes.adapters, tsg.ADAPTERS)):
        latest = {r["variant"]: r for r in results if r["part"] == part and "variant" in r}
        if not latest:
            continue
        steps = max(r.get("steps", load.steps) for r in latest.values())  # a rerun may have measured longer
        table_args = argparse.Namespace(results=args.results, discard=load.discard, steps=steps)
        put(section, tsg.report(table_args, list(latest.values()), f"{load.preset}'s config", command, trained))
    if profiles := gpu_profile.report(results, command):
        put("gpu_profile", profiles)
    if rollouts := [r for r in results if r["part"] == "grpo" and "variant" in r]:
        put("grpo_gpu", grpo_report(rollouts, command))
    if long := [r for r in results if r["part"] == "long_context" and "variant" in r and "error" not in r]:
        put("long_context_gpu", long_context_report(long, command))
    if experts := [r for r in results if r["part"] == "moe" and "variant" in r and "error" not in r]:
        put("moe_gpu", moe_report(experts, command))
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="the rehearsal: on the CPU, tiny shapes, a few steps")
    p.add_argument("--parts", default="all", help=f"comma-separated, or all: {', '.join(PARTS)}")
    p.add_argument("--workdir", type=Path, default=None, help="default .bench/gpu-check (dry: .bench/gpu-check-dry)")
    p.add_argument("--results", type=Path, default=None, help="JSON lines, appended (default WORKDIR/results.jsonl)")
    p.add_argument("--variants", type=lambda v: v.split(","), default=None,
                   help="the speed parts' variants to run (comma-separated; default all of each part's)")
    p.add_argument("--steps", type=int, default=None, help="steps of each speed variant (default the part's)")
    p.add_argument("--budget", type=budgets, default={}, help="seconds per part for a rerun, e.g. full_speed=200")
    p.add_argument("--tables-only", action="store_true", help="run nothing: write the tables from the results file")
    p.add_argument("--half", choices=sorted(HALVES), help="one device call's parts: " + "; ".join(
        f"{k}: {', '.join(v)}" for k, v in HALVES.items()) + f"; at most {HALF_S} s")
    p.add_argument("--half-s", type=int, default=HALF_S, help="seconds a half's parts may take in all")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--part-budget", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--session", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.workdir = (args.workdir or ROOT / ".bench" / ("gpu-check-dry" if args.dry else "gpu-check")).resolve()
    args.results = (args.results or args.workdir / "results.jsonl").resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.part:  # a child: one part
        RUN[args.part](args, Results(args.results, args.session, args.part))
        return
    if args.tables_only:
        for path in write_tables(args, Results(args.results, "", "summary").read()):
            print(f"tables: {path}")
        return
    if args.half and args.parts != "all":
        raise SystemExit("--half and --parts choose the parts both: give one")
    names = list(HALVES[args.half]) if args.half else list(PARTS) if args.parts == "all" else args.parts.split(",")
    if unknown := [n for n in names if n not in PARTS]:
        raise SystemExit(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    session = f"{os.uname().nodename}-{int(time.time())}"
    summary = Results(args.results, session, "summary")
    statuses = {}
    deadline = time.time() + (args.half_s if args.half else math.inf)

    def setup_passed() -> bool:  # or not among the parts asked for
        return statuses.get("setup", {"status": "passed"})["status"] == "passed"

    def run(name: str) -> None:
        if not setup_passed():
            # nothing else can run without its imports or its device
            statuses[name] = {"status": "not run", "seconds": 0.0, "budget_s": 0, "last_line": "setup did not pass"}
        else:
            statuses[name] = run_part(args, name, session, deadline - time.time())
        summary.write(item=name, **statuses[name])

    # A rehearsal runs correctness beside the speed parts (their files are apart: tiny-* and resume/ against the
    # presets' model, data and runs), which start one process at a time. On a GPU the parts run one at a time, so
    # that nothing shares the device with a measurement.
    beside = None
    for name in names:  # setup first: run() reads its status
        if name == "correctness" and args.dry and setup_passed():
            beside = threading.Thread(target=run, args=(name,))
            beside.start()
        else:
            run(name)
    if beside:
        beside.join()
    for path in write_tables(args, summary.read()):
        print(f"tables: {path}")
    failed = [n for n in names if statuses[n]["status"] != "passed"]
    not_passed = ", ".join(f"{n} ({statuses[n]['status']})" for n in failed)
    print(f"gpu-check: {len(statuses) - len(failed)} of {len(names)} parts passed"
          + (f"; not: {not_passed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
