"""The interface every way of distributing the model implements; the trainer, checkpointer and exporter call
only this.

A strategy owns the model once built: how it is wrapped and sharded, what gradient accumulation and clipping need,
and the state-dict calls DCP saves and loads through. Fully qualified names in its state dicts are those of the
plain Hugging Face model (tied aliases left out), so every strategy reads and writes the same checkpoints.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
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

from pipeline.config import ModelConfig
from pipeline.dist.runtime import Dist
from pipeline.model.loss import CausalLMLoss
from pipeline.model.modeling import decoder_layers, meta_model, param_counts, tied_keys, tied_partners
from pipeline.model.weights import load_weights


class Strategy(ABC):
    """One way of spreading a model, its gradients and its optimizer state over the ranks."""

    KNOBS: frozenset[str] = frozenset()
    """The FSDP1 knobs (config keys) this strategy applies; the others have no effect under it."""

    def __init__(self, cfg: ModelConfig, d: Dist, dtype: torch.dtype):
        self.cfg, self.dist, self.dtype = cfg, d, dtype
        self._model: nn.Module | None = None
        self.module: nn.Module | None = None
        """The plain Hugging Face model inside whatever wrapper (config, embeddings, structure)."""
        self.tied: dict[str, str] = {}
        """{lm_head key: embedding key} when the model ties them (modeling.tied_keys)."""
        self.partners: dict[str, str] = {}
        """Both names of a tied weight, each to the other (modeling.tied_partners): files store it under either."""
        self.num_params = self.num_matmul_params = 0
        self.shapes: dict[str, torch.Size] = {}
        """Every parameter's name and shape in the unwrapped model (tied weights once)."""

    @property
    def model(self) -> nn.Module:
        """What the loss calls: the model as wrapped."""
        if self._model is None:
            raise RuntimeError("Strategy.build() has not run")
        return self._model

    def meta(self, hf_config) -> nn.Module:
        """The unwrapped model on the meta device, its tied names and parameter counts recorded: every strategy
        starts here, so none reads the structure of a wrapped model."""
        model = meta_model(hf_config)
        self.module = model
        self.tied = tied_keys(model)
        self.partners = tied_partners(model)
        self.num_params, self.num_matmul_params = param_counts(model)
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        return model

    def checkpoint_and_compile(self, model: nn.Module) -> None:
        """--activation-checkpointing (non-reentrant, per decoder layer) and --compile (each decoder layer), before
        the model is wrapped."""
        if self.cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.cfg.compile:
            for layer in decoder_layers(model):
                layer.compile()

    # ---- what each strategy defines

    @abstractmethod
    def build(self, hf_config) -> nn.Module:
        """The model of hf_config on this rank's device, distributed, its non-persistent buffers computed and its
        weights uninitialised memory until load_weights() or load_state_dict() fills them. A collective."""

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward: whether its backward reduces gradients over the ranks
        (off for the micro-steps before the last of gradient accumulation, which accumulate locally). Here the
        wrapper's own no_sync() (DDP, FSDP1)."""
        return contextlib.nullcontext() if enabled else self.model.no_sync()

    def loss(self) -> CausalLMLoss:
        """The loss function for this model as built (the model's own forward and loss)."""
        return CausalLMLoss(self.model, False, self.dist.world_size)

    def release(self) -> None:  # noqa: B027 (a no-op for wrappers that never leave parameters gathered)
        """Free parameters left gathered (by a forward without backward): before saving, exporting or a step."""

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
        """The base model's weights from its safetensors, each rank reading only what it holds. A collective."""
        load_weights(self.model, model_dir, self.partners)

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
        """{"model": ..., and "optim": ... with an optimizer}: this rank's shards under the plain model's names, as
        DCP saves them; also the buffers dcp.load fills before load_state_dict."""
        self.release()  # shards, never a gathered root
        if optimizer is None:
            return {"model": self.without_aliases(get_model_state_dict(self.model))}
        model_sd, optim_sd = get_state_dict(self.model, optimizer)
        return {"model": self.without_aliases(model_sd), "optim": optim_sd}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Put what dcp.load filled into state (from state_dict) into the model and optimizer."""
        # strict=False: a tied lm_head is filled through its embedding (one shared parameter)
        options = StateDictOptions(strict=False)
        model_sd = self.with_aliases(state["model"])
        if optimizer is None:
            set_model_state_dict(self.model, model_sd, options=options)
        else:
            set_state_dict(self.model, optimizer, model_state_dict=model_sd, optim_state_dict=state["optim"],
                           options=options)

