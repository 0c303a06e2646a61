"""Low-rank adapters (LoRA, DoRA, QLoRA) as a model transform: peft's layers injected into the meta model before it
is distributed, the base frozen in the compute dtype (QLoRA: the adapted layers' weights in NF4, pipeline/model/nf4.py),
the adapters in fp32.

peft owns the format vLLM, TGI and `PeftModel.from_pretrained` read, so its layers are used as they are, through
its public `inject_adapter_in_model` (the model keeps its class and its names, `q_proj.base_layer.weight` beside
`q_proj.lora_A.default.weight`): applied before sharding it trains under fully_shard and DDP alike (fully_shard
shards every adapter matrix by rows, as it shards the base weight). What peft cannot do on a sharded model is done
here by rows: initialising the adapters after to_empty, and merging them into the base without gathering a weight
(B's rows and a DoRA magnitude's are sharded like the base weight's, and A is r x in: small); and, for QLoRA,
filling each rank's rows of the NF4 weights.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from pipeline.config import ModelConfig
from pipeline.errors import UserError
from pipeline.model import nf4
from pipeline.model.modeling import decoder_layers, fused_experts, plain_named_parameters
from pipeline.model.transforms import ModelTransform

ADAPTER_NAME = "default"
"""peft's name for the one adapter a model carries (`lora_A.default.weight`); its files leave it out."""
LORA_KEY = re.compile(rf"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_magnitude_vector)\.{ADAPTER_NAME}\.weight$")
BASE_LAYER = ".base_layer"
"""What peft inserts into the name of a wrapped layer's own parameters (q_proj.base_layer.weight)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What PEFT's save_pretrained writes for an adapter (and an adapter export here): its config, its tensors."""
PEFT_PREFIX = "base_model.model."
"""The prefix PeftModel gives every key of adapter_model.safetensors."""


PEFT_FILE_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_magnitude_vector)(\.weight)?$")
"""A tensor's name in adapter_model.safetensors less PEFT_PREFIX (adapter_state's names): `<module>.lora_A.weight`,
DoRA's magnitude without `.weight`."""


def model_key_of(file_key: str) -> str | None:
    """The name in the model with the adapter injected of a tensor of adapter_model.safetensors (the inverse of
    adapter_state's naming); None for a tensor that is not a LoRA or DoRA one."""
    found = PEFT_FILE_KEY.match(file_key.removeprefix(PEFT_PREFIX))
    if not file_key.startswith(PEFT_PREFIX) or found is None:
        return None
    return f"{found['module']}.{found['part']}.{ADAPTER_NAME}.weight"


def plain_key(name: str) -> str:
    """A parameter's name in the model without adapters (q_proj.base_layer.weight -> q_proj.weight): the name a
    weight folder and an export use; peft nests a wrapper per adapted weight of a fused experts module, so
    experts.base_layer.base_layer.down_proj -> experts.down_proj)."""
    return re.sub(rf"(?:{re.escape(BASE_LAYER)})+\.", ".", name)


