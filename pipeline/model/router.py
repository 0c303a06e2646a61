"""A mixture of experts' router, balanced and watched: the auxiliary load-balancing loss transformers defines for the
family (its modeling module's `load_balancing_loss_func`, as its causal LM's forward adds it), added to whatever the
objective computes, and each log window's expert load per layer (tokens per expert: the busiest expert against the
mean, and the experts that got none), with a warning when one expert takes nearly every token of a layer.

A model transform (pipeline/model/transforms.py): forward hooks put on the meta model before it is distributed,
found by what transformers declares rather than by family: the router is the module class the model records
`router_logits` from, and the routing a token took is the index argument transformers 5's fused experts module
takes (`experts(hidden_states, top_k_index, top_k_weights)`, in 68 of the 73 experts modules it ships). The hooks
record only while armed (the trainer's forward of a step, with gradients on): validation, generation, a reference
pass under no_grad and the recomputation of a checkpointed layer in the backward record nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import ModelConfig
from pipeline.errors import UserError
from pipeline.model.modeling import decoder_layers, fused_experts, moe_shape, routing_arguments, trunk
from pipeline.model.transforms import ModelTransform

COLLAPSED_SHARE = 0.9
"""A layer's busiest expert chosen by at least this share of a window's tokens is a collapse (one warning)."""


def router_recorder(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """(router class, index of the logits in its output) as the model declares them for its `router_logits` output,
    or None. `_can_record_outputs` is transformers' private table of what its output-capturing hooks record; the one
    place that names a family's router without a list of ours (tests/test_router.py checks it is still there)."""
    recorders = getattr(type(model), "_can_record_outputs", None) or {}
    found = recorders.get("router_logits")
    if isinstance(found, list | tuple):  # JetMoE records several; the router is the one whose name says so
        found = next((r for r in found if "Router" in getattr(r.target_class, "__name__", "")), None)
    target = getattr(found, "target_class", None)
    return (target, int(getattr(found, "index", 0) or 0)) if isinstance(target, type) else None


def aux_loss_function(model: nn.Module) -> Callable | None:
    """The family's own load-balancing loss (its modeling module's load_balancing_loss_func), or None where
    transformers defines none (DeepSeek-V3, GLM-4-MoE: routers balanced by a bias instead)."""
    return getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)


def config_coef(config) -> float:
    """The load-balancing coefficient the model config itself trains with: its router_aux_loss_coef where its
    output_router_logits is set (transformers' forward then adds the term), else 0."""
    text = config.get_text_config()
    return float(getattr(text, "router_aux_loss_coef", 0) or 0) if getattr(text, "output_router_logits", False) \
        else 0.0


def balancing_coef(cfg: ModelConfig, config) -> float:
    """What the training loss scales the family's load-balancing loss by: --router-aux-loss-coef, or where it is -1
    the model config's own (config_coef); 0 for a dense model."""
    if not moe_shape(config)[0]:
        return 0.0
    return config_coef(config) if cfg.router_aux_loss_coef < 0 else cfg.router_aux_loss_coef


