"""Reward models: fsdp1.py --objective reward against TRL's RewardTrainer, step by step on the same pairs in the same
order from the same initial score.

Section `reward_trl_exact`: the bundled preference pairs (examples/preferences, through DATA-HF) on the tiny Llama,
fp32, 2 gloo ranks, 2 pairs per rank per step, 12 steps, AdamW (0.9, 0.95), clipping 1.0, cosine after warm-up, lr
1e-3; full fine-tuning under ddp, fsdp2 and fsdp1, and ddp with center_rewards_coefficient 0.01. Our blocks hold one
pair each (the block length is chosen so), so that a step of ours and of TRL's sees the same pairs:
bench/trl_reward_worker.py reorders TRL's rows into our sampler's order and checks that its tokens of every pair are
ours. The table gives, per case, the largest difference over the 12 steps of the loss and of each TRL metric.

    .venv/bin/python bench/reward_vs_trl.py       # rewrites BENCHMARKS.md's reward_trl_exact section
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import BENCH, ROOT, bench_env, fsdp1, launch, machine, torchrun_cmd, update_section
from dpo_vs_trl import DATE, compare, exact_table, one_pair_per_block, pairs_dataset, run_cache, tiny_llama

METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")
STEPS = 12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "reward")
    args = p.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(work)
    data = pairs_dataset(work)
    seq = one_pair_per_block(model, data)
    cases = {"ours ddp": (["--strategy", "ddp"], []), "ours fsdp2": (["--strategy", "fsdp2"], []),
             "ours fsdp1": (["--strategy", "fsdp1"], []),
             "ours ddp, center_rewards_coefficient 0.01": (["--strategy", "ddp", "--center-rewards-coefficient", 0.01],
                                                           ["--center-rewards-coefficient", 0.01])}
    rows, details, trl_runs = [], {}, {}
    for case, (our_flags, trl_flags) in cases.items():
        name = "reward-" + "-".join(str(f).strip("-") for f in our_flags[1::2])
        _, events = fsdp1(work / "runs", name, model, data, "--objective", "reward", "--seq-length", seq, "-b", 2,
                          "--max-steps", STEPS, "--log-freq", 1, "--ckpt-freq", 0, "--async-ckpt", "off",
                          "--val-fraction", 0, "--chat-date", DATE, "--lr", 1e-3, "--warmup-steps", 2, *our_flags)
        mine = [e for e in events if e["event"] == "train"]
        key = json.dumps(trl_flags)
        if key not in trl_runs:  # the cases without a coefficient share TRL's run (one order: same seed and world)
            out = work / "trl_reward.json"
            out.unlink(missing_ok=True)
            launch(torchrun_cmd(2, BENCH / "trl_reward_worker.py", "--model", model, "--dataset", data, "--out", out,
                                "--batch-size", 2, "--max-steps", STEPS, "--lr", 1e-3, "--warmup-steps", 2,
                                "--chat-date", DATE, "--order", run_cache(work / "runs" / name), *trl_flags),
                   bench_env(), timeout=1800)
            trl_runs[key] = json.loads(out.read_text())
        compare(case, mine, trl_runs[key], METRICS, STEPS, rows, details)
    (work / "reward_trl_exact.json").write_text(json.dumps(details, indent=1))
    body = "\n".join([
        f"- Machine: {machine()}.",
        "- Command: `.venv/bin/python bench/reward_vs_trl.py` (TRL from requirements-bench.txt; per-step values in "
        f"{work.relative_to(ROOT) if work.is_relative_to(ROOT) else work}/reward_trl_exact.json).",
        f"- The bundled preference pairs ({details[next(iter(details))]['matched']} in our training order), the tiny "
        f"Llama as a reward model (its score drawn alike on both sides), blocks of {seq} tokens (one pair each), 2 "
        f"gloo ranks x 2 pairs, {STEPS} steps, fp32, AdamW (0.9, 0.95), clipping 1.0, warm-up 2 then cosine, lr 1e-3.",
        "",
        exact_table("pairs", METRICS, STEPS, rows),
    ])
    update_section("reward_trl_exact", body)
    print(body)


if __name__ == "__main__":
    main()