def is_adapter_key(name: str) -> bool:
    return LORA_KEY.match(name) is not None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or state-dict tensor (a DTensor's local shard, else the tensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_router(module: nn.Linear, config) -> bool:
    """Whether a linear layer is a mixture of experts' router (one output per expert): it picks experts, and an
    adapter there would change the routing, not the experts."""
    text = config.get_text_config()
    experts = (getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
               or getattr(text, "n_routed_experts", None))
    return bool(experts) and module.out_features == experts


def default_targets(model: nn.Module) -> list[str]:
    """The leaf names of every linear layer in the decoder blocks (q_proj, ..., down_proj), a mixture of experts'
    router left out, and those peft would put on the fused experts instead (retargeted_by_peft)."""
    names = linear_names(model)
    return sorted(names - retargeted_by_peft(model, names))


def linear_names(model: nn.Module) -> set[str]:
    """The leaf names of the decoder blocks' linear layers, a mixture of experts' router left out."""
    return {name.rsplit(".", 1)[-1] for layer in decoder_layers(model) for name, m in layer.named_modules()
            if isinstance(m, nn.Linear) and not is_router(m, model.config)}


def expert_parameters(model: nn.Module) -> list[str]:
    """The leaf names of a mixture of experts' fused routed-expert weights in the decoder blocks (gate_up_proj,
    down_proj: [experts, ...], transformers 5's layout), found by shape and place rather than by family: the 3-D
    parameters of the routed experts' module (a linear attention's 3-D convolution is not one). Empty for a dense
    model."""
    return sorted({leaf for *_, m in fused_experts(model) for leaf, p in m.named_parameters(recurse=False)
                   if p.ndim == 3})


def experts_blocked(cfg: ModelConfig) -> str:
    """Why peft cannot adapt fused experts with these settings ("" when it can): its LoRA on a parameter
    (ParamWrapper) refuses DoRA and dropout."""
    if cfg.adapter == "dora":
        return "--adapter dora: peft's LoRA on fused expert weights has no DoRA; use --adapter lora to adapt them"
    if cfg.lora_dropout:
        return (f"--lora-dropout {cfg.lora_dropout:g}: peft's LoRA on fused expert weights takes no dropout; use "
                "--lora-dropout 0 to adapt them")
    return ""


EXPERTS_PREFIX = "experts."
"""In --lora-targets, names a fused expert weight alone (experts.down_proj), where a linear layer has the same leaf
name (a shared expert's down_proj): how an adapter folder's target_parameters are rebuilt."""


@dataclass(frozen=True)
class Targets:
    """What --lora-targets resolves to on one model."""

    modules: list[str]
    """Leaf names of the linear layers adapted (peft's target_modules)."""
    parameters: list[str]
    """Leaf names of the fused expert weights adapted (peft's target_parameters)."""
    frozen_experts: str = ""
    """Why a mixture of experts' routed experts are all left frozen ("" when adapted, or for a dense model)."""


def retargeted_by_peft(model: nn.Module, names: set[str]) -> set[str]:
    """The target names peft does not apply to the linear layers so named: for a family whose experts transformers 5
    fused (DeepSeek-V3, GLM-4-MoE), peft reads gate_proj, up_proj and down_proj as transformers 4's per-expert layers
    and moves them to the fused experts' parameters (its convert_peft_config_for_transformers), also away from the
    dense layers and shared experts that really are named so. Adapters on fused parameters are named by their own
    names here (gate_up_proj, down_proj: expert_parameters), so those linear names are left out (by default) or
    refused (named)."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    probe = LoraConfig(r=1, target_modules=sorted(names))
    convert_peft_config_for_transformers(probe, model, None)
    return set(names) - set(probe.target_modules or ())


def chosen_targets(model: nn.Module, cfg: ModelConfig) -> Targets:
    """--lora-targets resolved: the default (every linear layer of the decoder blocks and, on a mixture of experts,
    the routed experts' fused weights), or the names given, each of which must name a linear layer of the decoder
    blocks or a fused expert weight (one line listing those that do). A name that is both (down_proj of a shared
    expert and of the routed ones) adapts both."""
    available, experts = default_targets(model), expert_parameters(model)
    blocked = experts_blocked(cfg) if experts else ""
    if not cfg.lora_targets:
        return Targets(available, [] if blocked else experts, blocked)
    named = {t.strip() for t in cfg.lora_targets.split(",")}
    wanted = sorted({t.removeprefix(EXPERTS_PREFIX) for t in named})
    linear = {name for layer in decoder_layers(model) for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    is_linear = {t: t in named and any(n == t or n.endswith("." + t) for n in linear) for t in wanted}
    if missing := [t for t in wanted if not is_linear[t] and t not in experts]:
        raise UserError(f"--lora-targets {', '.join(missing)}: no linear layer of {type(model).__name__}'s decoder "
                        f"blocks is named so; its linear layers are {', '.join(available)}"
                        + (f", its fused expert weights {', '.join(experts)}" if experts else ""))
    modules = [t for t in wanted if is_linear[t]]
    if moved := sorted(retargeted_by_peft(model, set(modules))):
        raise UserError(f"--lora-targets {', '.join(moved)}: for {model.config.model_type} peft puts these on the "
                        "fused experts' parameters instead of the layers so named, which this pipeline does not train; "
                        f"name others of {', '.join(available)}" + (f" (the experts: {', '.join(experts)})"
                                                                     if experts else ""))
    parameters = [t for t in wanted if t in experts]
    if blocked and (only := [t for t in parameters if not is_linear[t]]):
        raise UserError(f"--lora-targets {', '.join(only)}: {blocked}")
    if blocked:
        return Targets(modules, [], blocked)
    frozen = "" if parameters or not experts else (f"--lora-targets {cfg.lora_targets} names none of the fused "
                                                   f"expert weights ({', '.join(experts)}); add them to adapt them")
    return Targets(modules, parameters, frozen)


class LowRankAdapter(ModelTransform):
    """LoRA (or DoRA) on the chosen linear layers; everything else frozen in the compute dtype."""

    name = "adapter"
    freezes_base = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        self.scaling = cfg.lora_alpha / cfg.lora_rank
        self.peft_config = None
        """peft's LoraConfig as injected (target_modules as the leaf names)."""
        self.quantized: set[str] = set()
        """QLoRA: the state-dict names of the base weights held in NF4."""
        self.experts: dict[str, ExpertAdapter] = {}
        """The adapted fused expert weights: state-dict name of the base weight -> its adapter."""
        self.frozen_experts = ""
        """Why a mixture of experts' routed experts are all left frozen ("" when they are adapted, or none exist)."""
        self.warned = False

    def apply(self, model: nn.Module) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        targets = chosen_targets(model, self.cfg)
        self.frozen_experts = targets.frozen_experts
        # peft refuses target_modules=[] beside target_parameters: None there means "no linear layer"
        self.peft_config = LoraConfig(r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha,
                                      lora_dropout=self.cfg.lora_dropout, use_dora=self.cfg.adapter == "dora",
                                      target_modules=targets.modules or None,
                                      target_parameters=targets.parameters or None, bias="none",
                                      task_type="CAUSAL_LM")
        inject_adapter_in_model(self.peft_config, model, adapter_name=ADAPTER_NAME)
        self.experts = expert_adapters(model)
        self._freeze_base(model)
        if self.cfg.adapter == "qlora":
            self._quantize_base(model)

    def _freeze_base(self, model: nn.Module) -> None:
        """Every parameter but the adapters' frozen, in the compute dtype: no gradient, no optimizer state, no fp32
        master copy. A tied weight is one parameter under two modules: converted once, set in both."""
        adapters = {id(p) for name, p in model.named_parameters() if is_adapter_key(name)}
        converted: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for leaf, param in list(module._parameters.items()):
                if param is None or id(param) in adapters:
                    continue
                if id(param) not in converted:
                    converted[id(param)] = nn.Parameter(param.detach().to(self.dtype), requires_grad=False)
                module._parameters[leaf] = converted[id(param)]

    def _quantize_base(self, model: nn.Module) -> None:
        """QLoRA: the adapted layers' base weights in NF4 on the meta device (pipeline/model/nf4.py); every other
        weight (embedding, head, norms, layers without an adapter) stays in the compute dtype."""
        for name, module in model.named_modules():
            if name.endswith(BASE_LAYER) and isinstance(module, nn.Linear):
                module.weight = nn.Parameter(nf4.quantized_meta(module.weight), requires_grad=False)
                self.quantized.add(f"{name}.weight")

    def held_back(self) -> set[str]:
        return set(self.quantized)

    def warnings(self) -> list[str]:
        if self.warned:
            return []
        self.warned = True
        if self.frozen_experts:
            return [f"every routed expert stays frozen (only attention and dense layers train): {self.frozen_experts}"]
        if self.cfg.adapter == "qlora" and self.experts:  # torchao's NF4 linear is for 2-D weights
            return ["--adapter qlora: the fused expert weights stay in the compute dtype, not NF4 (NF4 holds the "
                    "linear layers' weights); their adapters train as LoRA's"]
        return []

    def load_base(self, model: nn.Module, read: Callable[[dict], None]) -> None:
        """QLoRA: each adapted layer's base weight read by rows into a compute-dtype buffer and quantized into its
        NF4 parameter, one decoder layer at a time (the whole base never stands in bf16). A collective: the same
        reads and gathers on every rank, in the same order."""
        if not self.quantized:
            return
        params = dict(plain_named_parameters(model))
        for _, group in itertools.groupby(sorted(self.quantized, key=layer_order), key=lambda k: layer_order(k)[0]):
            keys = list(group)
            staging = {key: staging_like(params[key], self.dtype) for key in keys}
            read(staging)
            for key in keys:
                nf4.fill(params[key], local(staging[key]))

    def base_name(self, name: str) -> str | None:
        return None if is_adapter_key(name) else plain_key(name)

    # ---- after the base weights are loaded: the adapters' initial values, as peft gives them

    def after_base_weights(self, model: nn.Module) -> None:
        """Initialise the adapters of the distributed model, as peft does: A Kaiming-uniform (from a generator
        seeded with torch's seed, so every rank and every strategy draws the same matrix), B zero (so the model
        starts as the base), a DoRA magnitude the norm of each row of the base weight. Each rank writes only its
        own rows; no collective."""
        sd = get_model_state_dict(model)  # this rank's shards, sharing storage with the parameters
        generator = torch.Generator().manual_seed(torch.initial_seed())
        with torch.no_grad():
            for key in sorted(sd):
                found = LORA_KEY.match(key)
                if found is None:
                    continue
                target = local(sd[key])
                if found["part"] == "lora_B":
                    target.zero_()
                elif found["part"] == "lora_A":
                    full = torch.empty(sd[key].shape, dtype=torch.float32)
                    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
                    target.copy_(self._my_rows(full, sd[key]))
                else:
                    base = local(sd[f"{found['module']}{BASE_LAYER}.weight"]).float()
                    target.copy_(torch.linalg.norm(base, dim=1))

    @staticmethod
    def _my_rows(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The part of full this rank holds of a tensor laid out like `like` (no communication: src_data_rank None
        slices the local copy)."""
        if not isinstance(like, DTensor):
            return full
        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()

    # ---- export

    def export_state(self, state: dict) -> dict:
        """The model's state dict (this rank's shards) with every adapter merged into its base weight, under the
        names of the model without adapters. Row by row: W + scaling x B @ A (DoRA: each row then rescaled to its
        magnitude), with A gathered whole (r x in, one all-gather per adapted layer on every rank, in the same
        order) and W, B and the magnitude as sharded."""
        merged = {}
        for key in sorted(state):
            if is_adapter_key(key):
                continue
            module = key.removesuffix(f"{BASE_LAYER}.weight")
            if key in self.experts:
                merged[plain_key(key)] = self._merged_experts(state, key)
            elif module == key or f"{module}.lora_A.{ADAPTER_NAME}.weight" not in state:
                merged[plain_key(key)] = state[key]
            else:
                merged[plain_key(key)] = self._merged(state, module)
        return merged

    def _merged_experts(self, state: dict, key: str) -> torch.Tensor:
        """A fused expert weight with its adapter merged, this rank's experts only: per expert e, W_e + scaling x
        the product of its rank-r slices of B and A (as peft's ParamWrapper computes it), with A and B gathered whole
        (r x experts rows: small; one all-gather each on every rank, in the same order) and W as sharded by experts."""
        adapter, weight = self.experts[key], state[key]
        a, b = (state[f"{adapter.module}.{part}.{ADAPTER_NAME}.weight"] for part in ("lora_A", "lora_B"))
        a, b = ((t.full_tensor() if isinstance(t, DTensor) else t).float() for t in (a, b))  # collectives
        n = weight.shape[0]
        mine = self._my_rows(torch.arange(n), weight) if isinstance(weight, DTensor) else torch.arange(n)
        delta = experts_delta(a, b, n, mine, self.scaling, adapter.out_first)
        rows = local(weight).float() + delta.to(local(weight).device)
        if isinstance(weight, DTensor):
            return DTensor.from_local(rows, weight.device_mesh, weight.placements, run_check=False,
                                      shape=weight.shape, stride=weight.stride())
        return rows

    def _merged(self, state: dict, module: str) -> torch.Tensor:
        weight = state[f"{module}{BASE_LAYER}.weight"]
        a = state[f"{module}.lora_A.{ADAPTER_NAME}.weight"]
        a = (a.full_tensor() if isinstance(a, DTensor) else a).float()  # a collective under fully_shard
        base = nf4.dequantized(weight) if f"{module}{BASE_LAYER}.weight" in self.quantized else local(weight)
        b = local(state[f"{module}.lora_B.{ADAPTER_NAME}.weight"]).float()
        rows = base.float() + self.scaling * (b @ a.to(base.device))
        magnitude = state.get(f"{module}.lora_magnitude_vector.{ADAPTER_NAME}.weight")
        if magnitude is not None:
            rows = rows * (local(magnitude).float() / torch.linalg.norm(rows, dim=1))[:, None]
        if isinstance(weight, DTensor):
            return DTensor.from_local(rows, weight.device_mesh, weight.placements, run_check=False,
                                      shape=weight.shape, stride=weight.stride())
        return rows

    def adapter_state(self, model: nn.Module, module: nn.Module, saved: frozenset[str] = frozenset()) -> dict:
        """The adapter as PeftModel.save_pretrained writes it (`base_model.model.<path>.lora_A.weight`, every tensor
        whole and 2-D, DoRA's magnitude 1-D as peft keeps it), on rank 0 only (empty elsewhere), with the parameters
        named in saved whole under their own names (a reward model's score: peft's modules_to_save). A collective:
        the trainable parameters are gathered whole, one tensor at a time, into rank 0's host memory. module: the
        unwrapped model."""
        from peft import get_peft_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        trainable = get_model_state_dict(model, options=options)
        full = {k: v for k, v in trainable.items() if is_adapter_key(k)}
        if not full:
            return {}
        peft_sd = get_peft_model_state_dict(module, state_dict=full, adapter_name=ADAPTER_NAME)
        others = {k: v for k, v in trainable.items() if k in saved}
        return {PEFT_PREFIX + k: v.contiguous() for k, v in {**peft_sd, **others}.items()}


@dataclass(frozen=True)
class ExpertAdapter:
    """peft's LoRA on one fused expert weight (its ParamWrapper): A is (experts x r) x in, B out x (r x experts)."""

    module: str
    """The wrapper's name in the model (its lora_A and lora_B live under it)."""
    out_first: bool
    """peft reads the weight as experts x out x in (False: experts x in x out, where transformers' experts module
    says is_transposed)."""


def experts_delta(a: torch.Tensor, b: torch.Tensor, experts: int, which: torch.Tensor, scaling: float,
                  out_first: bool) -> torch.Tensor:
    """scaling x B_e A_e for the experts `which` of peft's LoRA on a fused expert weight (A: (experts x r) x in, expert
    by expert; B: out x (r x experts), the expert the fastest index), laid out as the weight: experts x out x in where
    peft reads it out first, else experts x in x out."""
    a = a.reshape(experts, -1, a.shape[-1])[which]  # experts x r x in
    b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)[which]  # experts x out x r
    delta = scaling * torch.bmm(b, a)
    return delta if out_first else delta.transpose(1, 2)


def wrapper_delta(wrapper: nn.Module, which: torch.Tensor, out_first: bool) -> torch.Tensor | None:
    """The update peft's LoRA wrapper (its ParamWrapper) adds to the experts `which` of the fused weight it wraps, as
    it computes it in its forward; None while its adapters are off (adapters_disabled: a reference pass)."""
    if wrapper.disable_adapters or ADAPTER_NAME not in wrapper.lora_A:
        return None
    return experts_delta(wrapper.lora_A[ADAPTER_NAME].weight, wrapper.lora_B[ADAPTER_NAME].weight,
                         wrapper.num_experts, which, wrapper.scaling[ADAPTER_NAME], out_first)


def expert_adapters(model: nn.Module) -> dict[str, ExpertAdapter]:
    """Every fused expert weight peft adapted, by its state-dict name (`mlp.experts.base_layer.base_layer.down_proj`:
    peft nests one wrapper per adapted weight of a module)."""
    from peft.tuners.lora.layer import ParamWrapper

    names = {id(m): name for name, m in model.named_modules()}
    # peft reads a 3-D weight as experts x out x in unless the experts module says `is_transposed` (transformers'
    # flag); Llama 4's experts x in x out weight lacks the flag, and peft's factors then span its transpose, which
    # is still a rank-r update of every expert: the merge follows peft's reading, whatever the family's layout
    return {f"{names[id(m.get_base_layer())]}.{m.parameter_name}":
            ExpertAdapter(name, not getattr(m.get_base_layer(), "is_transposed", False))
            for name, m in model.named_modules() if isinstance(m, ParamWrapper)}


def layer_order(key: str) -> tuple[int, str]:
    """Sorts state-dict names by decoder layer (the index after `.layers.`), then by name."""
    found = re.search(r"\.layers\.(\d+)\.", key)
    return (int(found[1]) if found else -1, key)


def staging_like(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised plain tensor of param's shape in dtype, laid out as param (a DTensor with its mesh and
    placements, holding this rank's rows), for the weight reader to fill."""
    if not isinstance(param, DTensor):
        return torch.empty(param.shape, dtype=dtype, device=param.device)
    rows = torch.empty(param.to_local().shape, dtype=dtype, device=param.device)
    return DTensor.from_local(rows, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model without its adapters: the base it was built on (a preference objective's reference). peft's own
    switch, which also stops the adapters' gradients while off: called under no_grad, and restored before the
    backward."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_transform(cfg: ModelConfig, dtype: torch.dtype) -> LowRankAdapter | None:
    """The adapter --adapter asks for, or None for full fine-tuning."""
    return None if cfg.adapter == "none" else LowRankAdapter(cfg, dtype)
