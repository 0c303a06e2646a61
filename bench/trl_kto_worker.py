"""The TRL side of bench/kto_vs_trl.py, launched under torchrun: KTOTrainer on the examples of one of our KTO runs, in
our run's order and with our KL sequences.

Our run packs one example per block (its completion, then its KL sequence: the prompt with the record before's
completion) and draws its blocks by pipeline/data/sampler.py's permutation. TRL gets its own tokenization of the same
records, reordered so that its sequential sampler (KTO requires it) gives rank r at step s the examples our rank r
trains at step s (accelerate deals batch k to process k mod world), and each example's KL completion set to ours: TRL
rotates completions within its batch to make the mismatched pairs, which would be other ones, and the KL term is an
estimate from whichever mismatched pairs it is given. Before training, every block of ours is matched to TRL's tokens
of its record: ids and trained positions of the completion, and the prompt of the KL sequence, must be equal. LoRA:
the adapters drawn as ours are (bench/trl_dpo_worker.init_like_ours).

Rank 0 writes {"logs": [TRL's per-step log], "matched", "token_mismatches", "trainable"} to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from datasets import load_from_disk
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import KTOConfig, KTOTrainer
from trl_dpo_worker import Record, init_like_ours

from pipeline.data import packing
from pipeline.data.pair_tokens import CHOSEN, REJECTED, UNDESIRABLE
from pipeline.data.sampler import BlockSampler
from pipeline.data.token_cache import open_blocks
from pipeline.model.adapters import default_targets


def our_examples(cache: Path) -> list[dict]:
    """Each training block's one example: its completion's ids and trained positions, its KL sequence's ids, and its
    label."""
    blocks = open_blocks(cache)
    out = []
    for ids, flags in zip(blocks.train, blocks.train_flags, strict=True):
        seq, kl = np.flatnonzero(flags & CHOSEN), np.flatnonzero(flags & REJECTED)
        out.append({"ids": tuple(int(t) for t in ids[seq]), "trained": tuple(bool(f & packing.TRAIN)
                                                                             for f in flags[seq]),
                    "kl": [int(t) for t in ids[kl]], "label": not bool(flags[seq[0]] & UNDESIRABLE)})
    return out


def in_our_order(dataset, cache: Path, seed: int, world: int, batch: int) -> tuple:
    """TRL's tokenized rows in our run's order with our KL completions, and (blocks matched, of which with other ids,
    trained positions, label or KL prompt)."""
    ours = our_examples(cache)
    index = {}
    for i, row in enumerate(dataset):
        index.setdefault(tuple(row["prompt_ids"] + row["completion_ids"]), i)
    order, kl, mismatched = [], [], 0
    for ex in (ours[b] for b in BlockSampler(len(ours), seed, world, 0, batch, 1).permutation(0)):
        i = index.get(ex["ids"])
        if i is None:
            raise SystemExit("a block of ours has a completion that TRL's tokens of no record give: the two tokenize "
                             "the records differently, and the comparison would not be of the same data")
        row = dataset[i]
        prompt = row["prompt_ids"]
        trained = (False,) * len(prompt) + (True,) * len(row["completion_ids"])
        mismatched += (trained != ex["trained"] or row["label"] != ex["label"]
                       or ex["kl"][:len(prompt)] != prompt)
        order.append(i)
        kl.append(ex["kl"][len(prompt):])
    reordered = dataset.select(order).remove_columns("KL_completion_ids").add_column("KL_completion_ids", kl)
    return reordered, len(order), mismatched


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True, help="a DATA-HF dataset of unpaired (KTO) records")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--order", required=True, type=Path, help="our run's token cache: train in its order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, required=True, help="examples per rank per step")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--desirable-weight", type=float, default=1.0)
    p.add_argument("--undesirable-weight", type=float, default=1.0)
    p.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--chat-date", default="26 Jul 2024")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ds = load_from_disk(args.dataset)
    records = ds.map(lambda row: {"prompt": row["messages"], "completion": row["chosen"] or row["rejected"],
                                  "label": bool(row["chosen"]),
                                  "chat_template_kwargs": {"date_string": args.chat_date}},
                     remove_columns=ds.column_names)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    config = KTOConfig(
        output_dir=str(args.out.parent / "trl_kto_out"), per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps, learning_rate=args.lr, warmup_steps=args.warmup_steps, lr_scheduler_type="cosine",
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, beta=args.beta,
        desirable_weight=args.desirable_weight, undesirable_weight=args.undesirable_weight, loss_type="kto",
        max_length=1024, use_cpu=True, ddp_backend="gloo", bf16=False, gradient_checkpointing=False,
        optim="adamw_torch_fused", report_to=[], save_strategy="no", eval_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=args.seed, data_seed=args.seed, dataset_num_proc=1, dataloader_num_workers=0,
        train_sampling_strategy="sequential")
    peft = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                      target_modules=default_targets(model), task_type="CAUSAL_LM") if args.lora_rank else None
    record = Record()
    trainer = KTOTrainer(model=model, args=config, train_dataset=records, processing_class=tokenizer,
                         peft_config=peft, callbacks=[record])
    world = trainer.args.world_size
    result: dict = {}
    trainer.train_dataset, result["matched"], result["token_mismatches"] = in_our_order(
        trainer.train_dataset, args.order, args.seed, world, args.batch_size)
    if peft:
        init_like_ours(trainer.model, args.seed)
        result["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    if trainer.args.process_index == 0:
        result.update(logs=record.logs, world=world)
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
