"""FSDP1 with offloaded parameters on one rank (NO_SHARD, use_orig_params) and bf16 compute, as fsdp1.py trains: are
the weights loaded before the first step the weights it uses? Prints one JSON line, the largest difference between
the wrapped model's output and the plain model's, without and with FSDP1._point_at_pinned_shards.

    python tests/helpers/fsdp1_offload_probe.py RENDEZVOUS_FILE

The CPU has no pinned memory. FSDP1's lazy init pins a copy of each offloaded shard (`Tensor.pin_memory` returns a
new tensor), so a plain copy stands in for it here: the hazard is the copy, not the pinning."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision

from pipeline.strategies.fsdp1 import FSDP1

torch.Tensor.pin_memory = lambda self, *args, **kwargs: self.clone()


def difference(point_first: bool) -> float:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    shell = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    for p in shell.parameters():
        nn.init.zeros_(p)
    # mixed precision: each step casts the pinned shard to bf16, so a stale pinned copy is what the step computes with
    wrapped = FullyShardedDataParallel(shell, cpu_offload=CPUOffload(offload_params=True), use_orig_params=True,
                                       mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
                                       device_id=torch.device("cpu"))
    if point_first:
        FSDP1._point_at_pinned_shards(wrapped)
    get_model_state_dict(wrapped)  # as pipeline.model.weights.load_weights does: the state dict read first
    set_model_state_dict(wrapped, plain.state_dict(), options=StateDictOptions(strict=False))
    x = torch.randn(3, 8)
    with torch.no_grad():
        return (wrapped(x).float() - plain.to(torch.bfloat16)(x.to(torch.bfloat16)).float()).abs().max().item()


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    try:
        print(json.dumps({"without": difference(False), "with": difference(True)}))
    finally:
        dist.destroy_process_group()
