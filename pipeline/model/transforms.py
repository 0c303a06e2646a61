"""Model transforms: changes made to the model in the one build step (`Strategy.build`), on the meta device, after
the model is built and before activation checkpointing, compile and the strategy's wrap, as torchtitan's model
converters are. Adapters (pipeline/model/adapters.py), float8 (issue 32) and per-family fixes are transforms: none
of them needs to know how the model is then distributed, and every strategy applies them at the same point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn


class ModelTransform:
    """One change to the model: `apply` before it is distributed; the hooks after, on every rank."""

    name = "transform"
    freezes_base = False
    """Whether it trains only parameters of its own (adapters): checkpoints then hold only the trainable ones, and
    the base weights are read from the model folder on every start, a resume included."""

    def apply(self, model: nn.Module) -> None:
        """Change the meta-device model in place (replace modules, freeze parameters, add buffers)."""
        raise NotImplementedError

    def base_name(self, name: str) -> str | None:
        """The name under which the base model's weight files hold the transformed model's tensor `name`; None for a
        tensor of the transform's own, which no weight file holds. The name itself by default."""
        return name

    def warnings(self) -> list[str]:
        """What the run should say of this transform now, each thing once (asked at the start and after every log
        window, on rank 0): a choice that leaves part of the model untrained, a router that collapsed. None by
        default."""
        return []

    def recording(self) -> contextlib.AbstractContextManager:
        """Around the forward of each micro-step of training (not validation's or generation's): what the transform
        watches in the forward is taken then. Nothing by default."""
        return contextlib.nullcontext()

    def auxiliary_loss(self) -> torch.Tensor | None:
        """A term of its own to add to the objective's loss of the forward just recorded (a router's load-balancing
        loss), or None."""
        return None

    def read_metrics(self, reduce: bool) -> dict:
        """Its figures over the log window, then reset; reduce: over every rank first (a collective where it has
        figures: every rank calls it). None by default."""
        return {}

    def held_back(self) -> set[str]:
        """Base weights (state-dict names) this transform keeps in a form of its own (NF4) and loads itself in
        load_base: left out of the plain load. None by default."""
        return set()

    def load_base(self, model: nn.Module, read: Callable[[dict], None]) -> None:
        """Load the held_back weights: read(staging) fills a dict of plain tensors (DTensors laid out as the
        parameters are) from the model folder, each rank reading only its rows. A collective where it reads; nothing
        by default."""

    def after_base_weights(self, model: nn.Module) -> None:
        """Runs once the base weights are loaded into the distributed model (a checkpoint may then overwrite what it
        holds): the initial values of parameters no weight file holds. Nothing by default."""

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Runs after every applied optimizer step, with the unwrapped model; nothing by default."""

    def export_state(self, state: dict) -> dict:
        """The distributed model's state dict (this rank's shards) as the model without this transform names and
        holds it, for the Hugging Face export; unchanged by default. A collective where it gathers."""
        return state
