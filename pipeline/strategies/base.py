"""The interface every way of distributing the model implements; the trainer, checkpointer and exporter call
only this.

A strategy owns the model once built: how it is wrapped and sharded, what gradient accumulation and clipping need,
and the state-dict calls DCP saves and loads through. Fully qualified names in its state dicts are those of the
plain Hugging Face model (tied aliases left out), so every strategy reads and writes the same checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from pipeline.config import Config, ModelConfig
from pipeline.data.batches import Batch
from pipeline.distributed.runtime import Dist
from pipeline.model.checkpointing import checkpoint_kwargs
from pipeline.model.head import Head
from pipeline.model.modeling import (
    compute_buffers,
    decoder_layers,
    expert_counts,
    meta_model,
    param_counts,
    plain_name,
    tied_keys,
)
from pipeline.model.naming import WeightNames
from pipeline.model.transforms import ModelTransform
from pipeline.model.weights import load_weights, read_weights
from pipeline.strategies.memory import Shape, Workload
from pipeline.strategies.sequence_parallel import SequenceParallel
from pipeline.strategies.traffic import replicated_bytes, sharded_bytes


class Strategy(ABC):
    """One way of spreading a model, its gradients and its optimizer state over the ranks.

    Besides the runtime interface, a strategy states its facts as class attributes and class methods, read before
    any model exists: the config it accepts (registry.check), its memory terms (memory.estimate), the bytes it moves
    per step (auto's choice) and its out-of-memory hints. A new strategy is one subclass plus its line in
    registry.STRATEGIES.
    """

    KNOBS: frozenset[str] = frozenset()
    """The FSDP1 knobs (config keys) this strategy applies; the others have no effect under it."""
    SHARDINGS: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
    """The --sharding values it runs."""
    DEFAULT_SHARDING = "FULL_SHARD"
    """What --sharding auto resolves to under it."""
    LAYOUT = ""
    """What it is, for a refusal of another --sharding ("replicates the whole model on every rank")."""
    CPU_OFFLOAD = True
    """Whether it runs --cpu-offload."""
    VOCAB_PARALLEL = False
    """Whether it runs the vocabulary-parallel embedding and head."""
    UNSUPPORTED: tuple[str, ...] = ()
    """Boolean config keys it refuses when on."""
    PREFETCHED_LAYERS = 2
    """Gathered decoder layers at the forward's peak under FULL_SHARD: the one in use and the one prefetched."""
    ADAPTERS = False
    """Whether it trains --adapter lora/dora/qlora (a frozen base beside trainable adapters in one wrapped unit)."""
    SEQUENCE_PARALLEL = False
    """Whether it runs --sequence-parallel: gradients averaged over every rank, each rank's loss its own positions'
    share (pipeline/strategies/sequence_parallel.py)."""
    REPLICATES = False
    """Whether every rank holds every weight whole, as a plain tensor (export_state the same on every rank): the
    export then writes rank 0's own tensors, without DCP's per-rank files."""

    def __init__(self, cfg: ModelConfig, d: Dist, dtype: torch.dtype, transforms: Sequence[ModelTransform] = ()):
        self.cfg, self.dist, self.dtype = cfg, d, dtype
        self.transforms = list(transforms)
        """Applied to the meta model in build(), before checkpointing, compile and the wrap."""
        self._model: nn.Module | None = None
        self.module: nn.Module | None = None
        """The plain Hugging Face model inside whatever wrapper (config, embeddings, structure)."""
        self.tied: dict[str, str] = {}
        """{lm_head key: embedding key} when the model ties them (modeling.tied_keys)."""
        self.names: WeightNames | None = None
        """How the model's tensors are named in a weight folder (tied weights under either name, per-expert MoE
        tensors): naming.WeightNames, read from the unwrapped model."""
        self.num_params = self.num_matmul_params = self.num_trainable = 0
        self.num_expert_params = self.num_trainable_experts = 0
        self.shapes: dict[str, torch.Size] = {}
        """Every parameter's name and shape in the unwrapped model (tied weights once)."""
        self.buffers: dict[str, torch.Tensor] = {}
        """Every buffer's value (CPU) as transformers initialises it, by its name in the unwrapped model."""
        self.sequence: SequenceParallel | None = None
        """--sequence-parallel: this rank's group and the attention split over it (None: off)."""

    # ---- facts, read from the config before any model exists

    @classmethod  # noqa: B027 (most strategies have no refusals of their own)
    def check(cls, cfg: Config) -> None:
        """Refusals of this strategy's own beyond the facts above (registry.check applies those): UserError."""

    @classmethod
    def uses_vocab_parallel(cls, m: ModelConfig) -> bool:
        """--vocab-parallel resolved for this strategy."""
        return False

    @classmethod
    def honoured_knobs(cls, m: ModelConfig) -> frozenset[str]:
        """The FSDP1 knobs that take effect under this config."""
        return cls.KNOBS

    @classmethod
    def shards(cls, work: Workload) -> int:
        """Ranks each parameter is split over."""
        return work.shard_ranks

    @classmethod
    def gradient_bytes(cls, shape: Shape, work: Workload) -> int:
        """A layer's compute-dtype gradient and its fp32 copy on their way to the reduce-scatter, and the whole
        unsharded fp32 gradients kept between the micro-steps of gradient accumulation (no_sync)."""
        accumulated = 4 * shape.num_params if work.grad_accum > 1 else 0
        # expert parallelism: a layer's experts' gradients are this rank's own, never reduce-scattered
        layer = shape.layer_params - (shape.layer_experts if shape.split_experts(work) > 1 else 0)
        return layer * (work.compute_bytes + 4) + accumulated

    @classmethod
    def copy_bytes(cls, shape: Shape, work: Workload) -> int:
        """The gathered compute-dtype units alive at the forward's peak."""
        c = work.compute_bytes
        if cls.shards(work) == 1:  # replicating: every unit already whole, cast to the compute dtype when it differs
            return shape.num_params * c if c < 4 else 0
        root = 0 if work.vocab_parallel else shape.root_params  # the root stays gathered
        # expert parallelism: a layer's routed experts are never gathered
        layer = shape.layer_params - (shape.layer_experts if shape.split_experts(work) > 1 else 0)
        return (root + cls.gathered_layers(shape, work) * layer) * c

    @classmethod
    def gathered_layers(cls, shape: Shape, work: Workload) -> int:
        """Decoder layers gathered whole at the forward's peak: every one under SHARD_GRAD_OP (ZeRO-2: kept from
        its forward to its backward), else the one in use and those prefetched."""
        return shape.layers if work.sharding == "SHARD_GRAD_OP" else min(cls.PREFETCHED_LAYERS, shape.layers)

    @classmethod
    def traffic_bytes(cls, shape: Shape, work: Workload) -> int:
        """Bytes this rank sends per optimizer step (it receives as many)."""
        if work.world_size == 1:
            return 0
        return replicated_bytes(shape, work) if work.sharding == "NO_SHARD" else sharded_bytes(shape, work)

    @classmethod
    def memory_hints(cls, m: ModelConfig) -> list[str]:
        """What to change under this strategy when a step does not fit (besides batch and checkpointing)."""
        return ["--sharding FULL_SHARD"] if m.sharding in ("NO_SHARD", "SHARD_GRAD_OP") else []

    # ---- the one build path

    @property
    def model(self) -> nn.Module:
        """What the loss calls: the model as wrapped."""
        if self._model is None:
            raise RuntimeError("Strategy.build() has not run")
        return self._model

    def build(self, hf_config) -> nn.Module:
        """The model of hf_config on this rank's device, distributed, its non-persistent buffers computed and its
        weights uninitialised memory until load_weights() or load_state_dict() fills them. A collective.

        Every strategy takes the same path: the meta model, the model transforms, activation checkpointing and
        compile, then the strategy's wrap."""
        model = meta_model(hf_config, attn_implementation=self.cfg.attn_implementation)
        compute_buffers(model)  # here, not in meta_model: MODEL_DOWNLOAD's check reads only the structure
        for transform in self.transforms:
            transform.apply(model)
        self.record(model)
        if self.dist.sequence_parallel > 1:  # after record(): the export's config keeps the family's own kernel
            self.sequence = SequenceParallel(self.dist.sequence_parallel, self.dist)
            self.sequence.install(model)
        self.checkpoint_and_compile(model)
        self._model = self.wrap(model)
        self.restore_buffers()
        return self._model

    @property
    def num_frozen_matmul(self) -> int:
        """Parameters of the matrix products that train no gradient of their own (a frozen base under adapters: the
        LM head's, a tied one's too)."""
        return self.num_matmul_params - self.num_trainable if self.freezes_base else 0

    def record(self, model: nn.Module) -> None:
        """The unwrapped model's tied names, parameter counts and shapes, before any wrapper changes them, and a meta
        copy of it as transformers builds it."""
        self.module = model
        self.tied = tied_keys(model)
        self.names = WeightNames(model, self.base_name)
        self.num_params, self.num_matmul_params = param_counts(model)
        self.num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.num_expert_params, self.num_trainable_experts = expert_counts(model)
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        self.built_config = copy.deepcopy(model.config)

    @functools.cached_property
    def as_built(self) -> nn.Module:
        """The model as transformers' classes build it (on the meta device), for their naming rules at export
        (to_file_layout): fully_shard gives a module a class of its own (FSDPDeepseekV4ForCausalLM) and transformers
        looks the rules up by class name; under it fsdp2 exported DeepSeek-V4's embed_tokens as `embed`, which
        from_pretrained left random. Built when the export asks (about a second for 8B), from the config as built."""
        return meta_model(self.built_config)

    @property
    def freezes_base(self) -> bool:
        """Whether a transform trains only parameters of its own (adapters) on a frozen base."""
        return any(t.freezes_base for t in self.transforms)

    def base_name(self, name: str) -> str | None:
        """A tensor's name in the base model's weight files (None: a transform's own, in no weight file)."""
        for transform in self.transforms:
            if (name := transform.base_name(name)) is None:
                return None
        return name

    def restore_buffers(self) -> None:
        """Every buffer of the materialised model set to its value from record() (modeling.compute_buffers: what
        from_pretrained gives): to_empty leaves them uninitialised memory, and no weight file or checkpoint holds the
        non-persistent ones. Persistent ones are then overwritten by the weights or the checkpoint, as in
        from_pretrained."""
        with torch.no_grad():
            for name, buf in self.module.named_buffers():
                buf.copy_(self.buffers[plain_name(name)])

    def checkpoint_and_compile(self, model: nn.Module) -> None:
        """--activation-checkpointing or --selective-checkpointing (non-reentrant, per decoder layer) and --compile
        (each decoder layer), before the model is wrapped."""
        if self.cfg.activation_checkpointing or self.cfg.selective_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=checkpoint_kwargs(self.cfg.selective_checkpointing))
        if self.cfg.compile:
            for layer in decoder_layers(model):
                layer.compile()

    def split(self, batch: Batch) -> Batch:
        """This rank's part of a batch of whole sequences: its slice of every row under --sequence-parallel (a
        collective follows in the forward: the group's ranks must run the same batch), else the batch itself."""
        return batch if self.sequence is None else self.sequence.split(batch)

    def forget_split(self) -> None:
        """After the last forward (and backward) of split batches: the whole sequence's layout and masks (a packed
        batch's is batch x seq x seq bytes) freed before the update, an evaluation or a checkpoint."""
        if self.sequence is not None:
            self.sequence.layout = None

    def whole_sequences(self) -> contextlib.AbstractContextManager:
        """Around forwards of unsplit inputs (greedy sampling): the family's own attention on each rank."""
        return contextlib.nullcontext() if self.sequence is None else self.sequence.whole()

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Distribute the meta model (transformed, checkpointed, compiled) and materialise this rank's part of it on
        the device, its non-persistent buffers computed. Returns what the loss calls. A collective."""

    def after_optimizer_step(self) -> None:
        """Runs after every applied optimizer step, on every rank: the transforms' hooks."""
        for transform in self.transforms:
            transform.after_optimizer_step(self.module)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Around a training micro-step's forward: what the transforms watch in it (a router's logits and load), and
        --offload-activations."""
        with contextlib.ExitStack() as stack:
            for transform in self.transforms:
                stack.enter_context(transform.recording())
            if self.cfg.offload_activations == "on" and self.dist.device.type == "cuda":
                # every tensor saved in the forward (a checkpointed layer's input too: non-reentrant checkpointing
                # saves it as one) copied to pinned host memory, and back when the backward unpacks it
                stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=True))
            yield

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The transforms' own terms for the loss of the forward just recorded (a router's load balancing, this rank's
        tokens' as transformers computes it per device), or None; scaled so that the gradient over the ranks is their
        mean, whether the strategy averages gradients or sums them (sums_gradients)."""
        terms = [t for transform in self.transforms if (t := transform.auxiliary_loss()) is not None]
        if not terms:
            return None
        total = sum(terms[1:], terms[0])
        return total / self.dist.world_size if self.sums_gradients else total

    @property
    def sums_gradients(self) -> bool:
        """Whether the gradients are summed over the ranks rather than averaged (a loss that is already the mean over
        every rank's tokens: fsdp2's vocabulary-parallel head). Averaged here."""
        return False

    def transform_metrics(self) -> dict:
        """The transforms' figures over the log window, reduced over every rank (a collective: every rank calls it)."""
        return {k: v for transform in self.transforms for k, v in transform.read_metrics(reduce=True).items()}

    def transform_warnings(self) -> list[str]:
        """What the transforms have to say now, each thing once, named by transform."""
        return [f"{transform.name}: {w}" for transform in self.transforms for w in transform.warnings()]

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward: whether its backward reduces gradients over the ranks
        (off for the micro-steps before the last of gradient accumulation, which accumulate locally). Here the
        wrapper's own no_sync() (DDP, FSDP1)."""
        return contextlib.nullcontext() if enabled else self.model.no_sync()

    def grad_scaler(self, init_scale: float) -> torch.amp.GradScaler:
        """fp16's dynamic loss scaling: torch's ShardedGradScaler, whose overflow check is all-reduced over the
        ranks, so each shard's decision to skip a step and halve the scale is every rank's (a sharded gradient can
        overflow on one rank only). It reads the optimizer's parameters' gradients, whatever holds them (FSDP's
        DTensors, the manual strategy's flat shards)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.dist.device.type, init_scale=init_scale)

    def head(self) -> Head:
        """How this model's output layer runs, for the objectives and the sampler: here the model's own forward."""
        return Head(self.model, False, self.dist.world_size)

    def replica_head(self) -> Head | None:
        """A head over this rank's own whole copy of the model whose forward is no collective, for a pass of forwards
        without backward that each rank runs at its own pace (GRPO's generation: no rank waits for another at each
        token); None where every forward is a collective (the sharding strategies all-gather in it)."""
        return None

    def release(self) -> None:  # noqa: B027 (a no-op for wrappers that never leave parameters gathered)
        """Free parameters left gathered (by a forward without backward): before saving, exporting or a step."""

    def gathered(self) -> contextlib.AbstractContextManager:
        """A pass of many forwards without backward (GRPO's generation, a forward per token): a sharding strategy
        gathers each unit once and keeps it until the pass ends, instead of all-gathering it again at every forward
        (memory: the whole model in the compute dtype, as one forward without backward leaves it). Nothing to do
        for one that does not shard."""
        return contextlib.nullcontext()

    def comm_seconds(self) -> float | None:
        """Seconds the training loop waited on this strategy's collectives since the last call, where the strategy
        can tell (manual: exact); None where the wrapper runs them out of sight."""
        return None

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW's parameter groups: decay on matrices only (not norms or biases)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]

    # ---- shared by the torch.distributed wrappers (DCP's state-dict API understands all of them)

    def load_weights(self, model_dir: Path) -> None:
        """The base model's weights from its safetensors, each rank reading only what it holds, then the initial
        values of what no weight file holds (the transforms'). A collective."""
        held = set().union(*(t.held_back() for t in self.transforms))
        load_weights(self.model, model_dir, self.names, skip=held)
        for transform in self.transforms:
            transform.load_base(self.model, lambda staging: read_weights(staging, model_dir, self.names))
            transform.after_base_weights(self.model)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to max_norm (inf: measure only); the global norm as a plain tensor on the device, the
        same on every rank. A collective."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def without_aliases(self, state_dict: dict) -> dict:
        """The state dict without the second name of a tied weight (lm_head.weight when tied to the embedding), as
        Hugging Face files store it: DCP would otherwise write the same tensor twice (1 GB more per checkpoint for
        Llama 3.2 1B in fp32)."""
        return {k: v for k, v in state_dict.items() if k not in self.tied}

    def with_aliases(self, state_dict: dict) -> dict:
        """The state dict with a tied weight under both names again (FSDP1 looks for both when loading)."""
        return {**state_dict, **{head: state_dict[embed] for head, embed in self.tied.items() if embed in state_dict}}

    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """{"model": ..., and "optim": ... with an optimizer}: what a checkpoint holds, this rank's shards under the
        plain model's names, as DCP saves them; also the buffers dcp.load fills before load_state_dict. On a frozen
        base (adapters) the trainable parameters only: the base is read from the model folder."""
        self.release()  # shards, never a gathered root
        options = StateDictOptions(ignore_frozen_params=self.freezes_base)
        if optimizer is None:
            return {"model": self.without_aliases(get_model_state_dict(self.model, options=options))}
        model_sd, optim_sd = get_state_dict(self.model, optimizer, options=options)
        return {"model": self.without_aliases(model_sd), "optim": optim_sd}

    def export_state(self) -> dict:
        """Every weight of the model as the Hugging Face export writes it (this rank's shards): the transforms'
        export_state applied in reverse order (adapters merged into their base weights), tied aliases left out. A
        collective where a transform gathers."""
        # every weight: the checkpoint's state dict, unless a transform froze the base out of it (strategies that
        # take no such transform, manual, keep their own state_dict)
        self.release()
        state = self.state_dict()["model"] if not self.freezes_base else get_model_state_dict(self.model)
        for transform in reversed(self.transforms):
            state = transform.export_state(state)
        return self.without_aliases(state)

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Put what dcp.load filled into state (from state_dict) into the model and optimizer."""
        # strict=False: a tied lm_head is filled through its embedding (one shared parameter), and on a frozen base
        # the checkpoint holds the trainable parameters only
        options = StateDictOptions(strict=False, ignore_frozen_params=self.freezes_base)
        model_sd = self.with_aliases(state["model"])
        if optimizer is None:
            set_model_state_dict(self.model, model_sd, options=options)
        else:
            set_state_dict(self.model, optimizer, model_state_dict=model_sd, optim_state_dict=state["optim"],
                           options=options)

