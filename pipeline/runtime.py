"""The distributed runtime: joining the process group, the launcher watchdog, the device mesh, the compute dtype.

Everything here is independent of how the model is distributed (see pipeline/strategies/): it answers "which
process am I, on which device, in which group".
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """The one process that prints, writes metrics and other run-level files."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """One process per node: builds node-local caches."""
        return self.local_rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout: timedelta = timedelta(minutes=60)) -> Dist:
    """Join torchrun's process group (NCCL for CUDA tensors, gloo for CPU ones); plain `python` is a group of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        check_gpus_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cuda:nccl,cpu:gloo"  # gloo too: small CPU-side collectives (flags, objects) stay off the GPU
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank,
                int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), device)


def check_gpus_per_node(local_world_size: int, gpus: int) -> None:
    """One GPU per process: NCCL refuses two ranks on one device, and set_device fails past the last one."""
    if local_world_size > gpus:
        raise UserError(f"{local_world_size} processes on this node but {gpus} CUDA device(s) visible: one process "
                        f"per GPU, so use --nproc_per_node {gpus} (or CUDA_VISIBLE_DEVICES= to train on the CPU)")


def watch_parent(interval_s: float = 1.0) -> None:
    """Under torchrun, exit when the launcher dies.

    A SIGKILLed torchrun agent cannot forward anything: its workers would sit in a collective until the timeout
    (an hour). A daemon thread notices the re-parenting and ends the process; collectives release the GIL, so it
    runs even while the main thread is blocked in one.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != launcher:
                os.write(2, f"rank {os.environ.get('RANK')}: launcher (pid {launcher}) died; exiting\n".encode())
                os._exit(1)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The forward/backward dtype for --precision on this device; UserError where the device lacks it."""
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError(f"--precision bf16 is not supported by {torch.cuda.get_device_name(device)}; "
                        "use --precision fp16 or fp32")
    if device.type != "cuda" and precision == "fp16":
        raise UserError("--precision fp16 needs a CUDA GPU (loss scaling); use fp32 or bf16 on CPU")
    return DTYPES[precision]


def build_mesh(sharding: str, d: Dist) -> DeviceMesh:
    """1-D mesh for FULL_SHARD/SHARD_GRAD_OP; 2-D (replicate, shard) for NO_SHARD and HYBRID_SHARD."""
    if sharding == "NO_SHARD":
        return init_device_mesh(d.device.type, (d.world_size, 1), mesh_dim_names=("replicate", "shard"))
    if sharding == "HYBRID_SHARD":
        if d.world_size % d.local_world_size:
            raise UserError(f"--sharding HYBRID_SHARD needs the same number of processes on every node; "
                            f"world size {d.world_size} is not a multiple of {d.local_world_size}")
        return init_device_mesh(d.device.type, (d.world_size // d.local_world_size, d.local_world_size),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))
