"""A from-scratch ZeRO-3 in one module: what FSDP does, written to be read.

Layout. Each decoder layer is a unit, and so is what is left at the root (embeddings, final norm, LM head). A
unit's parameters are concatenated, by weight-decay group, into flat vectors padded with zeros to a multiple of
the world size; rank r keeps elements [r * n / W, (r + 1) * n / W) of each as an fp32 `nn.Parameter` (its shard).
The optimizer (AdamW) sees only these shards, so its states are sharded too. The padding sits at the end of the
last ranks' shards; it is zero at init, zeroed again after every reduce-scatter, and stays zero through the step
(zero gradient, zero moments: AdamW moves it by 0).

Forward. A unit's pre-forward hook all-gathers its flats (cast to the compute dtype first: half the traffic in
bf16) and points each module attribute (`q_proj.weight`, ...) at a view of the gathered vector; the post-forward
hook drops those views. Activations saved for the backward would keep the gathered vector alive, so while a
decoder layer runs, autograd's saved-tensor hooks replace every saved view of it by its (size, stride, offset);
the backward all-gathers a flat again the first time one of its views is needed. The root unit stays gathered from its
forward to the end of its backward: the head runs last in the forward and first in the backward.

Backward. The gather is an autograd Function whose backward receives the gradient of the whole flat vector: it
reduce-scatters it (sum, then / W) into the shard's gradient, and frees the gathered copy. Between gradient
accumulation boundaries it only adds the full gradient to a local buffer; the one reduce-scatter happens on the last
micro-step.

Loading and saving go through the same DCP layout as FSDP2 (each parameter row-sharded, Shard(0), under the plain
model's names), one unit gathered at a time, so a checkpoint moves between strategies and world sizes and no rank
ever holds the whole model. The safetensors load reads each rank's rows only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from pipeline.distributed.collectives import CommClock, all_gather_flat, reduce_scatter_flat
from pipeline.distributed.runtime import build_mesh
from pipeline.model.modeling import decoder_layers
from pipeline.model.weights import read_weights
from pipeline.strategies.base import Strategy


class Comm:
    """The two collectives ZeRO-3 needs, on the default group, with the time spent waiting in them."""

    def __init__(self, world_size: int, rank: int, dtype: torch.dtype):
        self.world_size, self.rank, self.dtype = world_size, rank, dtype
        self.sync = True
        """Whether this micro-step's backward reduce-scatters (False: accumulate locally)."""
        self.clock = CommClock()
        """Wall time blocked in collectives (exact on CPU: gloo collectives are synchronous)."""

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        with self.clock.timing():
            all_gather_flat(out, shard)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        with self.clock.timing():
            reduce_scatter_flat(out, full)


