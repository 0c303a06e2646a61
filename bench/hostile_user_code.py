"""The user's own code inside training, as a hostile or careless user writes it (issue 77's classes): each case a
real `fsdp1.py --nproc-per-node 2` GRPO run on the bundled tiny model, its exit code, seconds (from the signal, for
a stop), whether anything but the one line (and rank 0's log) was printed, and that line. Run by
bench/hostile_inputs.py --part user-code."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import common

REWARDS = '''
import os, sys, time
from pathlib import Path

def parity(prompts, completions, completion_ids, **columns):
    return [float(len(ids) % 2) for ids in completion_ids]

def sleeps(prompts, completions, completion_ids, trainer_state, **columns):
    if trainer_state.global_step == 1:
        Path(os.environ["MARK"]).touch()
        time.sleep(10**6)
    return [1.0] * len(completions)

def spins(prompts, completions, completion_ids, trainer_state, **columns):
    if trainer_state.global_step == 1:
        Path(os.environ["MARK"]).touch()
        while True:
            try:
                pass
            except Exception:
                pass
    return [1.0] * len(completions)

def slow(prompts, completions, completion_ids, **columns):
    time.sleep(10**6)

def exits(prompts, completions, completion_ids, **columns):
    sys.exit()

def interrupts(prompts, completions, completion_ids, **columns):
    raise KeyboardInterrupt

class Exiting(float):
    def __float__(self):
        sys.exit(0)

def exits_when_read(prompts, completions, completion_ids, **columns):
    return [Exiting(1.0) for _ in completions]

def fails_on_rank(prompts, completions, completion_ids, **columns):
    if os.environ["RANK"] == os.environ["ON_RANK"]:
        raise ValueError("only here")
    return [1.0] * len(completions)

def short_on_rank(prompts, completions, completion_ids, **columns):
    return [1.0] * (len(completions) - (os.environ["RANK"] == os.environ["ON_RANK"]))

def huge(prompts, completions, completion_ids, **columns):
    return [1e39] * len(completions)

def abstains(prompts, completions, completion_ids, **columns):
    return [None] * len(completions)

def as_numpy(prompts, completions, completion_ids, **columns):
    import numpy as np
    return np.array([float(len(ids) % 2) for ids in completion_ids])

def as_tensor(prompts, completions, completion_ids, **columns):
    import torch
    return torch.tensor([float(len(ids) % 2) for ids in completion_ids])

def numpy_scalars(prompts, completions, completion_ids, **columns):
    import numpy as np
    return [np.float64(len(ids) % 2) for ids in completion_ids]

def nan(prompts, completions, completion_ids, **columns):
    return [0.5] * len(completions)
'''


@dataclass
class Case:
    name: str
    cls: int
    """The issue's class (1-8)."""
    flags: list
    env: dict = field(default_factory=dict)
    ready: Callable[[Path], bool] | None = None
    """For a stop: SIGTERM once ready(run folder) holds."""
    before: Callable[[], None] | None = None
    """Run before the case (a first run, a file edited)."""
    command: list | None = None
    """The whole fsdp1.py command after -e NAME, where it is not a GRPO run with these rewards."""


