"""The TRL side of bench/reward_vs_trl.py, launched under torchrun: RewardTrainer on the pairs of one of our reward
runs, in our run's order, from the same initial score.

Our run packs one pair per block and draws its blocks by pipeline/data/sampler.py's permutation; TRL gets its own
tokenization of the same records, reordered so that its sequential sampler gives rank r at step s the pairs our rank
r trains at step s (accelerate deals batch k to process k mod world; trl_dpo_worker.SequentialOrder keeps that order).
Every block of ours is matched to TRL's tokens of its record (both answers' ids). The score is drawn as ours is
(pipeline/model/reward_head.py: normal with the config's initializer_range, from a generator seeded with the run's
seed).

Rank 0 writes {"logs": [TRL's per-step log], "matched", "token_mismatches"} to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from datasets import load_from_disk
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer
from trl_dpo_worker import Record, SequentialOrder

from pipeline.data.pair_tokens import CHOSEN, REJECTED
from pipeline.data.sampler import BlockSampler
from pipeline.data.token_cache import open_blocks


class InOrder(SequentialOrder, RewardTrainer):
    """RewardTrainer in the dataset's own order (the driver put it in ours)."""


def in_our_order(dataset, cache: Path, seed: int, world: int, batch: int) -> tuple:
    """TRL's tokenized rows in our run's order, and (blocks matched, of which with other rejected ids)."""
    blocks = open_blocks(cache)
    ours = [tuple(tuple(int(t) for t in ids[np.flatnonzero(flags & role)]) for role in (CHOSEN, REJECTED))
            for ids, flags in zip(blocks.train, blocks.train_flags, strict=True)]
    index = {}
    for i, row in enumerate(dataset):
        index.setdefault(tuple(row["chosen_ids"]), i)
    order, mismatched = [], 0
    for chosen, rejected in (ours[b] for b in BlockSampler(len(ours), seed, world, 0, batch, 1).permutation(0)):
        i = index.get(chosen)
        if i is None:
            raise SystemExit("a block of ours has a chosen sequence that TRL's tokens of no record give: the two "
                             "tokenize the pairs differently, and the comparison would not be of the same data")
        order.append(i)
        mismatched += tuple(dataset[i]["rejected_ids"]) != rejected
    return dataset.select(order), len(order), mismatched


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True, help="a DATA-HF dataset of preference pairs")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--order", required=True, type=Path, help="our run's token cache: train in its order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, required=True, help="pairs per rank per step")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--center-rewards-coefficient", type=float, default=None)
    p.add_argument("--chat-date", default="26 Jul 2024")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ds = load_from_disk(args.dataset)
    records = ds.map(lambda row: {"prompt": row["messages"], "chosen": row["chosen"], "rejected": row["rejected"],
                                  "chat_template_kwargs": {"date_string": args.chat_date}},
                     remove_columns=ds.column_names)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        model.score.weight.copy_(torch.empty(model.score.weight.shape).normal_(
            0.0, model.config.initializer_range, generator=generator))
    config = RewardConfig(
        output_dir=str(args.out.parent / "trl_reward_out"), per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps, learning_rate=args.lr, warmup_steps=args.warmup_steps, lr_scheduler_type="cosine",
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        center_rewards_coefficient=args.center_rewards_coefficient, max_length=1024, use_cpu=True,
        ddp_backend="gloo", bf16=False, gradient_checkpointing=False, optim="adamw_torch_fused", report_to=[],
        save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed,
        data_seed=args.seed, dataset_num_proc=1, dataloader_num_workers=0)
    record = Record()
    trainer = InOrder(model=model, args=config, train_dataset=records, processing_class=tokenizer, callbacks=[record])
    result: dict = {}
    trainer.train_dataset, result["matched"], result["token_mismatches"] = in_our_order(
        trainer.train_dataset, args.order, args.seed, trainer.args.world_size, args.batch_size)
    trainer.train()
    if trainer.args.process_index == 0:
        result.update(logs=record.logs)
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
