"""The bare-PyTorch limit of one rank's share of a data-parallel step, in one process with no FSDP, no process
group and no data pipeline: forward and backward of the whole model on one rank's micro-batch, then clipping and
AdamW over all parameters, of which a rank's share is 1/world (each rank updates its shard only). With --lora-rank:
peft's LoRA on every linear layer of the blocks, the base frozen, AdamW over the adapters (replicated under ddp, so
the whole update is a rank's share).

It runs with the threads one rank has (cores / world), so it does what one rank must do with what one rank has.
Prints one JSON line: per-step seconds of forward+backward and of clip+update (warm-up steps dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--blocks", required=True, help="train.npy of our token cache")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights, as both trainers do")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA of this rank through peft (0: every weight)")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    blocks = np.load(args.blocks, mmap_mode="r")
    compute, update = [], []
    for step in range(args.steps):
        ids = torch.from_numpy(blocks[step * args.batch_size:(step + 1) * args.batch_size].astype(np.int64))
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if step >= args.warmup:
            compute.append(t1 - t0)
            update.append(t2 - t1)
    print(json.dumps({"threads": torch.get_num_threads(), "fwd_bwd_s": compute, "update_s": update}))


if __name__ == "__main__":
    main()