def cases(work: Path) -> list[Case]:
    r = work / "r" / "rewards.py"
    odd = work / "a,b:c" / "rewards.py"
    mark = work / "mark"
    long = ["--strategy", "fsdp2", "--max-completion-length", 1500, "--max-steps", 3]
    return [
        Case("SIGTERM in a 1,500-token generation (fsdp2)", 1, [f"{r}:parity", *long], ready=_generating()),
        Case("SIGTERM in a sleeping reward (ddp)", 1, [f"{r}:sleeps", "--max-steps", 3], {"MARK": str(mark)},
             ready=lambda run: mark.exists(), before=lambda: mark.unlink(missing_ok=True)),
        Case("SIGTERM in a spinning reward that catches Exception", 1, [f"{r}:spins", "--max-steps", 3],
             {"MARK": str(mark)}, ready=lambda run: mark.exists(), before=lambda: mark.unlink(missing_ok=True)),
        Case("SIGTERM in a DPO reference pass (6,400 pairs, 4 x 256 model)", 1, [], ready=_in_the_pass,
             command=["-d", work / "pairs", "-m", work / "wide", "--objective", "dpo", "--precision", "fp32",
                      "--seq-length", 64, "--val-fraction", 0, "--max-steps", 2]),
        Case("a reward past --reward-timeout 2", 1, [f"{r}:slow", "--reward-timeout", 2]),
        Case("sys.exit() in a reward", 2, [f"{r}:exits"]),
        Case("sys.exit(0) at the reward file's import", 2, [f"{work / 'exit_at_import.py'}:f"]),
        Case("KeyboardInterrupt raised by a reward", 2, [f"{r}:interrupts"]),
        Case("SystemExit from a returned value's __float__", 2, [f"{r}:exits_when_read"]),
        Case("a reward raising on rank 1 only", 3, [f"{r}:fails_on_rank"], {"ON_RANK": "1"}),
        Case("a reward raising on rank 0 only", 3, [f"{r}:fails_on_rank"], {"ON_RANK": "0"}),
        Case("one value too few on rank 1 only", 3, [f"{r}:short_on_rank"], {"ON_RANK": "1"}),
        Case("a reward of 1e39 (inf in float32)", 4, [f"{r}:huge"]),
        Case("every reward abstains (None)", 4, [f"{r}:abstains"]),
        Case("accuracy on prompts without an answer column", 4, ["accuracy"], {"DATA": "no-answer"}),
        Case("rewards as a numpy array", 5, [f"{r}:as_numpy"]),
        Case("rewards as a tensor", 5, [f"{r}:as_tensor"]),
        Case("rewards as numpy scalars", 5, [f"{r}:numpy_scalars"]),
        Case("every reward weight 0", 5, [f"{r}:parity:0"]),
        Case("--max-completion-length 2600 on 2,048 positions", 5, [f"{r}:parity", "--max-completion-length", 2600]),
        Case("an edited helper module beside the reward, on resume", 6, [f"{work / 'h' / 'uses.py'}:f", "--ckpt-freq",
                                                                          1, "--max-steps", 2],
             before=lambda: _edit_helper(work)),
        Case("a path holding ':' and ','", 7, [f"accuracy:0.5,{odd}:parity"]),
        Case("a function named nan", 7, [f"{r}:nan"]),
        Case("a weight that is not a number", 7, [f"{r}:parity:abc"]),
        Case("a reward file parsing the command line at import", 7, [f"{work / 'argv.py'}:f"]),
        Case("--loss-type unknown", 7, [f"{r}:parity", "--loss-type", "unknown"]),
    ]


def _in_the_pass(run: Path) -> bool:
    """Once the reference pass has saved its first chunk (of about 25)."""
    return any(run.parent.glob("token_cache/*/reference/*.partial/train/chunk-00000.npy"))


def _generating() -> Callable[[Path], bool]:
    """Ready one second after step 1's train event: inside step 2's generation (about 5 s here), not at the
    boundary before it (a millisecond, which a signal sent at the event itself hits)."""
    seen: list[float] = []

    def ready(run: Path) -> bool:
        if not seen and (run / "metrics.jsonl").exists() and '"train"' in (run / "metrics.jsonl").read_text():
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 1

    return ready


def _edit_helper(work: Path) -> None:
    """A first run of the case checkpointed with one helper, which is then edited (the case is the rerun)."""
    run(work, Case("first", 6, [f"{work / 'h' / 'uses.py'}:f", "--ckpt-freq", 1, "--max-steps", 1]), "helper")
    (work / "h" / "helper.py").write_text("VALUE = 2.0\n")