@dataclass(eq=False)
class Slot:
    """One original parameter inside a flat parameter."""

    name: str
    """Its fully qualified name in the plain model (the first one, when tied)."""
    owners: list[tuple[nn.Module, str]]
    """(module, attribute) pairs that use it: two for a tied embedding and LM head."""
    shape: torch.Size
    offset: int
    """Where it starts in the flat vector."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(eq=False)
class FlatParam:
    """Some of a unit's parameters as one flat vector, of which this rank holds one 1/W slice (shard)."""

    slots: list[Slot]
    decay: bool
    """Whether weight decay applies (matrices: yes; norms and biases: no)."""
    comm: Comm
    device: torch.device
    shard: nn.Parameter = field(init=False)
    gathered: torch.Tensor | None = field(default=None, init=False)
    """The full vector of the forward in flight (compute dtype); identifies the views saved for backward."""
    regathered: torch.Tensor | None = field(default=None, init=False)
    """The full vector gathered again for the backward."""
    pending: torch.Tensor | None = field(default=None, init=False)
    """Full-size fp32 gradient accumulated over the micro-steps that do not sync."""

    def __post_init__(self) -> None:
        self.numel = sum(s.numel for s in self.slots)
        self.shard_numel = math.ceil(self.numel / self.comm.world_size)
        self.padded = self.shard_numel * self.comm.world_size
        self.start = self.comm.rank * self.shard_numel
        self.valid = max(0, min(self.shard_numel, self.numel - self.start))
        """Elements of the shard that are real parameters; the rest is padding."""
        self.shard = nn.Parameter(torch.zeros(self.shard_numel, device=self.device))

    def gather(self, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The full padded vector from every rank's slice of source (shard-sized). A collective."""
        out = torch.empty(self.padded, dtype=dtype, device=self.device)
        self.comm.all_gather(out, source.detach().to(dtype).contiguous())
        return out

    def attach(self, full: torch.Tensor) -> None:
        """Point every owner's attribute at its view of full."""
        for slot in self.slots:
            view = full.narrow(0, slot.offset, slot.numel).view(slot.shape)
            for module, attr in slot.owners:
                setattr(module, attr, view)

    def detach(self) -> None:
        """Drop the views (and with them the gathered vector, once autograd no longer holds it)."""
        for slot in self.slots:
            for module, attr in slot.owners:
                setattr(module, attr, None)
        self.gathered = None

    def reduce(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The shard's gradient from the full vector's: summed over ranks and divided by W at a sync micro-step;
        before that, only accumulated locally (None: no gradient for the shard yet). A collective when syncing."""
        grad = grad.float() if self.pending is None else self.pending + grad.float()
        if not self.comm.sync:
            self.pending = grad
            return None
        self.pending = None
        out = torch.empty(self.shard_numel, device=self.device)
        self.comm.reduce_scatter(out, grad.contiguous())
        out.div_(self.comm.world_size)
        out[self.valid:] = 0  # padding stays zero
        return out

    def rows(self, source: torch.Tensor, mesh: DeviceMesh) -> dict[str, DTensor]:
        """Each parameter's rows this rank holds in the DCP layout (Shard(0) over the mesh), from a shard-sized
        source (the weights or an optimizer state): the flat vector is gathered once (one unit in memory). A
        collective."""
        full = self.gather(source, torch.float32)
        return {slot.name: row_shard(full.narrow(0, slot.offset, slot.numel).view(slot.shape), mesh)
                for slot in self.slots}

    def from_rows(self, rows: dict[str, DTensor]) -> torch.Tensor:
        """The inverse of rows(): this rank's shard-sized slice of the flat vector the DTensors make up. A
        collective (each parameter all-gathered in turn)."""
        full = torch.zeros(self.padded, device=self.device)
        for slot in self.slots:
            full.narrow(0, slot.offset, slot.numel).copy_(rows[slot.name].full_tensor().flatten())
        return full.narrow(0, self.start, self.shard_numel).clone()


def row_shard(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's rows of a full tensor as a Shard(0) DTensor, split as torch.chunk splits (FSDP2's layout), copied
    so the full tensor can be freed."""
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = full.shape[0]
    per_rank = math.ceil(rows / world)
    first, last = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
    return DTensor.from_local(full[first:last].clone(), mesh, [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.stride())


class Gather(torch.autograd.Function):
    """Forward: all-gather a flat parameter (compute dtype). Backward: reduce-scatter its gradient to the shard."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, flat: FlatParam) -> torch.Tensor:
        ctx.flat = flat
        return flat.gather(shard, flat.comm.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat = ctx.flat
        flat.regathered = None  # the unit's backward is done: free its second gather
        return flat.reduce(grad), None


class Unit:
    """A group of modules whose parameters are gathered together: a decoder layer, or the root."""

    def __init__(self, flats: list[FlatParam], reshard: bool):
        self.flats, self.reshard = flats, reshard
        self.saved: contextlib.AbstractContextManager | None = None
        self.kept = False
        """Inside ManualZeRO3.gathered: the parameters stay gathered from the first forward to the pass's end."""

    def pre_forward(self, _module: nn.Module, _args) -> None:
        if self.kept and all(flat.gathered is not None for flat in self.flats):
            return  # gathered by this pass's first forward (no autograd in the pass: nothing saved refers to it)
        for flat in self.flats:
            flat.gathered = Gather.apply(flat.shard, flat)
            flat.attach(flat.gathered)
        if self.reshard and torch.is_grad_enabled():
            self.saved = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.saved.__enter__()

    def post_forward(self, _module: nn.Module, _args, _output) -> None:
        if self.saved is not None:
            self.saved.__exit__(None, None, None)
            self.saved = None
        if self.reshard and not self.kept:
            self.release()

    def release(self) -> None:
        for flat in self.flats:
            flat.detach()

    def pack(self, tensor: torch.Tensor):
        """A tensor autograd saves: a view of this unit's gathered parameters becomes (flat index, size, stride,
        offset), so the gathered vector can be freed after the forward."""
        for i, flat in enumerate(self.flats):
            if flat.gathered is not None and \
                    tensor.untyped_storage().data_ptr() == flat.gathered.untyped_storage().data_ptr():
                return i, tensor.size(), tensor.stride(), tensor.storage_offset()
        return tensor

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        i, size, stride, offset = packed
        flat = self.flats[i]
        if flat.regathered is None:
            # every rank's backward runs the same graph in the same order, so all reach this collective alike
            flat.regathered = flat.gather(flat.shard, flat.comm.dtype)
        return flat.regathered.as_strided(size, stride, offset)


class ManualZeRO3(Strategy):
    """ZeRO-3 by hand: flat parameters per unit, all-gather in forward and again in backward, reduce-scatter of
    gradients at accumulation boundaries, AdamW on the local shards."""

    SHARDINGS = ("FULL_SHARD",)
    LAYOUT = "is ZeRO-3 (FULL_SHARD)"
    CPU_OFFLOAD = False
    UNSUPPORTED = ("compile", "activation_checkpointing", "selective_checkpointing")
    PREFETCHED_LAYERS = 1  # no prefetch: only the layer in use is gathered
    mesh: DeviceMesh
    units: list[Unit]
    flats: list[FlatParam]

    def wrap(self, model: nn.Module) -> nn.Module:
        self.comm = Comm(self.dist.world_size, self.dist.rank, self.dtype)
        self.mesh = build_mesh("FULL_SHARD", self.dist)
        names = [name for name, _ in model.named_parameters()]  # tied weights once, under their first name
        self.order = {name: i for i, name in enumerate(names)}
        layers = decoder_layers(model)
        claimed: set[str] = set()
        self.units = []
        for layer in layers:
            unit = self._unit(model, layer, claimed, reshard=True)
            layer.register_forward_pre_hook(unit.pre_forward)
            layer.register_forward_hook(unit.post_forward)
        root = self._unit(model, model, claimed, reshard=False)
        model.register_forward_pre_hook(root.pre_forward)
        self.flats = [flat for unit in self.units for flat in unit.flats]
        model.to_empty(device=self.dist.device)  # the buffers; the parameters now live in the flats
        return model

    def _unit(self, model: nn.Module, scope: nn.Module, claimed: set[str], reshard: bool) -> Unit:
        """Take the parameters under scope not claimed by an earlier unit out of their modules into flats."""
        prefix = next(name for name, m in model.named_modules() if m is scope)
        slots: dict[bool, list[Slot]] = {True: [], False: []}
        by_param: dict[int, tuple[Slot, nn.Parameter]] = {}  # the parameter kept alive: its id stays unique
        for module_name, module in scope.named_modules(prefix=prefix, remove_duplicate=False):
            for attr, param in list(module.named_parameters(recurse=False)):
                name = f"{module_name}.{attr}" if module_name else attr
                if id(param) not in by_param:
                    if name in claimed:
                        continue
                    group = slots[param.ndim >= 2]
                    by_param[id(param)] = Slot(name, [], param.shape, sum(s.numel for s in group)), param
                    group.append(by_param[id(param)][0])
                    claimed.add(name)
                by_param[id(param)][0].owners.append((module, attr))
                del module._parameters[attr]  # from here on a plain attribute, set to a view while gathered
                setattr(module, attr, None)
        flats = [FlatParam(group, decay, self.comm, self.dist.device) for decay, group in slots.items() if group]
        unit = Unit(flats, reshard)
        self.units.append(unit)
        return unit

    # ---- the trainer's interface

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        self.comm.sync = enabled
        return contextlib.nullcontext()

    def release(self) -> None:
        for unit in self.units:
            unit.release()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        # each unit all-gathered at the pass's first forward and kept until it ends: one collective per unit per
        # generation instead of one per unit per token (the forwards run without autograd). What a training forward
        # left gathered (the root) is released first: it holds the weights from before the last update
        self.release()
        for unit in self.units:
            unit.kept = True
        try:
            yield
        finally:
            for unit in self.units:
                unit.kept = False
            self.release()

    def param_groups(self, weight_decay: float) -> list[dict]:
        return [{"params": [f.shard for f in self.flats if f.decay], "weight_decay": weight_decay},
                {"params": [f.shard for f in self.flats if not f.decay], "weight_decay": 0.0}]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grads = [f.shard.grad for f in self.flats if f.shard.grad is not None]
        squares = torch.zeros((), device=self.dist.device)
        for g in grads:
            squares += g.float().pow(2).sum()
        dist.all_reduce(squares)  # the shards are disjoint (padding is zero): their squares add up
        norm = squares.sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)
        return norm

    def comm_seconds(self) -> float | None:
        return self.comm.clock.read()

    # ---- weights and checkpoints, in FSDP2's layout

    def load_weights(self, model_dir) -> None:
        rows = read_weights(self.state_dict()["model"], model_dir, self.names)
        self._load_model(rows)

    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        self.release()
        model = {name: t for flat in self.flats for name, t in flat.rows(flat.shard, self.mesh).items()}
        # the persistent buffers, whole on every rank (Gemma 4's layer scalars, a router's score bias): in the weight
        # files, the checkpoints and the export, as the torch wrappers' state dicts hold them. What is left of the
        # module's own state dict once its parameters moved into the flats is exactly those.
        model.update(self.module.state_dict())
        if optimizer is None:
            return {"model": model}
        return {"model": model, "optim": self._optim_state(optimizer)}

    def _optim_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state as get_state_dict presents FSDP2's: per parameter name, row-sharded moments and
        the step; param_groups with names in place of parameters."""
        state: dict[str, dict] = {}
        for flat in self.flats:
            own = optimizer.state.get(flat.shard, {})
            step = own.get("step", torch.zeros((), device=self.dist.device))
            for key in ("exp_avg", "exp_avg_sq"):
                for name, rows in flat.rows(own.get(key, torch.zeros_like(flat.shard)), self.mesh).items():
                    state.setdefault(name, {"step": step.clone()})[key] = rows
        groups = []
        for group in optimizer.param_groups:
            shards = {id(p) for p in group["params"]}
            names = [s.name for f in self.flats if id(f.shard) in shards for s in f.slots]
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": sorted(names, key=self.order.__getitem__)})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        self._load_model(state["model"])
        if optimizer is None:
            return
        saved = state["optim"]
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        per_param = {}
        for flat in self.flats:
            moments = {key: flat.from_rows({s.name: saved["state"][s.name][key] for s in flat.slots})
                       for key in ("exp_avg", "exp_avg_sq")}
            per_param[index[id(flat.shard)]] = {"step": saved["state"][flat.slots[0].name]["step"], **moments}
        groups = [{**{k: v for k, v in old.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for old, g in zip(saved["param_groups"], optimizer.param_groups, strict=True)]
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})

    def _load_model(self, rows: dict[str, DTensor]) -> None:
        with torch.no_grad():
            for flat in self.flats:
                flat.shard.copy_(flat.from_rows(rows))
            for name, buffer in self.module.state_dict().items():  # the persistent buffers (state_dict)
                if name in rows:
                    buffer.copy_(rows[name])
