"""Run under torchrun: a few optimizer steps of the tiny model under each named strategy, on the same global batches
whatever the world size (24 blocks of 16 tokens per step, each rank its contiguous share, two micro-steps of
accumulation), in fp32 (or fp16 with the strategy's loss scaling: STRATEGY:fp16) through the trainer's own step
function (pipeline/train/step.py). Rank 0 writes the losses, gradient norms and loss scales per step and the final
parameters (full tensors) to OUT.json / OUT.npz, under each STRATEGY[:PRECISION] given.

    strategy_steps.py MODEL_DIR OUT STRATEGY[:fp16] [STRATEGY[:fp16] ...]
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig

from pipeline.config import Config
from pipeline.config_merge import from_flat
from pipeline.data.batches import make_batch
from pipeline.distributed.runtime import init_distributed
from pipeline.errors import run_cli
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.strategies.registry import make_strategy, settle
from pipeline.train.optim import build_optimizer, build_scheduler
from pipeline.train.step import Update, train_step
from pipeline.train.telemetry import PhaseTimer

STEPS, GLOBAL_ROWS, SEQ, MICRO = 3, 24, 16, 2


def train(model_dir: Path, run: str, d) -> dict:
    name, _, precision = run.partition(":")
    cfg: Config = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": str(model_dir),
                                    "strategy": name, "precision": precision or "fp32", "lr": 2e-5,
                                    "weight_decay": 0.1, "max_grad_norm": 1.0, "vocab_parallel": "off",
                                    "lr_schedule": "constant"}))
    dtype = torch.float16 if precision == "fp16" else torch.float32
    strategy = make_strategy(cfg.model, d, dtype)
    hf_config = AutoConfig.from_pretrained(model_dir)
    strategy.build(hf_config)
    strategy.load_weights(model_dir)
    loss_fn = CausalLMLoss(strategy.head())
    optimizer = build_optimizer(strategy.param_groups(cfg.optim.weight_decay), cfg)
    scaler = strategy.grad_scaler(cfg.train.loss_scale) if dtype == torch.float16 else None
    update = Update(optimizer, build_scheduler(optimizer, cfg, STEPS), cfg.optim.max_grad_norm, scaler=scaler)
    timer = PhaseTimer(d.device)
    rows = GLOBAL_ROWS // d.world_size
    gen = torch.Generator().manual_seed(0)
    losses, norms, scales = [], [], []
    for _ in range(STEPS):
        ids = torch.randint(0, hf_config.vocab_size, (GLOBAL_ROWS, SEQ), generator=gen)
        mine = ids[d.rank * rows:(d.rank + 1) * rows].numpy()
        result = train_step(strategy, loss_fn, np.array_split(mine, MICRO),
                            lambda part: make_batch(part, None, d.device), GLOBAL_ROWS * (SEQ - 1), update, timer)
        assert result.applied
        losses.append(result.loss)
        norms.append(result.grad_norm)
        scales.append(result.loss_scale)
    params = {k: full(v) for k, v in strategy.state_dict()["model"].items()}
    padding = [f.shard[f.valid:].abs().max().item() if f.valid < f.shard_numel else 0.0
               for f in getattr(strategy, "flats", [])]
    return {"loss": losses, "grad_norm": norms, "loss_scale": scales, "params": params, "padding": padding}


def full(value) -> np.ndarray:
    """The whole tensor from a DTensor (fsdp2, fsdp1, manual) or a plain one (ddp). A collective."""
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().numpy().copy()


def main() -> None:
    model_dir, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    d = init_distributed()
    results = {name: train(model_dir, name, d) for name in names}
    if d.is_main:
        np.savez(out.with_suffix(".npz"), **{f"{n}/{k}": v for n, r in results.items() for k, v in r["params"].items()})
        out.with_suffix(".json").write_text(json.dumps({n: {k: v for k, v in r.items() if k != "params"}
                                                        for n, r in results.items()}))
    # every rank leaves together: once, under load, a rank tearing down early aborted ("terminate called without
    # an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
