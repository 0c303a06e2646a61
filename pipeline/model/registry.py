"""Which model transforms a config asks for (pipeline/model/transforms.py): one list, in the order they apply."""

from __future__ import annotations

import torch

from pipeline.config import ModelConfig
from pipeline.model.adapters import adapter_transform
from pipeline.model.router import router_transform
from pipeline.model.tiled_mlp import tiled_mlp_transform
from pipeline.model.transforms import ModelTransform

TRANSFORMS = (router_transform, tiled_mlp_transform, adapter_transform)
"""Each takes (model config, compute dtype) and gives its transform, or None when the config asks for none. The
router's hooks go on the experts module before peft wraps it (a wrapper passes the routing arguments through)."""


def transforms_for(cfg: ModelConfig, dtype: torch.dtype) -> list[ModelTransform]:
    """The transforms a config asks for, in the order they apply (dtype: the compute dtype)."""
    return [t for make in TRANSFORMS if (t := make(cfg, dtype)) is not None]
