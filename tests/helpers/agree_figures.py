"""Run under torchrun with 2 ranks: the step decision (pipeline/train/step.agree) for a loss that is not finite on
rank 0 only, and for finite losses (1 and 2); every rank's decision is gathered and rank 0 writes them to OUT.

    agree_figures.py OUT
"""

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.distributed.runtime import init_distributed
from pipeline.errors import run_cli
from pipeline.train.step import agree


def main() -> None:
    d = init_distributed()
    norm = torch.tensor(3.0)
    bad = agree(torch.tensor(math.nan if d.rank == 0 else 1.0), norm, 10, d.world_size)
    good = agree(torch.tensor(1.0 + d.rank), norm, 10, d.world_size)
    mine = {"skipped": {"applied": bad.applied, "grad_norm": bad.grad_norm},
            "finite": {"applied": good.applied, "grad_norm": good.grad_norm, "loss": good.loss}}
    everyone = [None] * d.world_size
    dist.all_gather_object(everyone, mine)
    if d.is_main:
        Path(sys.argv[1]).write_text(json.dumps({k: [r[k] for r in everyone] for k in mine}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
