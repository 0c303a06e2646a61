"""The flat-tensor collectives the sharded strategies and the vocabulary-parallel loss issue, the clock that times
them for `time_ms.comm`, and the differentiable all-to-all that expert and sequence parallelism move tokens with."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (*_single) and the old names warn on every call; 2.11 (the GPU
# image) has only the old ones
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommClock:
    """Wall time spent inside collectives since the last read(). It is the time the step waited on them only where
    the collectives block the calling thread: gloo's synchronous calls on CPU, not NCCL's (queued on a stream)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - started

    def read(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its backward (the same exchange, the splits swapped): torch's own differentiable one,
    torch.distributed.nn.functional.all_to_all_single, warns at every call that it is deprecated in favour of a
    private module, so this is the public collective with the two lines of autograd around it."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def exchange(rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """rows[send[0] first rows] to rank 0 of the group, the next send[1] to rank 1, ...; back, recv[i] rows from each
    rank i, in rank order. Differentiable (the backward sends the gradients back the same way). A collective."""
    return _AllToAll.apply(rows, recv, send, group)
