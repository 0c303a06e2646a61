"""How a strategy runs the built model's output layer: what every objective (pipeline/objectives/) and the greedy
sampler need of a strategy, and nothing else of it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipeline.model.vocab_parallel import gather_rows


@dataclass(frozen=True)
class Head:
    """The model as a strategy built it, and how its output layer runs (Strategy.head)."""

    model: nn.Module
    """What a forward calls: the model as wrapped."""
    vocab_parallel: bool
    """The output layer is sharded by vocabulary rows over group (fsdp2's default): every rank scores every rank's
    rows against its share (pipeline/model/vocab_parallel.py); else the model's own forward on this rank's rows."""
    world_size: int
    group: dist.ProcessGroup | None = None
    """The vocabulary-parallel head's group."""
    autocast: torch.dtype | None = None
    """Run the forward under torch.autocast in this dtype (a strategy whose parameters stay fp32: ddp)."""
    compiled_loss: bool = False
    """The vocabulary-parallel loss's per-chunk math through torch.compile (--compile on, on a GPU)."""
    sequence_group: dist.ProcessGroup | None = None
    """--sequence-parallel: the ranks sharing each row, each holding a slice of its positions (None: off)."""

    @property
    def sequence(self) -> int:
        """How many ranks share each row (1 without sequence parallelism)."""
        return 1 if self.sequence_group is None else dist.get_world_size(self.sequence_group)

    def rank_share(self, loss: torch.Tensor) -> torch.Tensor:
        """What an objective over whole sequences (pairs, examples) returns of its loss over a batch's items (their
        sum over the step's items): on the vocabulary-parallel path every rank's items already, whose gradients are
        summed; else this rank's share, scaled by the world size the wrappers average over, and divided among the
        ranks that share each row (each computed the same items' loss whole, from the row's gathered positions,
        whose backward sums their gradients: sequence_rows)."""
        return loss if self.vocab_parallel else loss * self.world_size / self.sequence

    def autocasting(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, self.autocast) if self.autocast else contextlib.nullcontext()

    def every_row(self, x: torch.Tensor) -> torch.Tensor:
        """A batch's per-row tensor (flags, reference values) for the rows the head's outputs cover: every rank's
        on the vocabulary-parallel path (a collective), else this rank's own."""
        return gather_rows(x, self.group) if self.vocab_parallel else x
