"""Run under torchrun: load a training checkpoint's model (sharded) and save its logits for fixed inputs."""

import sys
from pathlib import Path

from pipeline.offline import switch_offline

switch_offline()  # as fsdp1.py: the suite's warm launcher for the training runs' environment serves it too

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pipeline.distributed.runtime import init_distributed  # noqa: E402
from pipeline.errors import run_cli  # noqa: E402
from pipeline.train.checkpoint import load_checkpoint_model  # noqa: E402


def main() -> None:
    checkpoint, out = Path(sys.argv[1]), Path(sys.argv[2])
    d = init_distributed()
    model = load_checkpoint_model(checkpoint, d)[0].model
    ids = torch.arange(64).reshape(2, 32) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.reshard()
    if d.is_main:
        np.save(out, logits.numpy())
    dist.barrier()  # no rank tears the group down while another still has collectives in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
