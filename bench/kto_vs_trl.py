"""KTO: fsdp1.py against TRL's KTOTrainer, step by step on the same examples in the same order.

Section `kto_trl_exact`: the bundled unpaired records (examples/kto, through DATA-HF: 120 completions labelled
desirable or not) on the tiny Llama, fp32, 2 gloo ranks, 2 examples per rank per step, 12 steps, beta 0.1, AdamW
(0.9, 0.95), clipping 1.0, cosine after warm-up; full fine-tuning (ours: the reference computed once before step 1;
TRL: a copy of the model) and LoRA r16 on every linear layer (both: the adapters switched off). Our blocks hold one
example each (its completion and its KL sequence; the block length is chosen so), so that a step of ours and of
TRL's sees the same examples: bench/trl_kto_worker.py reorders TRL's rows into our sampler's order, gives each our
KL completion, and checks that its tokens of every example are ours. The table gives, per case, the largest
difference over the 12 steps of the loss and of each TRL metric.

    .venv/bin/python bench/kto_vs_trl.py          # rewrites BENCHMARKS.md's kto_trl_exact section
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import BENCH, ROOT, bench_env, fsdp1, launch, machine, torchrun_cmd, update_section
from dpo_vs_trl import DATE, compare, exact_table, run_cache, tiny_llama

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
STEPS = 12


def kto_dataset(work: Path) -> Path:
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    out = work / "feedback"
    if not (out / "state.json").exists():
        build_dataset(CorpusConfig(ROOT / "examples" / "kto", out, num_proc=1, overwrite=True))
    return out


def one_example_per_block(model: Path, data: Path) -> int:
    """A block length that holds the longest example (its completion and KL sequence) and not the two shortest (a
    multiple of 8)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from pipeline.data import chat_tokens
    from pipeline.data.pair_tokens import tokenize_kto_batch

    tok = AutoTokenizer.from_pretrained(model)
    ds = load_from_disk(str(data))
    got = tokenize_kto_batch(ds[:], list(range(len(ds))), ds, tok, DATE, 4096, chat_tokens.special_texts(tok))
    lengths = [len(c) + len(r) for c, r in zip(got["chosen"], got["rejected"], strict=True)]
    seq = -(-max(lengths) // 8) * 8
    if seq >= 2 * min(lengths):
        raise SystemExit(f"examples of {min(lengths)} to {max(lengths)} tokens: no block length holds one and not two")
    return seq


def ours(work: Path, name: str, model: Path, data: Path, seq: int, flags: list) -> list[dict]:
    _, events = fsdp1(work / "runs", name, model, data, "--objective", "kto", "--pref-beta", 0.1, "--seq-length",
                      seq, "-b", 2, "--max-steps", STEPS, "--log-freq", 1, "--ckpt-freq", 0, "--async-ckpt", "off",
                      "--val-fraction", 0, "--chat-date", DATE, *flags)
    return [e for e in events if e["event"] == "train"]


def trl(work: Path, model: Path, data: Path, flags: list) -> dict:
    out = work / "trl_kto.json"
    out.unlink(missing_ok=True)
    launch(torchrun_cmd(2, BENCH / "trl_kto_worker.py", "--model", model, "--dataset", data, "--out", out,
                        "--batch-size", 2, "--max-steps", STEPS, "--beta", 0.1, "--chat-date", DATE, *flags),
           bench_env(), timeout=1800)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "kto")
    args = p.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(work)
    data = kto_dataset(work)
    seq = one_example_per_block(model, data)
    cases = {"full fine-tuning, ours ddp": (["--strategy", "ddp", "--lr", 1e-3, "--warmup-steps", 2],
                                            ["--lr", 1e-3, "--warmup-steps", 2]),
             "full fine-tuning, ours fsdp2": (["--strategy", "fsdp2", "--lr", 1e-3, "--warmup-steps", 2],
                                              ["--lr", 1e-3, "--warmup-steps", 2]),
             "LoRA r16, ours fsdp2": (["--strategy", "fsdp2", "--adapter", "lora", "--lr", 2e-3, "--warmup-steps", 2],
                                      ["--lr", 2e-3, "--warmup-steps", 2, "--lora-rank", 16])}
    rows, details, trl_runs = [], {}, {}
    for case, (our_flags, trl_flags) in cases.items():
        name = "kto-" + case.split(",")[0].split()[0].lower() + "-" + case.split()[-1]
        mine = ours(work, name, model, data, seq, our_flags)
        key = json.dumps(trl_flags)
        if key not in trl_runs:  # the full fine-tuning cases share TRL's run (one order: same seed and world)
            trl_runs[key] = trl(work, model, data, [*trl_flags, "--order", run_cache(work / "runs" / name)])
        compare(case, mine, trl_runs[key], METRICS, STEPS, rows, details)
    (work / "kto_trl_exact.json").write_text(json.dumps(details, indent=1))
    body = "\n".join([
        f"- Machine: {machine()}.",
        "- Command: `.venv/bin/python bench/kto_vs_trl.py` (TRL from requirements-bench.txt; per-step values in "
        f"{work.relative_to(ROOT) if work.is_relative_to(ROOT) else work}/kto_trl_exact.json).",
        f"- The bundled unpaired records ({details[next(iter(details))]['matched']} in our training order), the tiny "
        f"Llama, blocks of {seq} tokens (one example and its KL sequence each), 2 gloo ranks x 2 examples, {STEPS} "
        "steps, fp32, beta 0.1, desirable and undesirable weights 1, AdamW (0.9, 0.95), clipping 1.0, warm-up 2 then "
        "cosine; lr 1e-3 (full) and 2e-3 (LoRA). TRL's KL completions are set to ours (see the worker).",
        "",
        exact_table("examples", METRICS, STEPS, rows),
    ])
    update_section("kto_trl_exact", body)
    print(body)


if __name__ == "__main__":
    main()
