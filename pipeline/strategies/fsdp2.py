"""FSDP2 (`fully_shard`): each decoder layer and the root sharded over a device mesh, optionally with the
vocabulary-parallel embedding and head.

The model is built on the meta device, wrapped, then materialised with `to_empty`, so each rank allocates only its
shards; the weights come from load_weights() or a checkpoint.

On CPU each FSDP module's all-gather and reduce-scatter go through TimedAllGather/TimedReduceScatter (FSDP2's
custom-collective hooks), which issue the same gloo collective and time it: FSDP2 calls them synchronously there
(no streams, no async unshard), so their sum is the time the step waited on them. On GPU they are queued on
streams and a host clock would time the launch, so none is installed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from pipeline.config import VOCAB_PARALLEL_SHARDINGS, ModelConfig
from pipeline.distributed.collectives import CommClock, all_gather_flat, reduce_scatter_flat
from pipeline.distributed.runtime import build_mesh
from pipeline.errors import UserError
from pipeline.model import nf4
from pipeline.model.head import Head
from pipeline.model.modeling import decoder_layers, moe_shape, trunk, untested_family
from pipeline.model.vocab_parallel import VocabParallelEmbedding, unsupported_terms
from pipeline.strategies.base import Strategy
from pipeline.strategies.expert_parallel import ExpertParallel, auto_off, degree

log = logging.getLogger("pipeline")  # the run's logger (pipeline/train/telemetry.py sets its handlers)


class _Timed:
    """What the timed collectives share: the clock, and FSDP2's default buffers (a fresh tensor per call)."""

    def __init__(self, clock: CommClock) -> None:
        self.clock = clock

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


