"""FSDP1 (`FullyShardedDataParallel`) with the knobs of PyTorch's FSDP tutorial: auto-wrap policy, backward and
forward prefetch, the all-gather rate limiter, original or flat parameters, the four sharding strategies, CPU
offload and mixed precision.

The model is built on the meta device and each unit materialised by FSDP itself (param_init_fn), so a rank
allocates only its shards; the weights come from load_weights() or a checkpoint. The embeddings and LM head stay
in the root unit whatever the policy: a tied weight must live in one unit.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from pipeline.config import Config
from pipeline.distributed.runtime import build_mesh
from pipeline.errors import UserError
from pipeline.model.modeling import decoder_layers, plain_name, retie
from pipeline.strategies.base import Strategy


def size_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, *, min_params: int,
                keep: frozenset[nn.Module]) -> bool:
    """--auto-wrap size: a unit for each module of at least min_params parameters not yet wrapped, except the
    containers (a ModuleList has no forward to gather in) and the modules kept in the root (keep)."""
    if recurse:
        return True
    return nonwrapped_numel >= min_params and module not in keep and not isinstance(module, (nn.ModuleList,
                                                                                             nn.ModuleDict))


class FSDP1(Strategy):
    """FullyShardedDataParallel around the whole model, one unit per decoder layer or per --min-params."""

    KNOBS = frozenset({"auto_wrap", "min_params", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
                       "use_orig_params"})

    @classmethod
    def check(cls, cfg: Config) -> None:
        m = cfg.model
        if m.compile and not m.use_orig_params:
            raise UserError("--compile under --strategy fsdp1 needs --use-orig-params on")
        if m.cpu_offload and not torch.cuda.is_available():  # FSDP1 always pins offloaded shards (CUDA only)
            raise UserError("--cpu-offload under --strategy fsdp1 needs a GPU (FSDP1 keeps the offloaded parameters in "
                            "pinned host memory); on a machine without one use --strategy fsdp2")
        if cfg.optim.weight_decay and not m.use_orig_params:
            raise UserError("--use-orig-params off gives the optimizer one flat parameter per FSDP unit, so "
                            "--weight-decay cannot skip norms and biases; use --weight-decay 0 or --use-orig-params on")

    def wrap(self, model: nn.Module) -> nn.Module:
        cfg, device = self.cfg, self.dist.device
        mixed = None if self.dtype == torch.float32 else MixedPrecision(param_dtype=self.dtype,
                                                                        reduce_dtype=torch.float32)
        # a device mesh also makes FSDP1's sharded state dicts DTensors, as FSDP2's are: the same checkpoint layout,
        # and the exporter's DTensor path. FSDP1 takes the 1-D mesh for every strategy but HYBRID_SHARD (2-D)
        mesh = build_mesh("HYBRID_SHARD" if cfg.sharding == "HYBRID_SHARD" else "FULL_SHARD", self.dist)
        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[cfg.sharding],
            device_mesh=mesh,
            cpu_offload=CPUOffload(offload_params=cfg.cpu_offload),
            auto_wrap_policy=self._policy(model),
            backward_prefetch=None if cfg.backward_prefetch == "NONE" else BackwardPrefetch[cfg.backward_prefetch],
            mixed_precision=mixed,
            param_init_fn=self._materialize,
            device_id=device,
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=cfg.limit_all_gathers,
            use_orig_params=cfg.use_orig_params,
        )
        if cfg.cpu_offload:
            self._point_at_pinned_shards(wrapped)
        return wrapped

    @staticmethod
    def _point_at_pinned_shards(wrapped: FullyShardedDataParallel) -> None:
        """Every parameter pointed at the pinned host shard FSDP trains, before any weight is loaded. The hazard
        (torch 2.11 to 2.13): FSDP1's lazy init pins a copy of each unit's offloaded flat parameter, and the
        parameters keep pointing at the unpinned original until the unit is first resharded; under NO_SHARD (one
        rank, or --sharding NO_SHARD) with use_orig_params, load_state_dict writes straight into the parameters,
        with no unshard to write back, so loaded weights went into the original while each step cast the pinned
        copy to the compute dtype: on an H200, one GPU trained from uninitialised memory (a first loss of exactly
        ln(vocab)); tests/helpers/fsdp1_offload_probe.py shows it on the CPU. One unshard and reshard per unit, root
        first (its lazy init sets up every unit). Cost: each unit in turn whole on the device in fp32 (a summon
        gathers in full precision), the root's embedding and head the largest (4.2 GB for Llama-3.1-8B's): a
        start-up peak, before optimizer states or activations exist. Collective under sharded strategies: every
        rank runs it, in the same order."""
        for unit in FullyShardedDataParallel.fsdp_modules(wrapped):
            with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
                pass

    def _materialize(self, module: nn.Module) -> None:
        """FSDP1's param_init_fn, called on each module of a unit before it is flattened: its own parameters as
        uninitialised memory on the device, and the tie of a tied head restored (one tensor, one flat entry)."""
        module.to_empty(device=self.dist.device, recurse=False)
        retie(self.module)

    def _policy(self, model: nn.Module):
        if self.cfg.auto_wrap == "transformer":
            layer_types = {type(layer) for layer in decoder_layers(model)}
            return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_types)
        # the embeddings, the head and every module holding them (LlamaModel holds the embedding) stay in the root
        ends = (model.get_input_embeddings(), model.get_output_embeddings())
        keep = frozenset(m for m in model.modules() if any(x is end for x in m.modules() for end in ends))
        return functools.partial(size_policy, min_params=self.cfg.min_params, keep=keep)

    def param_groups(self, weight_decay: float) -> list[dict]:
        if not self.cfg.use_orig_params:  # one flat parameter per unit; --weight-decay is 0 (config.py checks)
            return [{"params": list(self.model.parameters()), "weight_decay": 0.0}]
        # with use_orig_params each parameter this rank sees is a 1-D slice of its unit's flat parameter: whether it
        # is a matrix comes from the unwrapped model's shapes, by name (FSDP1 inserts its wrapper's attribute)
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            shape = self.shapes.get(plain_name(name), ())
            (decay if len(shape) >= 2 else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # the root's own method: it knows which gradients are shards and which are replicated
        return self.model.clip_grad_norm_(max_norm)
