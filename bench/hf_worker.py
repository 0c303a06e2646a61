"""The Hugging Face Trainer side of bench/train_speed.py, launched under torchrun: the same model, the same packed
blocks (our token cache), batch, seq length, AdamW, lr schedule, clipping and precision as our run.

On GPU it asks for FSDP2 with decoder-layer wrapping, bf16 mixed precision over fp32 weights (--bf16) and the fused
CUDA AdamW, the settings the Trainer's documentation recommends for speed; --compile and --grad-ckpt add
`torch_compile` and `gradient_checkpointing`. Step ends are recorded after a device sync every --sync-every steps
(queued GPU work would otherwise make the host's clock run ahead of the GPU).

On CPU the Trainer cannot shard: without `use_cpu` it refuses ("Using fsdp only works in distributed training."),
and with it Accelerate sets up MULTI_CPU, which ignores the FSDP plugin and wraps the model in DDP; so on CPU this
measures the Trainer's DDP, the best it offers.
Rank 0 writes {"step_end": [epoch seconds per optimizer step], "wrapper", ...} to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments


class Blocks(torch.utils.data.Dataset):
    """The blocks in fsdp1.py's first-epoch order (pipeline/data/sampler.py: one permutation from (seed, 0)). Read
    sequentially and dealt by Accelerate one batch per rank in turn, rank r's k-th batch is the blocks fsdp1.py's
    rank r trains on at step k: both systems see the same batches, so their losses compare step by step."""

    def __init__(self, path: Path, seed: int):
        self.blocks = np.load(path, mmap_mode="r")
        self.order = np.random.default_rng([seed, 0]).permutation(len(self.blocks))

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        ids = torch.from_numpy(self.blocks[self.order[i]].astype(np.int64))
        return {"input_ids": ids, "labels": ids}


class StepTimes(TrainerCallback):
    """Epoch seconds at the end of every --sync-every-th optimizer step, taken after the GPU has finished it, and the
    loss the Trainer logs for each step (the mean over ranks)."""

    def __init__(self, every: int):
        self.every, self.steps, self.times, self.losses = every, [], [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.steps.append(state.global_step)
            self.times.append(time.time())


class Profiled(TrainerCallback):
    """pipeline/train/profiling.py's StepProfiler around the Trainer's steps (rank 0): the same table as fsdp1.py's
    --profile-from writes, from the same profiler."""

    def __init__(self, first: int, count: int, out: Path):
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from pipeline.train.profiling import StepProfiler, memory_breakdown

        self.memory_breakdown = memory_breakdown
        self.profiler = StepProfiler(first, count, out, torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.profiler.breakdown = lambda: self.memory_breakdown(model, optimizer, self.profiler.device)
        self.profiler.before(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        self.profiler.after(state.global_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--blocks", required=True, type=Path, help="train.npy of our token cache")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (activation recomputation)")
    p.add_argument("--sync-every", type=int, default=1, help="record a step end every N steps")
    p.add_argument("--seed", type=int, default=0, help="fsdp1.py's --seed, for its block order")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA of this rank through peft (0: every weight)")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--profile-from", type=int, default=0, help="profile steps from this one (0: off), as fsdp1.py")
    p.add_argument("--profile-steps", type=int, default=3)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    if args.lora_rank:  # peft's usual recipe: every linear layer of the blocks
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    fsdp = {"fsdp": "full_shard auto_wrap",
            "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True,
                            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}} if cuda else {}
    targs = TrainingArguments(
        output_dir=str(args.out.parent / "hf_trainer_out"), per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps, learning_rate=args.lr, warmup_steps=args.warmup_steps, lr_scheduler_type="cosine",
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        bf16=args.bf16, use_cpu=not cuda, ddp_backend=None if cuda else "gloo",
        torch_compile=args.compile, gradient_checkpointing=args.grad_ckpt,
        optim="adamw_torch_fused" if cuda else "adamw_torch", report_to=[], save_strategy="no", eval_strategy="no",
        logging_steps=args.sync_every, train_sampling_strategy="sequential",
        dataloader_num_workers=0, disable_tqdm=True, seed=0, **fsdp)
    timer = StepTimes(args.sync_every)
    callbacks = [timer]
    if args.profile_from and int(os.environ.get("RANK", "0")) == 0:
        callbacks.append(Profiled(args.profile_from, args.profile_steps, args.out.with_suffix(".profile")))
    blocks = Blocks(args.blocks, args.seed)
    # past one epoch fsdp1.py draws a new order from (seed, 1): the batches would no longer be the same
    if args.max_steps * args.batch_size * int(os.environ.get("WORLD_SIZE", "1")) > len(blocks):
        raise SystemExit(f"--max-steps {args.max_steps} runs past one epoch of {len(blocks)} blocks")
    trainer = Trainer(model=model, args=targs, train_dataset=blocks, callbacks=callbacks)
    trainer.train()
    if trainer.args.process_index == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
        args.out.write_text(json.dumps({"step_end": timer.times, "steps": timer.steps, "loss": timer.losses,
                                        "peak_alloc_gib": peak,
                                        "peak_reserved_gib": reserved,
                                        "wrapper": type(trainer.model_wrapped).__name__,
                                        "distributed": str(trainer.accelerator.distributed_type)}))


if __name__ == "__main__":
    main()