# FSDPModule.set_custom_all_gather/set_custom_reduce_scatter are public, but the AllGather/ReduceScatter interfaces
# they name live only in a private module: these classes implement them by shape (allocate, __call__) without
# importing it, so a torch release that moves it cannot break a run. tests/test_train checks that fsdp2 still reports
# time_ms.comm through them.
class TimedAllGather(_Timed):
    """FSDP2's default all-gather (one flat all-gather), timed."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        with self.clock.timing():
            return all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)


class TimedReduceScatter(_Timed):
    """FSDP2's default reduce-scatter, timed."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> dist.Work | None:
        with self.clock.timing():
            return reduce_scatter_flat(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class FSDP2(Strategy):
    """`fully_shard` per decoder layer and at the root; --sharding picks the mesh and resharding."""

    KNOBS = frozenset({"forward_prefetch", "backward_prefetch"})
    mesh: DeviceMesh
    vocab_parallel: bool
    clock: CommClock | None = None
    """Times the collectives (CPU only)."""
    experts: ExpertParallel | None = None
    """--expert-parallel: the experts split over the shard ranks (None: off)."""

    VOCAB_PARALLEL = True
    ADAPTERS = True
    SEQUENCE_PARALLEL = True

    @classmethod
    def uses_vocab_parallel(cls, m: ModelConfig) -> bool:
        """auto is on wherever the sharding allows it. Measured (BENCHMARKS.md): on CPU it halved the step; on one
        H100 with Llama-3.2-1B at batch 8 x 2048 it runs as fast as the HF Trainer on 30% less memory, where the
        model's own loss ran out of memory."""
        if m.sharding not in VOCAB_PARALLEL_SHARDINGS:
            return False
        return m.vocab_parallel == "on" or (m.vocab_parallel == "auto" and not m.cpu_offload)

    @classmethod
    def honoured_knobs(cls, m: ModelConfig) -> frozenset[str]:
        # FSDP2 always prefetches as BACKWARD_PRE: another value is not applied
        return cls.KNOBS if m.backward_prefetch == "BACKWARD_PRE" else cls.KNOBS - {"backward_prefetch"}

    @classmethod
    def memory_hints(cls, m: ModelConfig) -> list[str]:
        vocab = m.vocab_parallel == "off" and m.sharding in VOCAB_PARALLEL_SHARDINGS and not m.cpu_offload
        return [*(["--vocab-parallel auto (no full-width logits)"] if vocab else []), *super().memory_hints(m)]

    def wrap(self, model: nn.Module) -> nn.Module:
        self.vocab_parallel = self._vocab_parallel_for(model)
        self.mesh = build_mesh(self.cfg.sharding, self.dist)
        if self.cfg.adapter == "qlora":
            self._check_nf4(model)
        self._shard(model)
        if self.dist.device.type == "cpu":
            self._time_collectives(model)
        # the shards' memory (host memory with CPU offload), uninitialised until loaded
        model.to_empty(device="cpu" if self.cfg.cpu_offload else self.dist.device)
        return model

    def _check_nf4(self, model: nn.Module) -> None:
        """QLoRA's NF4 weights must split into whole blocks per shard, and there must be shards: with one rank,
        FSDP2 skips the all-gather that rebuilds torchao's NF4 tensor and fails in the first forward. One line,
        the same on every rank, before any collective."""
        shards = self.mesh.size(-1)
        if shards == 1:
            raise UserError("--adapter qlora under --strategy fsdp2 needs its weights sharded over 2 or more ranks "
                            "(FSDP2 with one shard does not rebuild torchao's NF4 weights); use --strategy ddp or auto")
        nf4.refuse_layout({name: p.shape for name, p in model.named_parameters() if nf4.is_nf4(p)}, shards)

    def _vocab_parallel_for(self, model: nn.Module) -> bool:
        """--vocab-parallel for this model: off, with the reason logged, where the model's forward has a term the
        vocabulary-parallel path does not compute (it would train another function than the one exported); refused
        in one line when asked for with on. The same on every rank, before any collective."""
        if not self.uses_vocab_parallel(self.cfg):
            return False
        why = unsupported_terms(model)
        if not why and self.cfg.vocab_parallel == "auto":  # only where the suite checked it computes the model's loss
            why = untested_family(model.config)
        if why and self.cfg.vocab_parallel == "on":
            raise UserError(f"--vocab-parallel on cannot train {type(model).__name__}: {why}; use --vocab-parallel "
                            "auto or off")
        if why and self.dist.is_main:
            log.warning("vocabulary-parallel head off for %s: %s (the model's own embedding and loss are used)",
                        type(model).__name__, why)
        return not why

    def _shard(self, model: nn.Module) -> None:
        """fully_shard each decoder layer and the root.

        vocab_parallel: the embedding and LM head are sharded by vocabulary rows on the same mesh and left out of
        FSDP (pipeline/model/vocab_parallel.py); the root FSDP module is then the decoder stack (modeling.trunk),
        whose gradients are summed over ranks, not averaged, since the loss is already the mean over every rank's
        tokens.
        """
        cfg, mesh = self.cfg, self.mesh
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        # pinned (page-locked) host memory needs an accelerator: on a CPU-only machine the offloaded shards are plain
        # host tensors, the same code paths otherwise
        offload = CPUOffloadPolicy(pin_memory=self.dist.device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
        reshard = cfg.sharding in ("FULL_SHARD", "HYBRID_SHARD")
        ignored = self._expert_parallel(model)
        layers = decoder_layers(model)
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload,
                        ignored_params=ignored)
        if cfg.forward_prefetch:  # FSDP2's explicit prefetch; backward prefetch is implicit (as BACKWARD_PRE)
            for layer, after in zip(layers, layers[1:], strict=False):
                layer.set_modules_to_forward_prefetch([after])
        if not self.vocab_parallel:
            # root: embeddings, final norm and lm_head (one shared parameter when tied). Not resharded after
            # forward: the backward needs the lm_head first, right after the forward ends, so resharding would only
            # all-gather it again
            fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload,
                        ignored_params=ignored)
            return
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        # frozen stays frozen (adapters train on a frozen embedding and head)
        weight = nn.Parameter(distribute_tensor(embed.weight, mesh, [Shard(0)]), embed.weight.requires_grad)
        if head.weight is embed.weight:
            head.weight = weight
        else:
            head.weight = nn.Parameter(distribute_tensor(head.weight, mesh, [Shard(0)]), head.weight.requires_grad)
        model.set_input_embeddings(VocabParallelEmbedding(weight, embed.padding_idx, mesh.get_group()))
        fully_shard(trunk(model), mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload,
                    ignored_params={weight, head.weight, *ignored})
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    def _expert_parallel(self, model: nn.Module) -> set[nn.Parameter]:
        """--expert-parallel: the routed experts split by expert over the shard ranks and left out of FSDP
        (pipeline/strategies/expert_parallel.py); the parameters FSDP must ignore. Their gradients are summed over
        HYBRID_SHARD's replicas and divided as FSDP divides the others: by the world size, or by 1 where the
        vocabulary-parallel loss is already the mean over every rank's tokens."""
        n = degree(self.cfg, model.config, self.mesh.size(-1), self.dist.local_world_size, model)
        if n == 1:
            if self.cfg.expert_parallel == "auto" and moe_shape(model.config)[0] and self.dist.is_main:
                log.info("expert parallelism off (--expert-parallel auto): %s", auto_off(
                    self.cfg, model.config, self.mesh.size(-1), self.dist.local_world_size, model))
            return set()
        self.experts = ExpertParallel(self.mesh, self.dtype, 1.0 if self.sums_gradients else self.dist.world_size)
        ignored = self.experts.shard(model)
        if self.dist.is_main:
            total, _ = moe_shape(model.config)
            log.info("expert parallelism: %d experts per layer over %d ranks (%d each), tokens sent by all-to-all",
                     total, n, total // n)
        return ignored

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # after the step's last backward and before the norm (once per step): the experts' gradients summed over
        # HYBRID_SHARD's replicas (an all-reduce per weight every rank reaches; none without replicas) and divided as
        # FSDP divides the others
        if self.experts is not None:
            self.experts.reduce_gradients()
        return super().clip_grad_norm(max_norm)

    def _time_collectives(self, model: nn.Module) -> None:
        self.clock = CommClock()
        gather, scatter = TimedAllGather(self.clock), TimedReduceScatter(self.clock)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(scatter)

    @property
    def sums_gradients(self) -> bool:
        return self.vocab_parallel  # _shard sets each unit's divide factor to 1 then

    def comm_seconds(self) -> float | None:
        return None if self.clock is None else self.clock.read()

    @property
    def root(self) -> FSDPModule:
        """The outermost FSDP module: the model itself, or its decoder stack when the head is vocabulary-parallel."""
        return self.model if isinstance(self.model, FSDPModule) else trunk(self.model)

    def head(self) -> Head:
        return Head(self.model, self.vocab_parallel, self.dist.world_size,
                    self.mesh.get_group() if self.vocab_parallel else None,
                    # on the CPU the compiled math measured no faster (BENCHMARKS.md fused_loss_cpu)
                    compiled_loss=self.vocab_parallel and self.cfg.compile and self.dist.device.type == "cuda",
                    sequence_group=self.sequence and self.sequence.group)

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        self.root.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def release(self) -> None:
        self.root.reshard()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        # every unit kept gathered after its forward until the pass ends (torch's documented use of
        # set_reshard_after_forward, for evaluation), then each resharded and set back as _shard made it
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        self.root.set_reshard_after_forward(False)
        try:
            yield
        finally:
            reshard = self.cfg.sharding in ("FULL_SHARD", "HYBRID_SHARD")
            for layer in decoder_layers(self.model):
                layer.set_reshard_after_forward(reshard, recurse=False)
            for unit in units:
                unit.reshard()