def without_router_logits(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: output_router_logits=False unless the caller passed it."""
    return args, {"output_router_logits": False, **kwargs}


class RouterBalance(ModelTransform):
    """The auxiliary loss and the expert load of a mixture of experts; nothing on a dense model."""

    name = "router"

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.experts = self.top_k = 0
        self.coef = 0.0
        """What the auxiliary loss is scaled by in the training loss (0: logged only)."""
        self.aux_fn: Callable | None = None
        self.armed = False
        self.logits: list[torch.Tensor] = []
        """The router logits of the forward now armed, layer by layer (with their graph)."""
        self.counts: dict[int, torch.Tensor] = {}
        """Tokens routed to each expert over the window, by decoder layer (this rank's)."""
        self.tokens: dict[int, int] = {}
        self.aux = torch.zeros(2, dtype=torch.float64)
        """The window's sum of auxiliary losses and the count of forwards they came from (this rank's)."""
        self.notes: list[str] = []
        self.collapsed: set[int] = set()

    def apply(self, model: nn.Module) -> None:
        self.experts, self.top_k = moe_shape(model.config)
        if not self.experts:
            if self.cfg.router_aux_loss_coef > 0:
                raise UserError(f"--router-aux-loss-coef {self.cfg.router_aux_loss_coef:g}: "
                                f"{model.config.model_type} is not a mixture of experts")
            return
        self.aux_fn = aux_loss_function(model)
        recorder = router_recorder(model)
        own = config_coef(model.config)
        self.coef = balancing_coef(self.cfg, model.config)
        if self.coef and (self.aux_fn is None or recorder is None):
            raise UserError(f"--router-aux-loss-coef {self.coef:g}: transformers defines no auxiliary load-balancing "
                            f"loss for {model.config.model_type} (its routers are balanced otherwise); leave it out")
        if own:
            # the transform adds the term itself: the causal LM's forward, which reads output_router_logits from the
            # config, would add it a second time into the loss it returns (the config itself is left as it is, for
            # the export)
            for module in {model, trunk(model)}:
                module.register_forward_pre_hook(without_router_logits, with_kwargs=True)
        watched = self._hook(model, recorder)
        if not watched:
            self.notes.append(f"expert load figures: {model.config.model_type}'s experts take no routing indices, "
                              "so no per-expert load is logged")

    def _hook(self, model: nn.Module, recorder: tuple[type[nn.Module], int] | None) -> int:
        """Hooks on every layer's router (its logits, for the loss) and experts (the routing, for the load); the
        count of layers whose load is watched."""
        if recorder and self.aux_fn:
            for module in decoder_layers(model).modules():
                if isinstance(module, recorder[0]):
                    module.register_forward_hook(functools.partial(self._on_router, recorder[1]))
        watched = 0
        for i, _, _, module in fused_experts(model):
            if where := routing_arguments(module):
                module.register_forward_pre_hook(functools.partial(self._on_experts, i, where[0]), with_kwargs=True)
                watched += 1
        return watched

    def _recording(self) -> bool:
        return self.armed and torch.is_grad_enabled()

    def _on_router(self, index: int, module: nn.Module, args, output) -> None:
        if self._recording():
            logits = output[index] if isinstance(output, tuple | list) else output
            self.logits.append(logits.reshape(-1, logits.shape[-1]))

    def _on_experts(self, layer: int, name: str, module: nn.Module, args, kwargs) -> None:
        if not self._recording():
            return
        routing = kwargs[name] if name in kwargs else args[1]  # positional as transformers' blocks pass it
        counts = torch.bincount(routing.detach().reshape(-1), minlength=self.experts)[: self.experts].double()
        if layer in self.counts:
            self.counts[layer] += counts
        else:
            self.counts[layer] = counts
        self.tokens[layer] = self.tokens.get(layer, 0) + routing.shape[0]

    # ---- what the trainer asks

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.armed, self.logits = bool(self.experts), []
        try:
            yield
        finally:
            self.armed = False

    def auxiliary_loss(self) -> torch.Tensor | None:
        """coef x the family's load-balancing loss over the forward just recorded (this rank's tokens, as transformers
        computes it per device), or None; the unscaled value joins the window's aux_loss."""
        logits, self.logits = self.logits, []
        if not logits or self.aux_fn is None:
            return None
        with contextlib.nullcontext() if self.coef else torch.no_grad():  # only logged: no graph to keep
            aux = self.aux_fn(tuple(logits), self.experts, self.top_k, None)
        self.aux = self.aux.to(aux.device) + torch.stack([aux.detach().double(), aux.new_ones((), dtype=torch.float64)])
        return self.coef * aux if self.coef else None

    def read_metrics(self, reduce: bool) -> dict:
        """The window's aux_loss (mean over forwards and ranks) and expert load per layer (max/mean of tokens per
        expert, experts that got none), then reset. reduce: summed over every rank first (a collective: every rank
        calls it, MoE runs only)."""
        if not self.experts:
            return {}
        layers = sorted(self.counts)
        device = self.aux.device
        packed = torch.cat([self.aux, *(self.counts[i].to(device) for i in layers),
                            torch.tensor([float(self.tokens[i]) for i in layers], dtype=torch.float64, device=device)])
        if reduce and dist.is_initialized():
            dist.all_reduce(packed)  # SUM; the same layers on every rank (each ran every layer's forward)
        packed = packed.cpu()
        self.aux, self.counts, self.tokens = torch.zeros(2, dtype=torch.float64, device=device), {}, {}
        out = {}
        if packed[1] > 0:
            out["aux_loss"] = float(packed[0] / packed[1])
        counts = packed[2: 2 + len(layers) * self.experts].reshape(len(layers), self.experts)
        tokens = packed[2 + len(layers) * self.experts:]
        if layers:
            mean = counts.mean(dim=1).clamp_min(1e-12)
            out["expert_load"] = {
                "max_over_mean": {str(i): round(float(m), 4) for i, m in zip(layers, counts.max(dim=1).values / mean,
                                                                             strict=True)},
                "idle": {str(i): int((c == 0).sum()) for i, c in zip(layers, counts, strict=True)}}
            self._collapse(layers, counts, tokens)
        return out

    def _collapse(self, layers: list[int], counts: torch.Tensor, tokens: torch.Tensor) -> None:
        new = [(i, int(c.argmax()), float(c.max() / t)) for i, c, t in zip(layers, counts, tokens, strict=True)
               if t > 0 and c.max() / t >= COLLAPSED_SHARE and i not in self.collapsed]
        if new:
            self.collapsed.update(i for i, _, _ in new)
            self.notes.append("router collapse: " + "; ".join(
                f"layer {i}'s expert {e} took {math.floor(share * 100)}% of the window's tokens" for i, e, share in new)
                + " (expert_load in metrics.jsonl; a higher --router-aux-loss-coef or a lower --lr may help)")

    def warnings(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes


def router_transform(cfg: ModelConfig, dtype: torch.dtype) -> RouterBalance:
    """Every run's: it finds out at apply whether the model is a mixture of experts (nothing otherwise)."""
    return RouterBalance(cfg)
