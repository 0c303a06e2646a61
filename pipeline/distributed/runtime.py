"""The distributed runtime: joining the process group, the device mesh, the compute dtype.

Everything here is independent of how the model is distributed (see pipeline/strategies/): it answers "which
process am I, on which device, in which group".
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.distributed import launch as launch_mod
from pipeline.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    sequence_parallel: int = 1
    """Consecutive ranks that share each sequence, split by position (--sequence-parallel): the data is dealt to
    these groups, not to the ranks."""

    @property
    def data_rank(self) -> int:
        """Which share of each global batch this rank trains on (its sequence-parallel group's)."""
        return self.rank // self.sequence_parallel

    @property
    def data_world(self) -> int:
        """How many shares each global batch is dealt in: the sequence-parallel groups."""
        return self.world_size // self.sequence_parallel

    @property
    def counts_data(self) -> bool:
        """Whether this rank counts its share's items (one rank per sequence-parallel group)."""
        return self.rank % self.sequence_parallel == 0

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
    """Join the process group of whatever launched us (pipeline.distributed.launch: torchrun, the plain variables,
    srun; plain `python` is a group of one): NCCL for CUDA tensors, gloo for CPU ones."""
    launch = launch_mod.detect()
    if launch.launcher == "single":
        launch = replace(launch, master_port=free_port())
    launch.export()
    if torch.cuda.is_available():
        if launch.local_world_size is not None:
            check_gpus_per_node(launch.local_world_size, torch.cuda.device_count())
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
        backend = "cuda:nccl,cpu:gloo"  # gloo too: small CPU-side collectives (flags, objects) stay off the GPU
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        store = attempt_store(launch, timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout, store=store, rank=launch.rank,
                                    world_size=launch.world_size)
    local_world = launch.local_world_size or ranks_on_this_host()
    return Dist(dist.get_rank(), dist.get_world_size(), launch.local_rank, local_world, device)


def attempt_store(launch: launch_mod.Launch, timeout: timedelta) -> dist.Store | None:
    """Under torchrun after a restart (--max-restarts), the agent's store with a prefix of its own for this attempt.

    Restarted workers rejoin the same agent store, where the previous attempt's gloo/NCCL addresses are still under
    the same keys: a new rank connects to a dead one's port and fails ("Connection refused",
    pytorch/pytorch#167288). None: the default env:// rendezvous, as on a first attempt.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if launch.launcher != "torchrun" or attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"fsdp1/attempt-{attempt}/", agent)


def gather_objects(mine: object) -> list:
    """Every rank's `mine` (picklable), in rank order: how ranks agree on what each saw, so that a refusal is raised
    on all of them or none. A collective every rank must reach."""
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    return views


def ranks_on_this_host() -> int:
    """Ranks sharing this host name (for launchers that do not say): one all-gather every rank must reach."""
    return gather_objects(socket.gethostname()).count(socket.gethostname())


def check_shared_dir(path: Path, d: Dist, flag: str) -> None:
    """Refuse, on every rank, a folder that not every rank sees (node-local disk): rank 0 writes a probe file there
    and each rank reads it back, instead of the first checkpoint failing hours later. Collective."""
    if d.world_size == 1:
        return
    token = [secrets.token_hex(8) if d.is_main else None]
    if d.is_main:
        (path / f".shared-probe-{token[0]}").write_text(token[0])
    dist.broadcast_object_list(token, src=0)  # after the write: every rank reads a finished file
    probe = path / f".shared-probe-{token[0]}"
    try:
        seen = probe.read_text() == token[0]
    except OSError:
        seen = False
    views = gather_objects((seen, socket.gethostname()))
    if d.is_main:
        probe.unlink()
    blind = [r for r, (ok, _) in enumerate(views) if not ok]
    if blind:
        hosts = sorted({views[r][1] for r in blind})
        raise UserError(f"{path} is not on storage every node sees: rank(s) {', '.join(map(str, blind))} on "
                        f"{', '.join(hosts)} cannot read a file rank 0 wrote there; put {flag} on a shared file "
                        "system (NFS, Lustre, ...) with the same path on every node")


def check_gpus_per_node(local_world_size: int, gpus: int) -> None:
    """One GPU per process: NCCL refuses two ranks on one device, and set_device fails past the last one."""
    if local_world_size > gpus:
        raise UserError(f"{local_world_size} processes on this node but {gpus} CUDA device(s) visible: one process "
                        f"per GPU, so use --nproc_per_node {gpus} (or CUDA_VISIBLE_DEVICES= to train on the CPU)")


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The forward/backward dtype for --precision on this device; UserError where the device lacks it."""
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError(f"--precision bf16 is not supported by {torch.cuda.get_device_name(device)}; "
                        "use --precision fp32")
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
