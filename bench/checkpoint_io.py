"""Checkpoints: synchronous against asynchronous save, and load, through fsdp1.py's own events.

Each run trains --steps steps with a checkpoint every --every steps (model, optimizer and trainer state through
DCP, then manifest and state.json). From the `checkpoint` events: the training stall per checkpoint (how long the
loop was blocked), the save time until the checkpoint is complete, and the bytes written. Then the same command
is rerun with more steps: its `resume` event gives the seconds to verify and load. Sync and async runs alternate
with a run that saves nothing in between: the training time lost per checkpoint is the difference of the loop's
times (first to last step end) over the number of checkpoints, which also counts a background write slowing the
steps it overlaps (on 2 cores it competes with training for them).

    .venv/bin/python bench/checkpoint_io.py --repeats 2
"""

from __future__ import annotations

import statistics
from pathlib import Path

from common import bar_chart, bench_args, build_model, demo_dataset, fsdp1, machine, spread, table, update_section


def loop_seconds(events: list[dict]) -> float:
    ends = [e["time"] for e in events if e["event"] == "train"]
    return ends[-1] - ends[0]


def one_run(work: Path, model: Path, data: Path, mode: str, args) -> dict:
    name = f"ckpt-{mode}"
    base = ("--seq-length", 128, "-b", 2, "--log-freq", 1, "--max-steps")
    flags = ("--ckpt-freq", args.every, "--keep-last", 2, "--async-ckpt", mode)
    _, events = fsdp1(work / "runs", name, model, data, *base, args.steps, *flags, world=args.world)
    # the last checkpoint is written at the end of training, always synchronously: leave it out
    saves = [e for e in events if e["event"] == "checkpoint" and e["step"] < args.steps]
    _, plain = fsdp1(work / "runs", "ckpt-none", model, data, *base, args.steps, "--ckpt-freq", 0, world=args.world)
    lost = (loop_seconds(events) - loop_seconds(plain)) / len(saves)
    _, events = fsdp1(work / "runs", name, model, data, *base, args.steps + 1, *flags, world=args.world, fresh=False)
    resume = next(e for e in events if e["event"] == "resume")
    return {"stall": [e["stall_seconds"] for e in saves], "seconds": [e["seconds"] for e in saves],
            "bytes": saves[-1]["bytes"], "load": resume["seconds"], "lost": lost}


def main() -> None:
    p = bench_args(__doc__, repeats=2, layers=2, hidden=256)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--every", type=int, default=5)
    args = p.parse_args()
    model = build_model(args)
    data = demo_dataset(args.workdir / "dataset")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(one_run(args.workdir, model, data, mode, args))
    report(args, runs)


def report(args, runs: dict[str, list[dict]]) -> None:
    rows, stalls, saves = [], {}, {}
    for mode, label in (("off", "synchronous (dcp.save)"), ("on", "asynchronous (dcp.async_save)")):
        stall = [s for r in runs[mode] for s in r["stall"]]
        seconds = [s for r in runs[mode] for s in r["seconds"]]
        size = runs[mode][0]["bytes"]
        stalls[mode], saves[mode] = stall, seconds
        rows.append([label, spread(stall, 3), spread([r["lost"] for r in runs[mode]], 3), spread(seconds, 3),
                     f"{size / 1e6:,.0f}", f"{size / 1e9 / statistics.median(seconds):.2f}",
                     spread([r["load"] for r in runs[mode]], 3)])
    ratio = statistics.median(stalls["on"]) / statistics.median(saves["off"])
    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/checkpoint_io.py --repeats {args.repeats}` (part of `make bench`).",
        f"- What is saved: the {args.layers}-layer, hidden-{args.hidden}, 128k-vocabulary Llama of the training "
        "table (fp32) with its AdamW states, sharded over 2 gloo ranks, plus RNG and trainer state; "
        f"{args.steps} steps with a checkpoint every {args.every}; the final one (always synchronous) is left out.",
        "",
        table(["save mode", "training stall s", "training time lost s", "save until complete s", "MB written",
               "GB/s", "resume: verify + load s"], rows),
        "",
        f"Async stall / sync save time: **{ratio:.2f}** (target at most 0.10).",
        "",
        bar_chart("checkpoint_stall_cpu", "Training stall per checkpoint, CPU (s, lower is better)",
                  ["synchronous", "asynchronous"],
                  [statistics.median(stalls["off"]), statistics.median(stalls["on"])], "s",
                  [(min(stalls["off"]), max(stalls["off"])), (min(stalls["on"]), max(stalls["on"]))]),
    ])
    update_section("checkpoint_cpu", body)
    print(body)


if __name__ == "__main__":
    main()
