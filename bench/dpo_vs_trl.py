"""DPO: fsdp1.py against TRL's DPOTrainer, step by step on the same pairs in the same order, and for speed.

Exactness (section `dpo_trl_exact`): the bundled preference pairs (examples/preferences, through DATA-HF) on the
tiny Llama, fp32, 2 gloo ranks, 2 pairs per rank per step, 12 steps, beta 0.1, AdamW (0.9, 0.95), clipping 1.0,
cosine after warm-up; full fine-tuning (ours: the reference computed once before step 1; TRL: a copy of the model)
and LoRA r16 on every linear layer (both: the adapters switched off). Our blocks hold one pair each (the block
length is chosen so), so that a step of ours and of TRL's sees the same pairs: bench/trl_dpo_worker.py reorders
TRL's rows into our sampler's order and checks that its tokens of every pair are ours. The table gives, per case,
the largest difference over the 12 steps of the loss and of each TRL metric.

Speed (section `dpo_trl_speed`): SmolLM2-135M's shape (random weights), pairs made from the bundled conversations
(a conversation's last answer chosen, another conversation's last answer rejected), 2 gloo ranks, fp32: our packed
blocks of --seq tokens against TRL's padded batches of the same number of pairs per step on average; real tokens
(padding left out) per second and peak RSS per rank.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path

from common import (
    BENCH,
    ROOT,
    bench_args,
    bench_env,
    fsdp1,
    launch,
    machine,
    step_args,
    table,
    torchrun_cmd,
    update_section,
)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
DATE = "26 Jul 2024"


def pairs_dataset(work: Path) -> Path:
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    out = work / "pairs"
    if not (out / "state.json").exists():
        build_dataset(CorpusConfig(ROOT / "examples" / "preferences", out, num_proc=1, overwrite=True))
    return out


def one_pair_per_block(model: Path, data: Path) -> int:
    """A block length that holds the longest pair and not the two shortest (a multiple of 8)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from pipeline.data import chat_tokens
    from pipeline.data.pair_tokens import tokenize_pair

    tok = AutoTokenizer.from_pretrained(model)
    keep = chat_tokens.special_texts(tok)
    lengths = [len(tokenize_pair(tok, r["text"], r["messages"], r["chosen"], r["rejected"], DATE, keep))
               for r in load_from_disk(str(data))]
    seq = -(-max(lengths) // 8) * 8
    if seq >= 2 * min(lengths):
        raise SystemExit(f"pairs of {min(lengths)} to {max(lengths)} tokens: no block length holds one and not two")
    return seq


def ours(work: Path, name: str, model: Path, data: Path, seq: int, flags: list) -> list[dict]:
    _, events = fsdp1(work / "runs", name, model, data, "--objective", "dpo", "--pref-beta", 0.1, "--seq-length",
                      seq, "-b", 2, "--max-steps", 12, "--log-freq", 1, "--ckpt-freq", 0, "--async-ckpt", "off",
                      "--val-fraction", 0, "--chat-date", DATE, *flags)
    return [e for e in events if e["event"] == "train"]


def trl(work: Path, model: Path, data: Path, flags: list) -> dict:
    out = work / "trl_dpo.json"
    out.unlink(missing_ok=True)
    launch(torchrun_cmd(2, BENCH / "trl_dpo_worker.py", "--model", model, "--dataset", data, "--out", out,
                        "--batch-size", 2, "--max-steps", 12, "--beta", 0.1, "--chat-date", DATE, *flags),
           bench_env(), timeout=1800)
    return json.loads(out.read_text())


def tiny_llama(work: Path) -> Path:
    """The tiny Llama the exactness comparisons train, built once in the work folder."""
    from pipeline.prep.tiny import build_tiny

    model = work / "tiny-llama"
    if not (model / "config.json").exists():
        build_tiny(model)
    return model


def largest(mine: list[dict], theirs: dict[int, dict], key: str) -> float:
    """The largest |ours - TRL's| of a figure over the steps where both have it (TRL's KTO leaves out a step's
    rewards/chosen when its batch holds no desirable example; ours is NaN there)."""
    diffs = [abs(e[key] - theirs[e["step"]][key]) for e in mine
             if key in theirs[e["step"]] and e.get(key) is not None and not math.isnan(e[key])]
    return max(diffs, default=math.nan)


def compare(case: str, mine: list[dict], theirs: dict, metrics: tuple[str, ...], steps: int, rows: list,
            details: dict) -> None:
    """One case of an exactness comparison, ours against TRL's per-step log: its table row (appended to rows), its
    per-step values (details[case]) and its largest differences (printed)."""
    by_step = {e["step"]: e for e in theirs["logs"]}
    diffs = {k: largest(mine, by_step, k) for k in ("loss", *metrics)}
    details[case] = {"ours": [{k: e.get(k) for k in ("step", "loss", *metrics)} for e in mine],
                     "trl": theirs["logs"], "matched": theirs["matched"],
                     "token_mismatches": theirs["token_mismatches"], "trainable": theirs.get("trainable")}
    rows.append([case, f"{theirs['token_mismatches']} of {theirs['matched']}", f"{mine[0]['loss']:.7f}",
                 f"{by_step[1]['loss']:.7f}", f"{mine[-1]['loss']:.5f}", f"{by_step[steps]['loss']:.5f}",
                 *(f"{diffs[k]:.1e}" for k in ("loss", *metrics))])
    print(json.dumps({case: diffs}), flush=True)


def exact_table(items: str, metrics: tuple[str, ...], steps: int, rows: list) -> str:
    """The exactness table of compare()'s rows (items: what a block holds, "pairs" or "examples")."""
    return table(["case", f"{items} whose tokens differ", "loss step 1, ours", "TRL", f"loss step {steps}, ours", "TRL",
                  "largest |diff|: loss", *metrics], rows)


def exactness(args) -> None:
    work = args.workdir
    model = tiny_llama(work)
    data = pairs_dataset(work)
    seq = one_pair_per_block(model, data)
    cases = {"full fine-tuning, ours ddp": (["--strategy", "ddp", "--lr", 1e-3, "--warmup-steps", 2],
                                            ["--lr", 1e-3, "--warmup-steps", 2]),
             "full fine-tuning, ours fsdp2": (["--strategy", "fsdp2", "--lr", 1e-3, "--warmup-steps", 2],
                                              ["--lr", 1e-3, "--warmup-steps", 2]),
             "LoRA r16, ours fsdp2": (["--strategy", "fsdp2", "--adapter", "lora", "--lr", 2e-3, "--warmup-steps", 2],
                                      ["--lr", 2e-3, "--warmup-steps", 2, "--lora-rank", 16])}
    rows, details = [], {}
    trl_runs: dict[str, dict] = {}
    for case, (our_flags, trl_flags) in cases.items():
        name = "dpo-" + case.split(",")[0].split()[0].lower()
        mine = ours(work, name, model, data, seq, our_flags)
        cache = run_cache(work / "runs" / name)
        key = json.dumps(trl_flags)
        if key not in trl_runs:  # the full fine-tuning cases share TRL's run
            trl_runs[key] = trl(work, model, data, [*trl_flags, "--order", cache])
        compare(case, mine, trl_runs[key], METRICS, 12, rows, details)
    (work / "dpo_trl_exact.json").write_text(json.dumps(details, indent=1))
    body = "\n".join([
        f"- Machine: {machine()}.",
        "- Command: `.venv/bin/python bench/dpo_vs_trl.py --exact` (TRL from requirements-bench.txt; per-step "
        f"values in {work.relative_to(ROOT) if work.is_relative_to(ROOT) else work}/dpo_trl_exact.json).",
        f"- The bundled preference pairs ({details[next(iter(details))]['matched']} in our training order), the "
        f"tiny Llama, blocks of {seq} tokens (one pair each), 2 gloo ranks x 2 pairs, 12 steps, fp32, beta 0.1, "
        "AdamW (0.9, 0.95), clipping 1.0, warm-up 2 then cosine; lr 1e-3 (full) and 2e-3 (LoRA).",
        "",
        exact_table("pairs", METRICS, 12, rows),
    ])
    update_section("dpo_trl_exact", body)
    print(body)


def main() -> None:
    p = bench_args(__doc__, repeats=1, layers=30, hidden=576)
    step_args(p, seq=1024, batch=1, steps=10, discard=3)
    p.add_argument("--exact", action="store_true", help="the step-by-step comparison only")
    p.add_argument("--speed", action="store_true", help="the speed comparison only")
    p.add_argument("--report-only", action="store_true", help="the speed table again from WORKDIR/dpo_trl_speed.json")
    args = p.parse_args()
    args.workdir = args.workdir.parent / "dpo" if args.workdir.name == "train" else args.workdir
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = json.loads((args.workdir / "dpo_trl_speed.json").read_text())
        report_speed(argparse.Namespace(**results.pop("settings")), results)
        return
    if not args.speed:
        exactness(args)
    if not args.exact:
        speed(args)


def conversation_pairs(work: Path) -> Path:
    """Pairs from the bundled conversations: the turns before a conversation's last answer are the prompt, that
    answer is chosen and the next conversation's last answer rejected (a DATA-HF dataset, once)."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.prep.extract import extract_file

    out = work / "chat-pairs"
    if (out / "state.json").exists():
        return out
    chats = [r.messages for f in sorted((ROOT / "examples" / "raw" / "chats").glob("*.json*"))
             for r in extract_file(f).rows if not isinstance(r, str) and r.messages[-1]["role"] == "assistant"]
    raw = work / "chat-pairs-raw"
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir(parents=True)
    with (raw / "pairs.jsonl").open("w") as f:
        for i, chat in enumerate(chats):
            other = chats[(i + 1) % len(chats)][-1]
            if other["content"].strip() != chat[-1]["content"].strip():
                f.write(json.dumps({"prompt": chat[:-1], "chosen": [chat[-1]], "rejected": [other]}) + "\n")
    build_dataset(CorpusConfig(raw, out, num_proc=1))
    shutil.rmtree(raw)
    return out


def run_cache(run: Path) -> Path:
    """The token cache a run trained from, as its log names it."""
    import re

    return Path(re.search(r"token cache (?:hit|built): (\S+)", (run / "train.log").read_text())[1])


def pairs_per_block(run: Path) -> float:
    import numpy as np

    from pipeline.data.pair_tokens import count_pairs

    flags = np.load(run_cache(run) / "train_flags.npy", mmap_mode="r")
    return count_pairs(np.asarray(flags)) / len(flags)


def speed(args) -> None:
    """Full fine-tuning and LoRA, ours and TRL's, --repeats times each."""
    from pipeline.prep.tiny import build_preset

    work = args.workdir
    model = work / "smollm2-135m"
    if not (model / "config.json").exists():
        build_preset(model, "smollm2-135m")
    data = conversation_pairs(work)
    cases = {"full fine-tuning": ([], []), "LoRA r16": (["--adapter", "lora"], ["--lora-rank", 16])}
    results: dict[str, dict[str, list[dict]]] = {}
    for case, (our_flags, trl_flags) in cases.items():
        runs = results.setdefault(case, {"ours": [], "trl": []})
        for _ in range(args.repeats):
            # the reference pass is measured each time: any kept from an earlier run of the same data goes
            for kept in (work / "runs" / "token_cache").glob("*/reference"):
                shutil.rmtree(kept)
            out, events = fsdp1(work / "runs", "speed", model, data, "--objective", "dpo", "--seq-length", args.seq,
                                "-b", args.batch, "--max-steps", args.steps, "--log-freq", 1, "--ckpt-freq", 0,
                                "--async-ckpt", "off", "--val-fraction", 0, "--chat-date", DATE, *our_flags)
            train = [e for e in events if e["event"] == "train"]
            per_block = pairs_per_block(work / "runs" / "speed")
            steady = train[args.discard:]
            gaps = [b["time"] - a["time"] for a, b in zip(train[args.discard - 1:], steady, strict=False)]
            runs["ours"].append({
                "step_s": statistics.median(gaps),
                "pairs_per_step": per_block * args.batch * args.world, "peak_rss_gb": max(out.peak_rss_gb()[:2]),
                "reference_s": reference_seconds(work / "runs" / "speed" / "train.log")})
            batch = max(1, round(per_block * args.batch))
            result = work / "trl_speed.json"
            result.unlink(missing_ok=True)
            launched = launch(torchrun_cmd(args.world, BENCH / "trl_dpo_worker.py", "--model", model, "--dataset",
                                           data, "--out", result, "--batch-size", batch, "--max-steps", args.steps,
                                           "--lr", 3e-4, "--warmup-steps", 5, "--max-length", args.seq,
                                           "--chat-date", DATE, *trl_flags), bench_env(), timeout=3600)
            r = json.loads(result.read_text())
            ends = r["step_end"]
            gaps = [b - a for a, b in zip(ends[args.discard - 1:-1], ends[args.discard:], strict=True)]
            step_s = statistics.median(gaps)
            runs["trl"].append({"step_s": step_s, "pairs_per_step": batch * args.world,
                                "tokens_per_pair": r["tokens_per_pair"],
                                "peak_rss_gb": max(launched.peak_rss_gb()[:2])})
            print(json.dumps({case: {k: v[-1] for k, v in runs.items()}}), flush=True)
    settings = {k: getattr(args, k) for k in ("repeats", "world", "seq", "batch", "steps", "discard")}
    (work / "dpo_trl_speed.json").write_text(json.dumps({"settings": settings, **results}, indent=1))
    report_speed(argparse.Namespace(**settings), results)


def reference_seconds(log: Path) -> float | None:
    """The one-off reference pass of a full fine-tuning run, from its log line (None under adapters)."""
    import re

    found = re.search(r"reference log-probabilities .*?: computed in ([0-9.]+) s", log.read_text())
    return float(found[1]) if found else None


def report_speed(args, results: dict) -> None:
    """Pairs/s (pairs per step, ours its blocks' mean, over the median step time), and tokens/s as pairs/s times
    the pairs' mean real length (prompt twice and both answers, padding left out; TRL's tokens of the same records)."""
    rows = []
    for case, runs in results.items():
        per_pair = statistics.median(r["tokens_per_pair"] for r in runs["trl"])
        reference = ("reference computed once" if case == "full fine-tuning" else "reference: adapters off, a "
                     "forward per step")
        theirs = "a reference model's forward" if case == "full fine-tuning" else "adapters off, a forward"
        for system, label in (("ours", f"fsdp1.py (packed pairs, {reference})"),
                              ("trl", f"TRL DPOTrainer (padded pairs, {theirs} per step)")):
            rs = runs[system]
            pps = statistics.median(r["pairs_per_step"] / r["step_s"] for r in rs)
            ref = [r["reference_s"] for r in rs if r.get("reference_s")]
            rows.append([case, label, f"{statistics.median(r['pairs_per_step'] for r in rs):.1f}",
                         f"{statistics.median(r['step_s'] for r in rs):.2f}", f"{pps:.2f}", f"{pps * per_pair:,.0f}",
                         f"{max(r['peak_rss_gb'] for r in rs):.2f}", f"{statistics.median(ref):.1f}" if ref else "-"])
        ours, trl = (statistics.median(r["pairs_per_step"] / r["step_s"] for r in runs[k]) for k in ("ours", "trl"))
        mem = max(r["peak_rss_gb"] for r in runs["ours"]) / max(r["peak_rss_gb"] for r in runs["trl"])
        rows.append([case, "**ours / TRL**", "", "", f"**{ours / trl:.2f}x**", "", f"**{mem:.2f}x**", ""])
    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/dpo_vs_trl.py --speed --repeats {args.repeats} --steps {args.steps} "
        f"--discard {args.discard}` (TRL from requirements-bench.txt).",
        f"- SmolLM2-135M's shape (random weights), pairs from the bundled conversations, {args.world} gloo ranks, "
        f"fp32, DPO beta 0.1, {args.steps} steps of which the first {args.discard} are left out; ours "
        f"{args.batch} block(s) of {args.seq} tokens per rank, TRL as many pairs per rank as our blocks hold on "
        "average; no activation checkpointing in either. Tokens/s: pairs/s times the pairs' mean real length "
        "(prompt twice and both answers, no padding).",
        "",
        table(["case", "system", "pairs/step", "s/step (median)", "pairs/s", "tokens/s", "peak RSS per rank, GB",
               "reference pass, s (once)"], rows),
    ])
    update_section("dpo_trl_speed", body)
    print(body)


if __name__ == "__main__":
    main()
