"""Run under torchrun by bench/family_losses.py: for each model folder and strategy, the trainer's first loss on a
fixed batch (every rank the same rows, so the global mean is the batch's) and transformers' own on the same batch;
then, after one AdamW step, the export (pipeline/train/export.py) read back by from_pretrained against the trained
model: the largest difference of any tensor (persistent buffers included) and of the loss on the batch.

    torchrun --nproc_per_node 2 bench/family_worker.py OUT.json SCRATCH_DIR FAMILY=DIR [FAMILY=DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config_merge import from_flat
from pipeline.data.batches import make_batch
from pipeline.distributed.runtime import init_distributed
from pipeline.errors import run_cli
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.strategies.registry import STRATEGIES, make_strategy, settle
from pipeline.train.export import export_model


def exported_against_trained(strategy, folder: Path, batch, items: float, scratch: Path, d) -> dict:
    """One AdamW step, the export, and on rank 0 the largest |difference| of every exported tensor and of the loss
    against the trained model's. Collectives inside."""
    optimizer = torch.optim.AdamW([p for g in strategy.param_groups(0.0) for p in g["params"]], lr=1e-3)
    with strategy.gradient_sync(True):
        CausalLMLoss(strategy.head())(batch, items).backward()
    optimizer.step()
    trained = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in strategy.export_state().items()}
    with torch.no_grad():
        loss = CausalLMLoss(strategy.head())(batch, items).item()
    out = scratch / "export"
    export_model(strategy, folder, out, torch.float32, d)
    if not d.is_main:
        return {}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        theirs = model(input_ids=batch.input_ids, labels=batch.labels).loss.item()
    return {"export_tensor_diff": max((state[k] - v.cpu()).abs().max().item() for k, v in trained.items()),
            "export_loss_diff": abs(theirs - loss), "export_missing": sorted(set(trained) - set(state))}


def main() -> None:
    out, scratch, pairs = Path(sys.argv[1]), Path(sys.argv[2]), [a.split("=", 1) for a in sys.argv[3:]]
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
            items = d.world_size * rows.shape[0] * (rows.shape[1] - 1)
            with torch.no_grad():
                ours = CausalLMLoss(strategy.head())(batch, items).item()
            results.append({"family": family, "strategy": name, "ours": ours, "theirs": theirs,
                            "attn": strategy.module.config._attn_implementation,
                            "vocab_parallel": bool(getattr(strategy, "vocab_parallel", False)),
                            **exported_against_trained(strategy, Path(folder), batch, items, scratch, d)})
    if d.is_main:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
