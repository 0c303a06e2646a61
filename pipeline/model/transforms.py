"""Model transforms: changes made to the model in the one build step (`Strategy.build`), on the meta device, after
the model is built and before activation checkpointing, compile and the strategy's wrap, as torchtitan's model
converters are. Adapters (issue 29), float8 (issue 32) and per-family fixes (issue 28) are transforms: none of them
needs to know how the model is then distributed, and every strategy applies them at the same point.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pipeline.config import ModelConfig


class ModelTransform:
    """One change to the model: `apply` before it is distributed; `after_optimizer_step` after each applied step
    (float8's scales, say), on every rank."""

    name = "transform"

    def apply(self, model: nn.Module) -> None:
        """Change the meta-device model in place (replace modules, freeze parameters, add buffers)."""
        raise NotImplementedError

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Runs after every applied optimizer step, with the unwrapped model; nothing by default."""


TRANSFORMS: dict[str, Callable[[ModelConfig], ModelTransform | None]] = {}
"""name -> the transform a config asks for, or None when it asks for none; applied in this order. Empty until the
adapter, float8 and family issues register theirs."""


def transforms_for(cfg: ModelConfig) -> list[ModelTransform]:
    """The transforms a config asks for, in the order they apply."""
    return [t for make in TRANSFORMS.values() if (t := make(cfg)) is not None]
