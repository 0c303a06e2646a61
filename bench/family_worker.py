"""Run under torchrun by bench/family_losses.py: for each model folder and strategy, the trainer's first loss on a
fixed batch (every rank the same rows, so the global mean is the batch's) and transformers' own on the same batch.

    torchrun --nproc_per_node 2 bench/family_worker.py OUT.json FAMILY=DIR [FAMILY=DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import from_flat
from pipeline.data.batches import make_batch
from pipeline.dist.runtime import init_distributed
from pipeline.errors import run_cli
from pipeline.strategies.registry import STRATEGIES, make_strategy, settle


def main() -> None:
    out, pairs = Path(sys.argv[1]), [a.split("=", 1) for a in sys.argv[2:]]
    d = init_distributed()
    rows = np.random.default_rng(1).integers(0, 512, size=(2, 64))
    results = []
    for family, folder in pairs:
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        batch = make_batch(rows, None, d.device)
        with torch.no_grad():
            theirs = reference(input_ids=batch.input_ids, labels=batch.labels).loss.item()
        for name in STRATEGIES:
            cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": folder,
                                    "strategy": name, "precision": "fp32"}))
            strategy = make_strategy(cfg.model, d, torch.float32)
            strategy.build(AutoConfig.from_pretrained(folder))
            strategy.load_weights(Path(folder))
            with torch.no_grad():
                ours = strategy.loss()(batch, d.world_size * rows.shape[0] * (rows.shape[1] - 1)).item()
            results.append({"family": family, "strategy": name, "ours": ours, "theirs": theirs,
                            "attn": strategy.module.config._attn_implementation,
                            "vocab_parallel": bool(getattr(strategy, "vocab_parallel", False))})
    if d.is_main:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
