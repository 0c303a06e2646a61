"""Run under torchrun (2 ranks): qwen3-moe under fsdp2 with transformers' loop-style ("eager") experts, its routers
forced to send every token to experts 0 and 1, which expert parallelism puts on rank 0: rank 1's experts get no row.
With and without expert parallelism, one forward, backward and gradient clip; writes each rank's loss, gradient
norm and, per expert weight, whether it got a gradient and its size, as a JSON line per rank."""

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from pipeline.config import ModelConfig
from pipeline.distributed.runtime import init_distributed
from pipeline.errors import run_cli
from pipeline.model.registry import transforms_for
from pipeline.strategies.registry import make_strategy


def to_experts_0_and_1(module, args, output):
    logits, scores, indices = output
    return logits, scores, torch.tensor([0, 1]).expand_as(indices).contiguous()


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    d = init_distributed()
    row = {"rank": d.rank}
    for degree in ("2", "1"):
        cfg = ModelConfig(model_name=str(model_dir), precision="fp32", strategy="fsdp2", sharding="auto",
                          vocab_parallel="off", expert_parallel=degree)
        config = AutoConfig.from_pretrained(model_dir)
        config._experts_implementation = "eager"  # the loop over the experts hit: no graph where none is hit
        strategy = make_strategy(cfg, d, torch.float32, transforms_for(cfg, torch.float32))
        strategy.build(config)
        strategy.load_weights(model_dir)
        for module in strategy.module.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module.register_forward_hook(to_experts_0_and_1)
        ids = (torch.arange(48).reshape(2, 24) * 7 + d.rank) % config.vocab_size
        loss = strategy.model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = strategy.clip_grad_norm(math.inf)
        grads = {name: None if p.grad is None else p.grad.to_local().abs().sum().item()
                 for name, p in strategy.module.named_parameters() if ".experts." in name}
        row[degree] = {"loss": loss.item(), "norm": norm.item(), "grads": grads}
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
