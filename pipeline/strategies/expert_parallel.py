"""Expert parallelism under fsdp2 (--expert-parallel): each decoder layer's routed experts split by expert index over
the ranks FSDP shards over, each rank holding E/N experts whole and never gathering the others'; tokens travel to
their experts' ranks and back by all-to-all.

FSDP2 already stores a fused expert weight ([experts, ...]) sharded by its first dimension, so where the shard ranks
divide the experts each rank's shard is E/N whole experts: expert parallelism keeps exactly that layout (the same
DTensors, Shard(0) on the FSDP mesh, so a checkpoint holds every expert under its global index and resumes at any
degree), leaves those parameters out of FSDP's all-gathers (as the vocabulary-parallel head is), and replaces the
gather by moving tokens instead. Each rank computes its experts with the family's own experts function (transformers'
forward, on its local experts), so the result is the model's function; no token is dropped.

Gradients: each rank's experts receive, through the all-to-all's backward, the gradient of every rank's tokens that
they served, then are divided as FSDP divides the others (by the world size where FSDP averages; by 1 where the loss
is already the mean over every rank's tokens, the vocabulary-parallel head's sum mode). Under HYBRID_SHARD the experts
are split over each node's shard ranks and replicated across nodes (Replicate() on the replicate dimension, as FSDP
places the other parameters): tokens never leave their node, and each replica's experts' gradients are summed over the
replicas (one all-reduce per weight per step) before that division.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from pipeline.config import ModelConfig
from pipeline.distributed.collectives import exchange
from pipeline.errors import UserError
from pipeline.model.adapters import wrapper_delta
from pipeline.model.modeling import fused_experts, meta_model, moe_shape, routing_arguments, untested_family

EXPERT_PARALLEL_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
"""The shardings whose shard ranks can split the experts (NO_SHARD has one shard rank)."""


def expert_parallel_asked(cfg: ModelConfig) -> bool:
    """Whether --expert-parallel names a degree above 1 (auto asks for nothing it cannot have)."""
    return cfg.expert_parallel != "auto" and int(cfg.expert_parallel) != 1


def auto_blocked(cfg: ModelConfig) -> str:
    """Why --expert-parallel auto stays off for these settings ("" where it may split): what a named degree is
    refused with (registry._check_expert_parallel)."""
    if cfg.strategy != "fsdp2":
        return f"--strategy {cfg.strategy}"
    if cfg.sharding not in EXPERT_PARALLEL_SHARDINGS:
        return f"--sharding {cfg.sharding}"
    if cfg.cpu_offload:
        return "--cpu-offload"
    return f"--sequence-parallel {cfg.sequence_parallel}" if cfg.sequence_parallel > 1 else ""


def degree(cfg: ModelConfig, hf_config, shard_ranks: int, node_ranks: int, model: nn.Module | None = None) -> int:
    """--expert-parallel resolved for this model and mesh: 1 (off), or the ranks FSDP shards over (auto: where
    auto_off finds nothing against it). A number asked for that this cannot give is one line. model: the one being
    built (else one is built on the meta device, to find its experts modules)."""
    if cfg.expert_parallel == "auto":
        return 1 if auto_off(cfg, hf_config, shard_ranks, node_ranks, model) else shard_ranks
    if not expert_parallel_asked(cfg):
        return 1
    n, (experts, _) = int(cfg.expert_parallel), moe_shape(hf_config)
    if not experts:
        raise UserError(f"--expert-parallel {n}: {hf_config.model_type} is not a mixture of experts")
    if n != shard_ranks:
        raise UserError(f"--expert-parallel {n}: the experts are split over the ranks FSDP shards over, {shard_ranks} "
                        f"here (--sharding {cfg.sharding}); use --expert-parallel {shard_ranks} or auto")
    if experts % n:
        raise UserError(f"--expert-parallel {n} does not divide the {experts} experts of each layer of "
                        f"{hf_config.model_type}; use a degree that does, or 1")
    if why := unroutable(model or meta_model(hf_config)):
        raise UserError(f"--expert-parallel {n}: {why}; use 1")
    return n


def auto_off(cfg: ModelConfig, hf_config, shard_ranks: int, node_ranks: int, model: nn.Module | None = None) -> str:
    """Why --expert-parallel auto leaves this run's experts gathered ("" where it splits them): settings it does not
    take, a degree that does not divide the experts or spans nodes, a family the suite does not train (its tiny model
    proven against one process: a named degree still splits it, bench/moe_families.py checks the registry), or
    experts that cannot be split."""
    experts, _ = moe_shape(hf_config)
    if not experts:
        return f"{hf_config.model_type} is not a mixture of experts"
    if why := auto_blocked(cfg):
        return why
    if shard_ranks < 2 or experts % shard_ranks:
        return f"{shard_ranks} shard rank(s) do not split the {experts} experts of each layer"
    if shard_ranks > node_ranks:
        return (f"the {shard_ranks} shard ranks span nodes (all-to-all would cross them; --sharding HYBRID_SHARD "
                "splits the experts within each node)")
    if why := untested_family(hf_config):
        return f"{why}; --expert-parallel {shard_ranks} splits it"
    return unroutable(model or meta_model(hf_config))


def unroutable(model: nn.Module) -> str:
    """Why the model's experts cannot be split by expert ("" when they can): an experts module that takes no routing
    indices (Llama 4's run every expert on every token, scaled by the router's scores), or one whose weights are not
    laid out by expert."""
    found = [(f"layers.{i}.{name}", module) for i, _, name, module in fused_experts(model)]
    if not found:
        return f"{model.config.model_type} has no fused routed experts to split"
    for name, module in found:
        if routing_arguments(module) is None:
            return (f"{type(module).__name__} ({name}) takes no routing indices (its experts run on every token), so "
                    "there are no tokens to send to experts")
        required = [p for p in inspect.signature(module.forward).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(required) > 3:  # what else it takes could not travel with the tokens
            return f"{type(module).__name__} ({name}) takes more than the tokens and their routing"
        for leaf, param in module.named_parameters(recurse=False):
            if param.shape[0] != getattr(module, "num_experts", None):
                return f"{name}.{leaf} is not laid out by expert ({tuple(param.shape)})"
    return ""


@contextlib.contextmanager
def local_experts(module: nn.Module, leaves: list[str], dtype: torch.dtype, count: int,
                  updates: dict[str, torch.Tensor | None]) -> Iterator[list[torch.Tensor]]:
    """The experts module seen as holding only this rank's experts: each weight its local shard in the compute dtype
    (a differentiable view of the DTensor parameter, so the gradient reaches it), num_experts their count. Its
    forward is called directly, not through the module (whose hooks saw the global routing already). The parameters
    are the module's own at the call (to_empty gave it new ones after shard()). updates: an adapter's update of a
    weight's local experts, added to it (LoRA on the experts). Yields the local views."""
    saved = {leaf: module._parameters[leaf] for leaf in leaves}
    views = {leaf: p.to_local().to(dtype if p.dtype.is_floating_point else p.dtype) for leaf, p in saved.items()}
    for leaf, update in updates.items():
        if update is not None:
            views[leaf] = views[leaf] + update.to(views[leaf].dtype)
    experts = module.num_experts
    for leaf, view in views.items():
        del module._parameters[leaf]
        module.__dict__[leaf] = view
    module.num_experts = count
    try:
        yield list(views.values())
    finally:
        module.num_experts = experts
        for leaf, param in saved.items():
            module.__dict__.pop(leaf, None)
            module._parameters[leaf] = param


