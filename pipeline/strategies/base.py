"""The interface every way of distributing the model implements; the trainer, checkpointer and exporter call
only this.

A strategy owns the model once built: how it is wrapped and sharded, what gradient accumulation and clipping need,
and the state-dict calls DCP saves and loads through. Fully qualified names in its state dicts are those of the
plain Hugging Face model (tied aliases left out), so every strategy reads and writes the same checkpoints.
"""

from __future__ import annotations

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
from pipeline.loss import CausalLMLoss
from pipeline.modeling import without_tied_aliases
from pipeline.runtime import Dist
from pipeline.weights import load_weights


class Strategy(ABC):
    """One way of spreading a model, its gradients and its optimizer state over the ranks."""

    def __init__(self, cfg: ModelConfig, d: Dist, dtype: torch.dtype):
        self.cfg, self.dist, self.dtype = cfg, d, dtype
        self._model: nn.Module | None = None

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError("Strategy.build() has not run")
        return self._model

    # ---- what each strategy defines

    @abstractmethod
    def build(self, hf_config) -> nn.Module:
        """The model of hf_config on this rank's device, distributed, its non-persistent buffers computed and its
        weights uninitialised memory until load_weights() or load_state_dict() fills them. A collective."""

    @abstractmethod
    def loss(self) -> CausalLMLoss:
        """The loss function for this model as built."""

    @abstractmethod
    def gradient_sync(self, enabled: bool) -> None:
        """Whether the next backward reduces gradients over the ranks: off for the micro-steps before the last of
        gradient accumulation, which accumulate locally."""

    @abstractmethod
    def release(self) -> None:
        """Free parameters left gathered (by a forward without backward): before saving, exporting or a step."""

    # ---- shared by the torch.distributed wrappers (DCP's state-dict API understands all of them)

    def load_weights(self, model_dir: Path) -> None:
        """The base model's weights from its safetensors, each rank reading only what it holds. A collective."""
        load_weights(self.model, model_dir)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to max_norm (inf: measure only); the global norm as a plain tensor on the device, the
        same on every rank. A collective."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """{"model": ..., and "optim": ... with an optimizer}: this rank's shards under the plain model's names, as
        DCP saves them; also the buffers dcp.load fills before load_state_dict."""
        self.release()  # shards, never a gathered root
        if optimizer is None:
            return {"model": without_tied_aliases(self.model, get_model_state_dict(self.model))}
        model_sd, optim_sd = get_state_dict(self.model, optimizer)
        return {"model": without_tied_aliases(self.model, model_sd), "optim": optim_sd}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Put what dcp.load filled into state (from state_dict) into the model and optimizer."""
        # strict=False: a tied lm_head is filled through its embedding (one shared parameter)
        options = StateDictOptions(strict=False)
        if optimizer is None:
            set_model_state_dict(self.model, state["model"], options=options)
        else:
            set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=options)