def files(work: Path) -> None:
    for folder in (work / "r", work / "a,b:c", work / "h"):
        folder.mkdir(parents=True, exist_ok=True)
    (work / "r" / "rewards.py").write_text(REWARDS)
    (work / "a,b:c" / "rewards.py").write_text(REWARDS)
    (work / "exit_at_import.py").write_text("import sys\nsys.exit(0)\n")
    (work / "argv.py").write_text("import argparse\nargs = argparse.ArgumentParser().parse_args()\n"
                                  "def f(prompts, completions, completion_ids, **columns):\n"
                                  "    return [1.0] * len(completions)\n")
    (work / "h" / "helper.py").write_text("VALUE = 1.0\n")
    (work / "h" / "uses.py").write_text("from helper import VALUE\n\ndef f(prompts, completions, completion_ids, "
                                        "**columns):\n    return [VALUE] * len(completions)\n")
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    (work / "pairs-raw").mkdir(exist_ok=True)
    pairs = [{"prompt": f"Add {a} and {b}.", "chosen": f" {a + b}", "rejected": f" {a * b + 1}"}
             for a in range(80) for b in range(80)]
    (work / "pairs-raw" / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in pairs))
    build_dataset(CorpusConfig(work / "pairs-raw", work / "pairs", num_proc=1))
    for name, extra in (("prompts", {"answer": "4"}), ("no-answer", {"topic": "sums"})):
        (work / f"{name}-raw").mkdir(exist_ok=True)
        rows = [{"prompt": f"What is {i} + {i}?", **extra} for i in range(48)]
        (work / f"{name}-raw" / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        build_dataset(CorpusConfig(work / f"{name}-raw", work / name, num_proc=1))


def run(work: Path, case: Case, name: str) -> dict:
    """One case: its exit code, seconds (from the signal for a stop), the lines beyond rank 0's log, the last one."""
    data = work / case.env.get("DATA", "prompts")
    grpo = ["-d", data, "-m", work / "tiny", "--objective", "grpo", "--num-generations", 2, "-b", 2,
            "--max-completion-length", 8, "--max-steps", 2, "--val-fraction", 0, "--eval-base", "false",
            "--reward", *case.flags]
    cmd = [sys.executable, str(common.ROOT / "fsdp1.py"), "--nproc-per-node", "2", "-e", name, "--save-dir",
           str(work / "runs"), "--config", str(common.ROOT / "configs" / "demo.yaml"), "--log-freq", "1",
           "--ckpt-freq", "0", *map(str, case.command or grpo)]
    env = common.bench_env(**{k: v for k, v in case.env.items() if k != "DATA"})
    log = work / f"{name}.log"
    with open(log, "w") as out:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=common.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        if case.ready is not None:
            while proc.poll() is None and not case.ready(work / "runs" / name):
                time.sleep(0.01)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
    seconds = time.monotonic() - started
    lines = log.read_text().splitlines() or [""]
    # beyond rank 0's log and the last line: a first start's note on checking the weights is the only line expected
    beyond = [s for s in lines[:-1] if not s.startswith(("[rank=0]", "checked 1 of 1 weight files"))]
    return {"exit": code, "seconds": round(seconds, 2), "other_lines": len(beyond), "traceback": any(
        "Traceback" in s for s in lines), "line": lines[-1]}


def run_all(work: Path) -> dict[str, dict]:
    from pipeline.prep.tiny import build_tiny

    files(work)
    if not (work / "tiny" / "config.json").exists():
        build_tiny(work / "tiny")
        build_tiny(work / "wide", layers=4, hidden=256)
    out = {}
    for i, case in enumerate(cases(work)):
        if case.before is not None:
            case.before()
        out[case.name] = {"class": case.cls, **run(work, case, "helper" if case.cls == 6 else f"c{i}")}
        print(case.name, out[case.name], flush=True)
    return out


def table(results: dict[str, dict], work: Path) -> str:
    def shown(line: str) -> str:
        return line.replace(str(work) + "/", "").replace("|", "\\|")[:150]

    return common.table(["class", "case", "exit", "seconds", "lines beyond the one", "traceback", "last line"],
                        [[v["class"], k, v["exit"], v["seconds"], v["other_lines"],
                          "yes" if v["traceback"] else "no", shown(v["line"])] for k, v in results.items()])

