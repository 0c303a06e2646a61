"""What the benchmarks share: the bench model, launching real runs while sampling their memory, statistics, and
rewriting the tables of BENCHMARKS.md with a chart per table."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCHMARKS = ROOT / "BENCHMARKS.md"
BENCH = ROOT / "bench"
"""The benchmark scripts and their workers."""
CHARTS = BENCH / "charts"
LLAMA3_VOCAB = 128256


def build_model(args: argparse.Namespace) -> Path:
    """The bundled tiny model's tokenizer with Llama 3's 128k-row embedding and a body of --layers x --hidden, once
    per folder under --workdir (bench_args' options)."""
    from pipeline.prep.tiny import build_tiny

    out = args.workdir / f"llama-128k-{args.layers}x{args.hidden}"
    return out if (out / "config.json").exists() else build_tiny(out, layers=args.layers, hidden=args.hidden,
                                                                 model_vocab=LLAMA3_VOCAB)


def bench_args(doc: str, *, repeats: int, layers: int, hidden: int) -> argparse.ArgumentParser:
    """The options every training-side benchmark has: work folder, repeats, world size and the model's body."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "train")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=layers, help="decoder layers of the bench model")
    p.add_argument("--hidden", type=int, default=hidden, help="hidden size of the bench model")
    return p


def step_args(p: argparse.ArgumentParser, *, seq: int, batch: int, steps: int, discard: int) -> None:
    """The options of a benchmark that times training steps: their shape, how many, and the warm-up left out."""
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--discard", type=int, default=discard, help="warm-up steps left out of the steady state")


def step_medians(systems: dict[str, list[dict]]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per system: each run's median step time (runs as {"steps": [seconds, ...]}), and the median of those."""
    per_run = {name: [statistics.median(r["steps"]) for r in runs] for name, runs in systems.items()}
    return per_run, {name: statistics.median(v) for name, v in per_run.items()}


def demo_dataset(out: Path) -> Path:
    """The bundled corpus's text (its conversations left out: the benchmarks train plain text blocks, as the HF
    Trainer and bare workers read them) through DATA-HF, once per folder."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    if not out.exists():
        raw = out.with_name(out.name + "-raw")
        shutil.rmtree(raw, ignore_errors=True)
        shutil.copytree(ROOT / "examples" / "raw", raw, ignore=shutil.ignore_patterns("chats"))
        build_dataset(CorpusConfig(raw, out, num_proc=1))
        shutil.rmtree(raw)
    return out


def torchrun_cmd(nproc: int, script: str | Path, *args: object) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(script), *map(str, args)]


def bench_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(ROOT / ".bench_hf"),
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


@dataclass
class Launch:
    """A finished command: start time (epoch), RSS samples and output."""
    started: float
    samples: list[tuple[float, int, int]]
    """(epoch seconds, pid, RSS bytes) of every process under the command, every 20 ms."""
    output: str

    def peak_rss_gb(self, until: float = float("inf")) -> list[float]:
        """Peak RSS (GB) of each process up to epoch time `until`, largest first: the workers of a torchrun
        launch come first (the launcher agent is small)."""
        peaks: dict[int, int] = {}
        for t, pid, rss in self.samples:
            if t <= until:
                peaks[pid] = max(peaks.get(pid, 0), rss)
        return sorted((v / 1e9 for v in peaks.values()), reverse=True)


def _sample_tree(pid: int, samples: list) -> None:
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    now = time.time()
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            samples.append((now, proc.pid, proc.memory_info().rss))


def launch(cmd: list[str], env: dict[str, str], timeout: float = 600) -> Launch:
    """Run cmd to the end, sampling the RSS of its process tree every 20 ms."""
    samples: list[tuple[float, int, int]] = []
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            _sample_tree(proc.pid, samples)
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        stop.set()
        sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-4000:]}")
    return Launch(started, samples, output)


def intervals(times: list[float], discard: int) -> list[float]:
    """Seconds between consecutive step ends, without the first `discard` steps (the first step's own duration is
    not known from its end alone, so interval i is step i + 1)."""
    return [b - a for a, b in zip(times[:-1], times[1:], strict=True)][max(discard - 1, 0):]


def spread(values: list[float], digits: int = 3) -> str:
    """'median (min-max)' for a table cell."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def machine() -> str:
    import torch
    import transformers

    cpu, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown CPU":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # "AMD EPYC" alone names CPUs 3x apart on the same step: the vector units say which (BENCHMARKS.md section 12)
    cpu += f", {torch.backends.cpu.get_cpu_capability()}" + (", avx512_bf16" if "avx512_bf16" in flags else "")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, {gpu}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")


def update_section(name: str, body: str) -> None:
    """Replace the text between <!-- bench:NAME --> and <!-- /bench:NAME --> in BENCHMARKS.md (append if absent)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS.write_text(text)


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def bar_chart(name: str, title: str, labels: list[str], values: list[float], unit: str,
              errors: list[tuple[float, float]] | None = None) -> str:
    """A horizontal bar chart to bench/charts/NAME.png; returns the Markdown image line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    CHARTS.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 0.55 * len(labels) + 1.2))
    xerr = None
    if errors:
        xerr = [[v - lo for v, (lo, _) in zip(values, errors, strict=True)],
                [hi - v for v, (_, hi) in zip(values, errors, strict=True)]]
    ax.barh(labels, values, xerr=xerr, color="#4C72B0", capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(CHARTS / f"{name}.png", dpi=110)
    plt.close(fig)
    return f"![{title}](bench/charts/{name}.png)"


def fsdp1(runs: Path, name: str, model: Path, data: Path, *flags: object, world: int = 2,
          fresh: bool = True, env: dict[str, str] | None = None) -> tuple[Launch, list[dict]]:
    """One fsdp1.py run under torchrun (fp32 on CPU, no evaluation); returns the launch and its metrics events."""
    if fresh:
        shutil.rmtree(runs / name, ignore_errors=True)
    cmd = torchrun_cmd(world, ROOT / "fsdp1.py", "-e", name, "--save-dir", runs, "-d", data, "-m", model,
                       "--precision", "fp32", "--eval-freq", 0, "--lr", 3e-4, "--warmup-steps", 5, "--num-proc", 1,
                       *flags)
    out = launch(cmd, bench_env(**(env or {})))
    from pipeline.train.telemetry import read_metrics

    return out, read_metrics(runs / name / "metrics.jsonl")


def memory_plan(model: Path, world: int, *flags: object):
    """What fsdp1.py's preflight resolves for these flags on `world` CPU ranks of one node: the strategy (auto
    resolved, in the returned config) and the memory estimate. Returns (config, MemoryPlan)."""
    from transformers import AutoConfig

    from pipeline import config_merge as config_mod
    from pipeline.strategies.auto import plan_memory

    # rank 0 of a plain env launch (launch.detect refuses a partial one): nothing here joins a group
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), LOCAL_RANK="0", RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    cfg = config_mod.resolve(["-e", "plan", "-d", "unused", "-m", str(model), *map(str, flags)])
    plan = plan_memory(cfg, AutoConfig.from_pretrained(model), "cpu")
    return plan.config, plan
