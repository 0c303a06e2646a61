"""The flat-tensor collectives the sharded strategies and the vocabulary-parallel loss issue, and the clock that
times them for `time_ms.comm`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

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
