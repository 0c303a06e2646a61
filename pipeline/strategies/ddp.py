"""DDP (`DistributedDataParallel`): a whole replica of the model, its gradients and its optimizer state on every
rank; gradients all-reduced (averaged) in buckets during the backward.

Nothing is sharded, so nothing is gathered: the fastest choice while the model, its gradients and two fp32 AdamW
states fit on one device (16 bytes per parameter), and on CPU, where FSDP's per-layer collectives are synchronous.
Mixed precision is autocast over fp32 parameters. Checkpoints hold the same names as every other strategy; DCP
writes each replicated tensor once.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipeline.loss import CausalLMLoss
from pipeline.modeling import reset_rotary, retie
from pipeline.strategies.base import Strategy


class DDP(Strategy):
    """DistributedDataParallel around the plain model; gradient accumulation through no_sync()."""

    def build(self, hf_config) -> nn.Module:
        model = self.meta(hf_config)
        model.to_empty(device=self.dist.device)
        retie(model)
        reset_rotary(model, self.dist.device)
        self.checkpoint_and_compile(model)
        cuda = self.dist.device.type == "cuda"
        # init_sync=False: rank 0's weights are uninitialised memory until load_weights or a checkpoint fills every
        # rank alike, so broadcasting them would only cost time. gradient_as_bucket_view: the gradients are views
        # into the all-reduce buckets, not a second copy of them (4 bytes per parameter less at the step)
        self._model = DistributedDataParallel(model, device_ids=[self.dist.local_rank] if cuda else None,
                                              init_sync=False, gradient_as_bucket_view=True)
        return self._model

    def loss(self) -> CausalLMLoss:
        return CausalLMLoss(self.model, False, self.dist.world_size,
                            autocast=None if self.dtype == torch.float32 else self.dtype)
