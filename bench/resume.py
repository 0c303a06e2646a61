"""Resume: launch to training again from a complete checkpoint, against a fresh start from the base weights.

A resume fills the model from the checkpoint only and never opens the base model's safetensors (before issue 18 it
read them all, then overwrote every parameter from the checkpoint). "Launch to loaded" ends when the last rank logs
its model line (train.log), just before the first step; "checkpoint load" is what the trainer reports for verifying
and loading the checkpoint (model and optimizer).

    .venv/bin/python bench/resume.py --layers 8 --hidden 2048 --repeats 2 [--cold] [--code DIR --label NAME]

--code: the checkout whose fsdp1.py is measured (default: this one), so an older commit is measured the same way;
each result is kept under its --label and the table shows every label measured so far. --cold: the page cache is
dropped before each measured run (needs root), as on a node that restarts, so files are read from disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
from pathlib import Path

import common
from startup import loaded, model_gb

RESULTS = common.ROOT / "bench" / "data" / "resume_cpu.json"


def run(code: Path, runs: Path, model: Path, data: Path, max_steps: int, world: int) -> float:
    """fsdp1.py of that checkout (fp32, a checkpoint every step); seconds from launch to loaded."""
    cmd = common.torchrun_cmd(world, code / "fsdp1.py", "-e", "resume", "--save-dir", runs, "-d", data, "-m", model,
                       "--precision", "fp32", "--seq-length", 128, "-b", 1, "--max-steps", max_steps, "--ckpt-freq",
                       1, "--eval-freq", 0, "--log-freq", 1, "--async-ckpt", "off", "--num-proc", 1)
    env = {**common.bench_env(), "PYTHONPATH": str(code)}  # that checkout's pipeline/, not this one's
    out = common.launch(cmd, env)
    return loaded(runs / "resume") - out.started


def checkpoint_load_seconds(run_dir: Path) -> float:
    """The last 'resumed from ... in X s' of train.log."""
    found = re.findall(r"resumed from \S+ at step \d+ \(epoch \d+\) in ([\d.]+) s", (run_dir / "train.log").read_text())
    return float(found[-1])


def drop_page_cache() -> None:
    """Make the next run read its files from disk, as after a node restart (root only)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError as exc:
        raise SystemExit(f"--cold needs to drop the page cache (root): {exc}") from None


def measure(code: Path, work: Path, model: Path, data: Path, world: int, cold: bool) -> dict[str, float]:
    runs = work / "runs"
    shutil.rmtree(runs / "resume", ignore_errors=True)
    if cold:
        drop_page_cache()
    fresh = run(code, runs, model, data, 1, world)
    if cold:
        drop_page_cache()
    resumed = run(code, runs, model, data, 2, world)
    return {"fresh": fresh, "resume": resumed, "checkpoint_load": checkpoint_load_seconds(runs / "resume")}


def main() -> None:
    p = common.bench_args(__doc__, repeats=2, layers=8, hidden=2048)
    p.add_argument("--code", type=Path, default=common.ROOT, help="checkout to measure (default: this one)")
    p.add_argument("--label", default="this checkout", help="name of the checkout in the table")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each measured run (root)")
    args = p.parse_args()
    work = args.workdir
    model = common.build_model(args)
    data = common.demo_dataset(work / "dataset")
    measure(args.code.resolve(), work, model, data, args.world, False)  # the token cache, outside the measured runs
    runs = [measure(args.code.resolve(), work, model, data, args.world, args.cold) for _ in range(args.repeats)]
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[args.label] = {"model_gb": model_gb(model), "layers": args.layers, "hidden": args.hidden,
                           "world": args.world, "runs": runs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    report(args, results)


def report(args, results: dict) -> None:
    rows = []
    for label, r in results.items():
        runs = r["runs"]
        rows.append([label, common.spread([x["fresh"] for x in runs], 1), common.spread([x["resume"] for x in runs], 1),
                     common.spread([x["checkpoint_load"] for x in runs], 1),
                     f"{statistics.median(x['fresh'] - x['resume'] for x in runs):.1f}"])
    first = next(iter(results.values()))
    body = "\n".join([
        f"- Machine: {common.machine()}.",
        f"- Command: `.venv/bin/python bench/resume.py --layers {args.layers} --hidden {args.hidden} --repeats "
        f"{args.repeats} [--cold] [--code CHECKOUT --label NAME]`; raw results in bench/data/resume_cpu.json.",
        f"- Model: Llama, {first['layers']} layers, hidden {first['hidden']}, vocab 128,256, tied, fp32 safetensors "
        f"of {first['model_gb']:.2f} GB; {first['world']} ranks; checkpoint after step 1 (model and AdamW states); "
        "token cache already built.",
        "",
        common.table(["code", "fresh start: launch to loaded, s", "resume: launch to loaded, s", "checkpoint load, s",
               "fresh minus resume, s"], rows),
    ])
    common.update_section("resume_cpu", body)
    print(body)


if __name__ == "__main__":
    main()
