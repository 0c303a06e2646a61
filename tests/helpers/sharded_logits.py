"""Run under torchrun: load a model through the trainer's sharded path and save its logits for fixed inputs."""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig

from pipeline.config import ModelConfig
from pipeline.distributed.runtime import init_distributed
from pipeline.errors import run_cli
from pipeline.strategies.registry import make_strategy


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    d = init_distributed()
    cfg = ModelConfig(model_name=str(model_dir), precision="fp32", strategy="fsdp2", vocab_parallel="off")
    strategy = make_strategy(cfg, d, torch.float32)
    model = strategy.build(AutoConfig.from_pretrained(model_dir))
    strategy.load_weights(model_dir)
    ids = torch.arange(64).reshape(2, 32) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.reshard()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    local = model.model.embed_tokens.weight.to_local().numel()
    if d.is_main:
        np.save(out, logits.numpy())
        out.with_suffix(".txt").write_text(f"{tied} {local} {model.model.embed_tokens.weight.numel()}")
    dist.barrier()  # no rank tears the group down while another still has collectives in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
