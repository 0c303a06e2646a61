"""Run under torchrun: build a QLoRA model through the trainer's path (the strategy given, NF4 weights filled by rows)
and write each rank's loss on a fixed batch, with the loss of from_pretrained's model whose adapted weights are
torchao's NF4 of the whole weight, dequantized, as a JSON line per rank."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import ModelConfig
from pipeline.distributed.runtime import init_distributed
from pipeline.errors import run_cli
from pipeline.model import nf4
from pipeline.model.registry import transforms_for
from pipeline.strategies.registry import make_strategy
from pipeline.train.export import adapter_of


def main() -> None:
    model_dir, strategy_name, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    d = init_distributed()
    cfg = ModelConfig(model_name=str(model_dir), precision="fp32", strategy=strategy_name, sharding="auto",
                      vocab_parallel="off", adapter="qlora", lora_rank=4, lora_alpha=8)
    strategy = make_strategy(cfg, d, torch.float32, transforms_for(cfg, torch.float32))
    strategy.build(AutoConfig.from_pretrained(model_dir))
    strategy.load_weights(model_dir)
    targets = sorted(adapter_of(strategy).peft_config.target_modules)
    reference = nf4.roundtrip(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), targets)
    with torch.no_grad():
        ids = torch.arange(48).reshape(2, 24) * 7 % reference.config.vocab_size
        ours = strategy.model(input_ids=ids, labels=ids).loss.item()
        theirs = reference(input_ids=ids, labels=ids).loss.item()
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"rank": d.rank, "ours": ours, "theirs": theirs}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
