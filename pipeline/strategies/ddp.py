"""DDP (`DistributedDataParallel`): a whole replica of the model, its gradients and its optimizer state on every
rank; gradients all-reduced (averaged) in buckets during the backward.

Nothing is sharded, so nothing is gathered: the fastest choice while the model, its gradients and two fp32 AdamW
states fit on one device (16 bytes per parameter), and on CPU, where FSDP's per-layer collectives are synchronous.
Mixed precision is autocast over fp32 parameters. Checkpoints hold the same names as every other strategy; DCP
writes each replicated tensor once.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from pipeline.config import ModelConfig
from pipeline.model.head import Head
from pipeline.model.modeling import retie
from pipeline.model.tied_head import tie_in_place
from pipeline.strategies.base import Strategy
from pipeline.strategies.memory import Shape, Workload
from pipeline.strategies.traffic import replicated_bytes


class BucketClock:
    """When DDP's bucket all-reduces start and end, seen from a comm hook. On gloo they run on gloo's threads while
    the backward goes on; the last bucket is launched when the backward's compute ends, so the time from its launch
    to the last completion is what the step waits for them. (NCCL's futures complete when the work is queued, not
    done: no hook is installed on GPU.)"""

    def __init__(self) -> None:
        self.launched: float | None = None
        self.done = 0.0

    def exposed(self) -> float:
        """Seconds waited since the last call: 0 for steps with no all-reduce (accumulation, skipped)."""
        seconds = 0.0 if self.launched is None else max(self.done - self.launched, 0.0)
        self.launched = None
        return seconds


def timed_allreduce(clock: BucketClock, bucket):
    """DDP's own all-reduce (divide by the world size, then sum), timed. Not annotated: register_comm_hook compares
    the annotations with dist.GradBucket and Future[Tensor], and this module's are strings (postponed evaluation)."""
    clock.launched = time.perf_counter()

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        clock.done = max(clock.done, time.perf_counter())
        return fut.value()

    return allreduce_hook(None, bucket).then(done)


class DDP(Strategy):
    """DistributedDataParallel around the plain model; gradient accumulation through no_sync()."""

    SHARDINGS = ("NO_SHARD",)
    DEFAULT_SHARDING = "NO_SHARD"
    LAYOUT = "replicates the whole model on every rank"
    CPU_OFFLOAD = False
    ADAPTERS = True
    SEQUENCE_PARALLEL = True
    REPLICATES = True
    clock: BucketClock | None = None

    @classmethod
    def shards(cls, work: Workload) -> int:
        return 1

    def grad_scaler(self, init_scale: float) -> torch.amp.GradScaler:
        """torch's GradScaler: DDP's gradients are all-reduced whole, so every rank finds the same overflow."""
        return torch.amp.GradScaler(self.dist.device.type, init_scale=init_scale)

    @classmethod
    def gradient_bytes(cls, shape: Shape, work: Workload) -> int:
        """The buckets are the gradients (gradient_as_bucket_view), and they stay between steps."""
        return 4 * shape.num_params

    @classmethod
    def copy_bytes(cls, shape: Shape, work: Workload) -> int:
        """Autocast caches the matmul weights in the compute dtype."""
        c = work.compute_bytes
        return (shape.num_params - shape.root_params + shape.vocab * shape.hidden) * c if c < 4 else 0

    @classmethod
    def traffic_bytes(cls, shape: Shape, work: Workload) -> int:
        return 0 if work.world_size == 1 else replicated_bytes(shape, work)

    @classmethod
    def memory_hints(cls, m: ModelConfig) -> list[str]:
        return ["--strategy fsdp2 (shards the model)"]

    def wrap(self, model: nn.Module) -> nn.Module:
        model.to_empty(device=self.dist.device)
        retie(model)
        # a tied head's weight gradient summed with the embedding's in place (one [vocab, hidden] tensor less at the
        # backward's end); here, where the parameters are plain tensors the forward uses as they are
        tie_in_place(model)
        cuda = self.dist.device.type == "cuda"
        # init_sync=False: rank 0's weights are uninitialised memory until load_weights or a checkpoint fills every
        # rank alike, so broadcasting them would only cost time. gradient_as_bucket_view: the gradients are views
        # into the all-reduce buckets, not a second copy of them (4 bytes per parameter less at the step)
        wrapped = DistributedDataParallel(model, device_ids=[self.dist.local_rank] if cuda else None,
                                          init_sync=False, gradient_as_bucket_view=True)
        if not cuda:
            self.clock = BucketClock()
            wrapped.register_comm_hook(self.clock, timed_allreduce)
        return wrapped

    def head(self) -> Head:
        return Head(self.model, False, self.dist.world_size,
                    autocast=None if self.dtype == torch.float32 else self.dtype,
                    sequence_group=self.sequence and self.sequence.group)

    def replica_head(self) -> Head:
        # the module inside the wrapper, whose forward is no collective (the wrapper's first forward without grad
        # after training broadcasts the buffers, a collective), so generate() needs no per-token all-reduce to keep
        # the ranks in step: each rank generates at its own pace
        return dataclasses.replace(self.head(), model=self.model.module)

    def comm_seconds(self) -> float | None:
        return None if self.clock is None else self.clock.exposed()
