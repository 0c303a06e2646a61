"""Chat fine-tuning throughput: fsdp1.py against TRL's SFTTrainer on the same conversations.

The bundled conversations (examples/raw/chats, 302, repeated to --copies of them in another order each time) through
DATA-HF; the same model (random weights), blocks of --seq tokens, --batch blocks per rank, 2 gloo ranks, fp32,
AdamW, clipping 1.0, assistant-only loss, packing on in both (ours: best-fit decreasing into blocks with restarted
positions; TRL: its best-fit decreasing, padding-free). Throughput is counted in trained tokens (the assistant
tokens in the loss) per second and in all tokens per second, over the steady state (the first --discard steps left
out). bench/trl_worker.py also checks our masks against TRL's on every conversation and the first batch's loss.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
from pathlib import Path

from common import (
    BENCH,
    ROOT,
    bar_chart,
    bench_args,
    bench_env,
    build_model,
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


def conversations(work: Path, copies: int) -> Path:
    """A DATA-HF dataset of the bundled conversations, copies times over, once per folder."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.prep.extract import extract_file

    out = work / f"chats-x{copies}"
    if out.exists():
        return out
    chats = [r.messages for f in sorted((ROOT / "examples" / "raw" / "chats").glob("*.json*"))
             for r in extract_file(f).rows if not isinstance(r, str)]
    raw = work / f"chats-x{copies}-raw"
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir(parents=True)
    rng = random.Random(0)
    with (raw / "chats.jsonl").open("w") as f:
        for _ in range(copies):
            rng.shuffle(chats)
            f.writelines(json.dumps({"messages": m}) + "\n" for m in chats)
    build_dataset(CorpusConfig(raw, out, num_proc=1))
    shutil.rmtree(raw)
    return out


def run_ours(args, work: Path, model: Path, data: Path) -> dict:
    out, events = fsdp1(work / "runs", "ours", model, data, "--seq-length", args.seq, "-b", args.batch,
                        "--max-steps", args.steps, "--log-freq", 1, "--ckpt-freq", 0, "--eval-freq", 0,
                        "--async-ckpt", "off", "--lr", 3e-4, "--warmup-steps", 5, "--val-fraction", 0,
                        "--strategy", "fsdp2")  # the table's row: FSDP2 with its vocabulary-parallel head
    train = [e for e in events if e["event"] == "train"]
    shutil.rmtree(work / "runs" / "ours", ignore_errors=True)
    steady = train[args.discard:]
    return {"steps": intervals([e["time"] for e in train], args.discard),
            "targets_per_step": statistics.mean(e["trained_tokens_per_s"] / e["tokens_per_s"] for e in steady)
            * args.world * args.batch * args.seq,
            "peak_rss_gb": max(out.peak_rss_gb()[: args.world])}


def run_trl(args, work: Path, model: Path, data: Path) -> dict:
    result = work / "trl.json"
    cmd = torchrun_cmd(args.world, BENCH / "trl_worker.py", "--model", model, "--dataset", data, "--out", result,
                       "--batch-size", args.batch, "--seq", args.seq, "--max-steps", args.steps)
    out = launch(cmd, bench_env(), timeout=1800)  # about a minute per step on 2 CPU cores (see BENCHMARKS.md)
    r = json.loads(result.read_text())
    return {**r, "steps": intervals(r["step_end"], args.discard),
            "targets_per_step": r["targets_per_row"] * args.world * args.batch,
            "tokens_per_step": r["tokens_per_row"] * args.world * args.batch,
            "peak_rss_gb": max(out.peak_rss_gb()[: args.world])}


def main() -> None:
    p = bench_args(__doc__, repeats=3, layers=2, hidden=256)
    step_args(p, seq=512, batch=2, steps=8, discard=3)
    p.add_argument("--copies", type=int, default=4)
    args = p.parse_args()
    work = args.workdir
    model = build_model(args)
    data = conversations(work, args.copies)
    ours, trl = [], []
    for _ in range(args.repeats):
        ours.append(run_ours(args, work, model, data))
        trl.append(run_trl(args, work, model, data))
        print(json.dumps({"ours": ours[-1]["steps"], "trl": trl[-1]["steps"]}), flush=True)
    report(args, model, ours, trl)


def report(args, model: Path, ours: list[dict], trl: list[dict]) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    step, med = step_medians({"ours": ours, "trl": trl})
    trained = {"ours": ours[0]["targets_per_step"] / med["ours"], "trl": trl[0]["targets_per_step"] / med["trl"]}
    all_tokens = {"ours": args.world * args.batch * args.seq / med["ours"],
                  "trl": trl[0]["tokens_per_step"] / med["trl"]}
    first = trl[0]["first_loss"]
    rows = [["fsdp1.py (FSDP2, vocabulary-parallel head, packed blocks)", spread(step["ours"]),
             f"{ours[0]['targets_per_step']:,.0f}", f"{trained['ours']:,.0f}", f"{all_tokens['ours']:,.0f}",
             spread([r["peak_rss_gb"] for r in ours], 2)],
            ["TRL SFTTrainer (DDP, padding-free BFD packing)", spread(step["trl"]),
             f"{trl[0]['targets_per_step']:,.0f}", f"{trained['trl']:,.0f}", f"{all_tokens['trl']:,.0f}",
             spread([r["peak_rss_gb"] for r in trl], 2)]]
    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/chat_speed.py --repeats {args.repeats}` (TRL from "
        "requirements-bench.txt).",
        f"- Model: Llama, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size:,}, random "
        f"weights. Data: the bundled conversations x{args.copies} ({trl[0]['conversations']:,}). {args.world} gloo "
        f"processes, {args.batch} blocks of {args.seq} tokens per rank, fp32, AdamW, clipping 1.0, {args.steps} "
        f"steps per run of which the first {args.discard} are left out; assistant-only loss, packing on in both.",
        "",
        table(["system", "s/step median (min-max of run medians)", "trained tokens/step", "trained tokens/s",
               "all tokens/s", "peak RSS per rank, GB"], rows),
        "",
        f"Ratio of trained tokens/s, fsdp1.py / TRL: **{trained['ours'] / trained['trl']:.2f}** (target 1.25).",
        "",
        f"Masks: ours and TRL's (transformers' `{{% generation %}}` mask) differ on {trl[0]['mask_mismatches']} of "
        f"{trl[0]['conversations']:,} conversations. First batch ({first['conversations']} conversations, rank 0): "
        f"TRL's loss {first['trl']:.6f}, ours on the same conversations {first['ours']:.6f} (difference "
        f"{abs(first['trl'] - first['ours']):.1e}).",
        "",
        bar_chart("chat_speed_cpu", "Chat fine-tuning, 2 gloo ranks (trained tokens/s, higher is better)",
                  ["fsdp1.py", "TRL SFTTrainer"], [trained["ours"], trained["trl"]], "trained tokens/s"),
    ])
    update_section("chat_speed_cpu", body)
    print(body)


if __name__ == "__main__":
    main()