def peft_wrappers(layer: nn.Module, name: str) -> dict[str, nn.Module]:
    """The LoRA wrappers peft put around the experts module `name` of the layer (experts.base_layer.base_layer: one
    per adapted weight), by the weight each adapts; each made to pass its call through to what it wraps, since the
    split forward adds the adapter's update to the local experts itself (peft's own would add every expert's to the
    split weight). Empty where there is no adapter."""
    wrappers, outer = {}, name
    while outer.endswith(".base_layer"):
        outer = outer.removesuffix(".base_layer")
        wrapper = layer.get_submodule(outer)
        wrappers[wrapper.parameter_name] = wrapper
        wrapper.forward = functools.partial(passed_through, wrapper)
    return wrappers


def passed_through(wrapper: nn.Module, *args, **kwargs):
    return wrapper.base_layer(*args, **kwargs)


class ExpertParallel:
    """The experts of one model split over a mesh dimension, and their gradients' reduction."""

    def __init__(self, mesh: DeviceMesh, compute_dtype: torch.dtype, divide: float):
        self.mesh = mesh
        """FSDP's mesh: (shard,), or (replicate, shard) under HYBRID_SHARD."""
        self.placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
        self.group = mesh.get_group(mesh.ndim - 1)
        """The shard ranks: those that split the experts and trade tokens."""
        self.replicas = mesh.get_group(0) if mesh.ndim == 2 and mesh.size(0) > 1 else None
        """The ranks holding the same experts in other replicas (HYBRID_SHARD over nodes), or None."""
        self.n = dist.get_world_size(self.group)
        self.dtype = compute_dtype
        self.divide = divide
        self.modules: list[tuple[nn.Module, list[str]]] = []
        """Each experts module split, with the names of its weights (the parameters themselves change at to_empty)."""

    def shard(self, model: nn.Module) -> set[nn.Parameter]:
        """Every experts module's weights as DTensors of E/N whole experts per rank (on the meta device, before
        to_empty), and its forward routed through all-to-all; the parameters FSDP must leave alone. Where peft
        wrapped the experts (LoRA on their fused weights: one ParamWrapper per weight around the module), each
        wrapper passes its call through and the split forward adds its update to this rank's experts itself."""
        ignored: set[nn.Parameter] = set()
        for _, layer, name, module in fused_experts(model):  # each checked by degree() (unroutable)
            wrappers = peft_wrappers(layer, name)
            leaves = []
            for leaf, param in list(module.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(param, self.mesh, self.placements), param.requires_grad)
                setattr(module, leaf, sharded)
                leaves.append(leaf)
                ignored.add(sharded)
            self.modules.append((module, leaves))
            module.forward = functools.partial(self._forward, module, module.forward, leaves, routing_arguments(module),
                                               wrappers)
        return ignored

    def _forward(self, module: nn.Module, own, leaves: list[str], args: tuple[str, str],
                 wrappers: dict[str, nn.Module], hidden_states: torch.Tensor, *rest, **named) -> torch.Tensor:
        """The experts' output for this rank's tokens, computed by the ranks that hold each token's experts. Two
        all-to-alls each way (the counts, then the rows; a host sync on the counts), every rank of the group in
        the same order: a collective every rank must reach, in every layer's forward (and its recomputation)."""
        index, weights = (named.pop(a) if a in named else rest[i] for i, a in enumerate(args))
        experts, per_rank = module.num_experts, module.num_experts // self.n
        flat = index.reshape(-1)
        kept = (flat < experts).nonzero().squeeze(1)  # ids past the last expert: a family's dropped slots
        order = kept[torch.argsort(flat[kept], stable=True)]  # by expert, so by the rank that holds it
        dest = flat[order] // per_rank
        sent = torch.bincount(dest, minlength=self.n)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=self.group)
        send, recv = sent.tolist(), got.tolist()
        rows = hidden_states[order // index.shape[1]]
        ids = torch.empty(sum(recv), dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(ids, flat[order] % per_rank, recv, send, group=self.group)
        arrived = exchange(rows, recv, send, self.group)
        mine = torch.arange(per_rank, device=flat.device) + dist.get_rank(self.group) * per_rank if wrappers else None
        updates = {leaf: wrapper_delta(w, mine, not getattr(module, "is_transposed", False))
                   for leaf, w in wrappers.items()}
        with local_experts(module, leaves, self.dtype, per_rank, updates) as views:  # the family's own function
            done = own(arrived, ids[:, None], arrived.new_ones((len(ids), 1)))
            if not len(ids):
                # no row for this rank's experts: a loop-style experts function then returns a tensor with no graph,
                # and this rank would skip the two all-to-alls of the backward every other rank enters (a hang), and
                # leave its experts without a gradient where the others have one
                done = done + sum((v.sum() for v in views if v.is_floating_point()), arrived.sum()) * 0
        back = exchange(done, send, recv, self.group)
        out = hidden_states.new_zeros((flat.shape[0], back.shape[1]), dtype=back.dtype).index_copy(0, order, back)
        slots = out.reshape(index.shape[0], index.shape[1], -1) * weights.unsqueeze(-1).to(out.dtype)
        return slots.sum(dim=1).to(hidden_states.dtype)

    def reduce_gradients(self) -> None:
        """The experts' gradients summed over the replicas and divided as FSDP divides the others' (once per step,
        after the last backward). Within a replica no communication: each expert lives on one rank of it, and its
        gradient already holds every shard rank's tokens it served (the all-to-all's backward brought them). Across
        replicas one all-reduce per weight, every rank in the same order: a collective every rank must reach, so a
        weight without a gradient contributes zeros rather than skipping it."""
        for param in (module._parameters[leaf] for module, leaves in self.modules for leaf in leaves):
            if not param.requires_grad:
                continue
            # every rank's experts have a gradient (_forward's zero term sees to it where no token came); a missing one
            # is zeros rather than skipped, which would leave the other replicas in an all-reduce of their own
            if param.grad is None and self.replicas is not None:
                param.grad = torch.zeros_like(param)
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if self.replicas is not None:
                dist.all_reduce(grad, group=self.replicas)
            if self.divide != 1:
                grad.div_(self.divide)
