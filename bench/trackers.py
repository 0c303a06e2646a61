"""What each --report-to tracker costs a run: its start (once per run and per resume), each log window's call (a train
event's numbers, on rank 0 while the other ranks wait at the next step's collective) and its end. Each tracker in a
process of its own, as a run has it (a first import included in the start), writing its offline store.

    .venv/bin/python bench/trackers.py [--windows 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, machine, table, update_section

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")

ONE = """import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from pipeline.train.trackers import Trackers
run, name, windows = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
trackers = Trackers(run, name, {f"field_{i}": i for i in range(80)})
started = time.perf_counter() - t0
event = {f"train/{k}": 1.0 for k in ("loss", "lr", "grad_norm", "tokens_per_s", "trained_tokens_per_s", "mfu")}
event |= {f"train/time_ms/{k}": 1.0 for k in ("data", "forward", "backward", "update", "total", "collectives")}
event |= {f"train/mem_gb/{k}": 1.0 for k in ("alloc", "peak_alloc", "reserved", "peak_reserved")}
calls = []
for step in range(1, windows + 1):
    t = time.perf_counter()
    trackers.scalars(step, {k: v * step for k, v in event.items()})
    calls.append((time.perf_counter() - t) * 1000)
t = time.perf_counter()
trackers.close()
print("RESULT", json.dumps({"start_s": started, "calls_ms": calls, "close_s": time.perf_counter() - t,
                  "active": bool(trackers.active) or not calls}))
"""


def measure(name: str, windows: int, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACKIO_DIR": str(work / "trackio-store"), "WANDB_SILENT": "true"}
    (work / name).mkdir()
    proc = subprocess.run([sys.executable, "-c", ONE, str(work / name), name, str(windows)], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: {proc.stderr[-2000:]}")
    # the trackers print lines of their own, some at exit
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=200, help="log windows per tracker")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in TRACKERS:
            r = measure(name, args.windows, Path(tmp))
            calls = r["calls_ms"]
            rows.append([name, f"{r['start_s']:.2f}", f"{statistics.median(calls):.2f}",
                         f"{max(calls):.1f}", f"{r['close_s']:.2f}"])
            print(name, rows[-1], flush=True)
    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/trackers.py --windows {args.windows}` (each tracker in a process of its "
        "own, its offline store on this machine's disk; a window: a train event's 16 numbers).",
        "",
        table(["tracker", "start, s (first import included)", "a log window, ms (median)", "slowest window, ms",
               "end, s"], rows),
    ])
    update_section("trackers", body)


if __name__ == "__main__":
    main()
