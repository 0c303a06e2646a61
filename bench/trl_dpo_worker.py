"""The TRL side of bench/dpo_vs_trl.py, launched under torchrun: DPOTrainer on the pairs of one of our runs.

Exactness (--order CACHE): the pairs in our run's order. Our run packs one pair per block (the driver picks a block
length that holds one and not two) and draws its blocks by pipeline/data/sampler.py's permutation; TRL gets its own
tokenization of the same records, reordered so that its sequential sampler gives rank r at step s the pairs our
rank r trains at step s (accelerate deals batch k to process k mod world). Before training, every block of ours is
matched to TRL's tokens of its record: ids and trained positions (TRL: the completion; ours: the answer turns) must
be equal. LoRA: the adapters' A matrices are drawn as ours are (pipeline/model/adapters.py: Kaiming-uniform from a
generator seeded with the run's seed, in sorted-name order), B zero.

Speed (no --order): TRL's own shuffled order, padding (its padding-free path is disabled in this TRL), its
reference model a copy (full fine-tuning) or the adapters switched off (LoRA).

Rank 0 writes {"logs": [TRL's per-step log], "step_end": [...], "matched", "token_mismatches", "pairs",
"tokens_per_pair", "trainable"} to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from datasets import load_from_disk
from peft import LoraConfig
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

from pipeline.data import packing
from pipeline.data.pair_tokens import CHOSEN, REJECTED
from pipeline.data.sampler import BlockSampler
from pipeline.data.token_cache import open_blocks
from pipeline.model.adapters import default_targets


class SequentialOrder:
    """A Trainer in the dataset's own order: the driver put it in ours. The Trainer has no public setting for that
    (`train_sampling_strategy` is random, group_by_length or batch_rebalance), so its sampler hook is overridden; were
    the hook renamed, TRL would shuffle and the step-by-step comparison would show it at once."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


class InOrder(SequentialOrder, DPOTrainer):
    """DPOTrainer in the dataset's own order."""


class Record(TrainerCallback):
    def __init__(self):
        self.logs: list[dict] = []
        self.step_end: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.step_end.append(time.time())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({"step": state.global_step, **logs})


def our_pairs(cache: Path) -> list[tuple[tuple, tuple, tuple, tuple]]:
    """Each training block's one pair: (chosen ids, chosen trained, rejected ids, rejected trained)."""
    blocks = open_blocks(cache)
    pairs = []
    for ids, flags in zip(blocks.train, blocks.train_flags, strict=True):
        parts = []
        for role in (CHOSEN, REJECTED):
            at = np.flatnonzero(flags & role)
            parts += [tuple(int(t) for t in ids[at]), tuple(bool(f & packing.TRAIN) for f in flags[at])]
        pairs.append(tuple(parts))
    return pairs


def trl_pair(row: dict) -> tuple[tuple, tuple, tuple, tuple]:
    p, c, r = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
    return (tuple(p + c), (False,) * len(p) + (True,) * len(c), tuple(p + r), (False,) * len(p) + (True,) * len(r))


def in_our_order(dataset, cache: Path, seed: int, world: int, batch: int) -> tuple:
    """TRL's tokenized rows in our run's order, and (blocks matched, of which with other ids or trained positions)."""
    ours = our_pairs(cache)
    index = {}
    for i, row in enumerate(dataset):
        index.setdefault(trl_pair(row)[0], i)
    order, mismatched = [], 0
    for pair in (ours[b] for b in BlockSampler(len(ours), seed, world, 0, batch, 1).permutation(0)):
        i = index.get(pair[0])
        if i is None:
            raise SystemExit("a block of ours has a chosen sequence that TRL's tokens of no record give: the two "
                             "tokenize the pairs differently, and the comparison would not be of the same data")
        order.append(i)
        mismatched += trl_pair(dataset[i]) != pair
    return dataset.select(order), len(order), mismatched


def init_like_ours(model, seed: int) -> None:
    """A Kaiming-uniform from one generator seeded with the seed, in sorted-name order (peft's names sort as ours:
    they share one prefix), B zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name:
                full = torch.empty(param.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
                param.copy_(full)
            elif ".lora_B." in name:
                param.zero_()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True, help="a DATA-HF dataset of preference pairs")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--order", type=Path, default=None, help="our run's token cache: train in its order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, required=True, help="pairs per rank per step")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--chat-date", default="26 Jul 2024")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (TRL's default; off here)")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ds = load_from_disk(args.dataset)
    records = ds.map(lambda row: {"prompt": row["messages"], "chosen": row["chosen"], "rejected": row["rejected"],
                                  "chat_template_kwargs": {"date_string": args.chat_date}},
                     remove_columns=ds.column_names)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    config = DPOConfig(
        output_dir=str(args.out.parent / "trl_dpo_out"), per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps, learning_rate=args.lr, warmup_steps=args.warmup_steps, lr_scheduler_type="cosine",
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, beta=args.beta,
        loss_type=["sigmoid"], max_length=args.max_length, use_cpu=True, ddp_backend="gloo",
        # TRL's defaults are bf16 autocast and gradient checkpointing: fp32 and the checkpointing ours uses instead
        bf16=False, gradient_checkpointing=args.grad_ckpt,
        optim="adamw_torch_fused", report_to=[], save_strategy="no", eval_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=args.seed, data_seed=args.seed, dataset_num_proc=1, dataloader_num_workers=0)
    # our default targets (every linear layer of the decoder), by our own rule
    peft = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                      target_modules=default_targets(model), task_type="CAUSAL_LM") if args.lora_rank else None
    record = Record()
    trainer = (InOrder if args.order else DPOTrainer)(model=model, args=config, train_dataset=records,
                                                      processing_class=tokenizer, peft_config=peft,
                                                      callbacks=[record])
    world = trainer.args.world_size
    result: dict = {"pairs": len(trainer.train_dataset)}
    if args.order:
        trainer.train_dataset, result["matched"], result["token_mismatches"] = in_our_order(
            trainer.train_dataset, args.order, args.seed, world, args.batch_size)
    if peft:
        init_like_ours(trainer.model, args.seed)
        result["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    rows = trainer.train_dataset
    # the real tokens of a pair (its prompt twice and both answers), padding left out
    lengths = [2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows]
    result["tokens_per_pair"] = float(np.mean(lengths))
    trainer.train()
    if trainer.args.process_index == 0:
        result.update(logs=record.logs, step_end=record.step_end, world=world)
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
