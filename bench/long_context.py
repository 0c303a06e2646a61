"""The longest sequence one training step fits in a fixed memory budget per rank: ours on 1 process and at
--sequence-parallel 2 on 2 ranks, each with the tiled MLP off and on, against the HF Trainer with gradient
checkpointing on 1 process; and tokens/s at a length all of them fit.

SmolLM2-135M's width (hidden 576, intermediate 1536) and vocabulary (49,152 rows; the bundled tokenizer's ids are a
subset) with --layers decoder layers, random weights, fp32 on the CPU, batch 1, activation checkpointing everywhere
(the Trainer's gradient_checkpointing), AdamW. Each run is a real launch (fsdp1.py under torchrun; the Trainer through
bench/hf_worker.py on our token cache's blocks) whose largest process's resident set is sampled every 20 ms (common.
launch), with glibc returning every block above 64 KiB at free (MALLOC_MMAP_THRESHOLD_=65536: its default keeps freed
heap pages, and the peak would measure the allocation pattern). Per system the peak is measured at two lengths, the
longest length under the budget read off the line through them (in steps of 1,024), and that length then run to
check that it fits.

    .venv/bin/python bench/long_context.py --layers 2 --lengths 8192 16384 --cap 49152
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import common

SYSTEMS = {
    "ours, 1 process": (1, ()),
    "ours, 1 process, --tiled-mlp on": (1, ("--tiled-mlp", "on")),
    "ours, --sequence-parallel 2": (2, ("--sequence-parallel", 2)),
    "ours, --sequence-parallel 2, --tiled-mlp on": (2, ("--sequence-parallel", 2, "--tiled-mlp", "on")),
    "HF Trainer, gradient checkpointing": (1, None),
}
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def model_dir(work: Path, layers: int) -> Path:
    from pipeline.prep.tiny import build_tiny

    out = work / f"smollm2-width-{layers}"
    if not (out / "config.json").exists():
        build_tiny(out, layers=layers, hidden=576, model_vocab=49152)
        config = json.loads((out / "config.json").read_text())
        config["max_position_embeddings"] = 1 << 20  # long sequences: rotary positions have no table to outgrow
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def dataset(work: Path, copies: int) -> Path:
    """The bundled corpus's text, copies times over (about 83k tokens each), through DATA-HF."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    out = work / f"corpus-x{copies}"
    if not out.exists():
        raw = work / "raw"
        shutil.rmtree(raw, ignore_errors=True)
        for k in range(copies):
            shutil.copytree(common.ROOT / "examples" / "raw", raw / f"copy{k}", ignore=shutil.ignore_patterns("chats"))
        build_dataset(CorpusConfig(raw, out, num_proc=1))
        shutil.rmtree(raw)
    return out


def blocks_of(runs: Path, seq: int) -> Path:
    """Our token cache's training blocks of seq tokens (built by a run of ours at that length)."""
    for meta in runs.glob("token_cache/*/meta.json"):
        if json.loads(meta.read_text()).get("seq_length") == seq:
            return meta.parent / "train.npy"
    raise FileNotFoundError(f"no token cache of {seq}-token blocks under {runs}")


def run(system: str, seq: int, steps: int, work: Path, model: Path, data: Path) -> dict:
    """One launch: its largest process's peak resident GB and the last step's tokens/s."""
    nproc, flags = SYSTEMS[system]
    runs = work / "runs"
    if flags is None:
        if not any(json.loads(m.read_text()).get("seq_length") == seq for m in runs.glob("token_cache/*/meta.json")):
            common.launch(common.torchrun_cmd(1, common.ROOT / "fsdp1.py", "-e", "cache", "--save-dir", runs, "-d",
                                              data, "-m", model, "--seq-length", seq, "--prepare-only", "true"),
                          common.bench_env())
        out = work / "hf.json"
        launch = common.launch(common.torchrun_cmd(1, common.BENCH / "hf_worker.py", "--model", model, "--blocks",
                                                   blocks_of(runs, seq), "--out", out, "--batch-size", 1,
                                                   "--max-steps", steps, "--grad-ckpt"), common.bench_env(**ENV))
        ends = json.loads(out.read_text())["step_end"]
        rate = seq / (ends[-1] - ends[-2]) if len(ends) > 1 else None
    else:
        launch, events = common.fsdp1(runs, f"l{seq}-{nproc}-{len(flags)}", model, data, "--seq-length", seq,
                                      "--max-steps", steps, "--batch-size", 1, "--log-freq", 1, "--strategy", "fsdp2",
                                      "--activation-checkpointing", "true", *flags, world=nproc, env=ENV)
        rate = [e for e in events if e["event"] == "train"][-1]["tokens_per_s"]
    return {"seq": seq, "peak_gb": round(launch.peak_rss_gb()[0], 3), "tokens_per_s": rate}


