"""The TRL side of bench/grpo_speed.py, launched under torchrun: GRPOTrainer on the same prompts, model, group size,
completion length, prompts per process, reward, learning rate and precision (fp32) as our run, generating with the
policy in the training processes (use_vllm off, as ours).

Each optimizer step's wall time is taken at its end (a callback), and the time TRL spends in
_generate_and_score_completions (generation, decoding, rewards, advantages) by wrapping it: the step's generation
and training apart. Rank 0 writes {"step_end": [...], "generate_s": [...], "completions_per_step"} to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl_worker import StepTimes


def digits(prompts, completions, completion_ids, **columns) -> list[float]:
    """examples/grpo/rewards.py's digits: the share of a completion's non-space characters that are digits."""
    out = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return out


class TimedGRPO(GRPOTrainer):
    """GRPOTrainer with the seconds of each call of its rollout (generation and scoring) kept."""

    generate_s: list[float]

    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.generate_s.append(time.perf_counter() - started)
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {\"prompt\": ..., \"answer\": ...}")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--prompts-per-process", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-6)
    a = p.parse_args()
    rows = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r.get("prompt"), str) and r["prompt"].strip()]
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    config = GRPOConfig(output_dir=str(a.out.parent / "trl_grpo"), per_device_train_batch_size=a.prompts_per_process *
                        a.num_generations, num_generations=a.num_generations,
                        max_completion_length=a.max_completion_length, temperature=1.0, learning_rate=a.lr,
                        lr_scheduler_type="constant", warmup_steps=0, max_steps=a.max_steps, logging_steps=1,
                        save_strategy="no", report_to=[], bf16=False, fp16=False, beta=0.0, loss_type="dapo",
                        gradient_accumulation_steps=1, seed=0, dataloader_num_workers=0, use_cpu=True,
                        max_grad_norm=1.0, weight_decay=0.0)
    timer = StepTimes()
    trainer = TimedGRPO(model=model, reward_funcs=digits, args=config, train_dataset=Dataset.from_list(rows),
                        processing_class=tokenizer, callbacks=[timer])
    trainer.generate_s = []
    trainer.train()
    if trainer.accelerator.is_main_process:
        world = trainer.accelerator.num_processes
        a.out.write_text(json.dumps({"step_end": timer.times, "generate_s": trainer.generate_s,
                                     "completions_per_step": a.prompts_per_process * a.num_generations * world,
                                     "logs": trainer.state.log_history}))


if __name__ == "__main__":
    main()