def longest(points: list[dict], budget: float, cap: int) -> int:
    """The length where the line through the two measured peaks meets the budget, in steps of 1,024, at most cap
    (also where the peak did not grow between them)."""
    (a, b) = points
    slope = (b["peak_gb"] - a["peak_gb"]) / (b["seq"] - a["seq"])
    if slope <= 0:
        return cap
    return min(cap, int((a["seq"] + (budget - a["peak_gb"]) / slope) // 1024 * 1024))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget-gb", type=float, default=0.0,
                   help="peak resident GB per rank (0: what ours on 1 process needs at the longer --lengths)")
    p.add_argument("--lengths", type=int, nargs=2, default=[8192, 16384], help="the two measured lengths")
    p.add_argument("--copies", type=int, default=8, help="times the bundled corpus is repeated")
    p.add_argument("--only", nargs="*", default=None, choices=list(SYSTEMS),
                   help="run these systems' checks again (their measured points and the others' rows kept from the "
                        "raw results)")
    p.add_argument("--cap", type=int, default=65536, help="the longest length run (a step's time grows with it)")
    p.add_argument("--workdir", type=Path, default=common.ROOT / ".bench" / "long_context")
    args = p.parse_args()
    chosen = "" if args.budget_gb else ": what ours on 1 process needs at the longer length"
    args.workdir.mkdir(parents=True, exist_ok=True)
    model, data = model_dir(args.workdir, args.layers), dataset(args.workdir, args.copies)
    out = common.ROOT / "bench" / "data" / "long_context.json"
    rows = json.loads(out.read_text())["rows"] if args.only else {}
    if args.only:
        args.budget_gb = args.budget_gb or json.loads(out.read_text())["budget_gb"]
    for system in args.only or SYSTEMS:  # ours first: the Trainer reads the blocks our runs cached
        kept = rows.get(system, {}).get("points")  # --only: the measured points kept, the check run again
        points = kept or [run(system, seq, 2, args.workdir, model, data) for seq in args.lengths]
        args.budget_gb = args.budget_gb or points[1]["peak_gb"]
        fit = longest(points, args.budget_gb, args.cap)
        check = run(system, fit, 1, args.workdir, model, data) if fit not in args.lengths and fit else None
        # below the measured points the line is least sure (the fixed part weighs most): lengthened while it fits
        while check and check["peak_gb"] <= args.budget_gb and fit + 1024 < args.lengths[0]:
            longer = run(system, fit + 1024, 1, args.workdir, model, data)
            if longer["peak_gb"] > args.budget_gb:
                break
            fit, check = fit + 1024, longer
        rows[system] = {"points": points, "longest": fit, "check": check}
        print(system, rows[system], flush=True)
    rows = {system: rows[system] for system in SYSTEMS}
    raw = {"machine": common.machine(), "layers": args.layers, "budget_gb": args.budget_gb, "rows": rows}
    out.write_text(json.dumps(raw, indent=2))
    hf = rows["HF Trainer, gradient checkpointing"]["longest"]
    common_len = args.lengths[1]
    table = [[name, f"{r['points'][0]['peak_gb']:.2f} / {r['points'][1]['peak_gb']:.2f}", f"{r['longest']:,}",
              f"{r['check']['peak_gb']:.2f}" if r["check"] else "", f"{r['longest'] / hf:.1f}x",
              r["points"][1]["tokens_per_s"] and round(r["points"][1]["tokens_per_s"])] for name, r in rows.items()]
    body = [f"- Machine: {raw['machine']}.",
            f"- Command: `.venv/bin/python bench/long_context.py --layers {args.layers} --lengths "
            f"{' '.join(map(str, args.lengths))} --cap {args.cap}`; raw results in {out.relative_to(common.ROOT)}.",
            f"- SmolLM2-135M's width and vocabulary x {args.layers} layers, fp32 on the CPU, batch 1, activation "
            f"checkpointing, AdamW, fsdp2 (at --sequence-parallel 2 the two ranks also shard the weights and AdamW's "
            f"state); a budget of {args.budget_gb:.2f} GB peak resident per rank (the largest process, sampled every "
            f"20 ms{chosen}), at most {args.cap:,} tokens run. Peaks "
            f"measured at {args.lengths[0]:,} and {common_len:,} tokens, the longest "
            "length read off the line through them, then run (its peak in the fourth column; below the measured "
            "lengths, lengthened by 1,024 while it fits); tokens/s of the "
            f"second step at {common_len:,} tokens (per run, over its ranks).", "",
            common.table(["system", f"peak GB at {args.lengths[0]:,} / {common_len:,}", "longest in budget",
                          "peak GB there", "vs HF Trainer", f"tokens/s at {common_len:,}"], table)]
    common.update_section("long_context", "\n".join(body))
    print("\n".join(body))


if __name__ == "__main__":
    main()
