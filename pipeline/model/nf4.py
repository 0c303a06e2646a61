"""QLoRA's frozen base: linear weights in torchao's NF4 (4-bit NormalFloat, blocks of 64 with double-quantized
scales), built on the meta device before the wrap and filled by rows after it.

torchao's `NF4Tensor` is what FSDP2 shards and gathers (it implements `fsdp_pre_all_gather`/`fsdp_post_all_gather`,
gathering the quantized bytes, not bf16) and what `F.linear` dequantizes on the fly. One catch decides how a shard is
filled: the scales are stored relative to one mean over the whole tensor (`scaler_mean`), and FSDP2's gathered
weight uses the mean of the rank that gathers it. Quantizing each rank's rows alone would give every rank its own
mean, and every rank a slightly different model, silently. So each rank reads only its rows, the per-block maxima
(one number per 64 weights) are all-gathered, and every rank quantizes its rows against the mean of them all: the
shards are then exactly `to_nf4` of the whole tensor, cut by rows (tested), whatever the world size.

The layout asks for whole blocks: a weight's elements are a multiple of 64, and its blocks a multiple of the group
its scales are quantized in (256, or the largest divisor of the block count below it, chosen from the shape alone
so every world size quantizes alike); under fully_shard each rank's rows must hold whole groups.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor, Shard

from pipeline.errors import UserError

BLOCK = 64
"""Weights per NF4 block (one absmax scale each), as QLoRA and torchtune use."""
SCALER_GROUP = 256
"""Block scales quantized to int8 together (one fp scale per group): the QLoRA default, where the shape allows."""
NF4_BYTES_PER_PARAM = 0.5 + 1 / BLOCK
"""A 4-bit code per weight and an int8 scale per block (the per-group scales and the mean: negligible)."""


def torchao_nf4():
    """torchao's NF4Tensor and to_nf4 (imported on first use: a second of start-up where no run needs them)."""
    from torchao.quantization import NF4Tensor, to_nf4

    return NF4Tensor, to_nf4


def scaler_group(numel: int) -> int:
    """The number of block scales quantized together for a weight of numel elements (0: no NF4 layout fits)."""
    if numel % BLOCK:
        return 0
    blocks = numel // BLOCK
    return next(g for g in range(min(SCALER_GROUP, blocks), 0, -1) if blocks % g == 0)


def layout_problem(shape: torch.Size, shards: int) -> str:
    """Why a weight of this shape cannot be held in NF4 over `shards` row shards ("" when it can)."""
    numel = shape.numel()
    group = scaler_group(numel)
    if not group:
        return f"its {numel:,} elements are not a whole number of {BLOCK}-element blocks"
    if shape[0] % shards or (numel // BLOCK // shards) % group:
        return (f"its {shape[0]} rows do not split into {shards} shards of whole blocks and scale groups "
                f"({BLOCK * group:,} elements)")
    return ""


def quantized_meta(weight: torch.Tensor) -> torch.Tensor:
    """An NF4 tensor of weight's shape and dtype on the meta device: what the model holds until fill()."""
    _, to_nf4 = torchao_nf4()
    return to_nf4(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), BLOCK, scaler_group(weight.numel()))


def fill(param: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantize rows (this rank's rows of the weight, in its dtype) into the NF4 parameter param (a DTensor under
    fully_shard, else the NF4 tensor), against the mean of the whole weight's block maxima. A collective under
    fully_shard (the maxima are all-gathered over the parameter's mesh): every rank calls it for the same
    parameters in the same order."""
    _, to_nf4 = torchao_nf4()
    target = held_nf4(param)
    group = scaler_group(param.numel())
    mine = rows.reshape(-1, BLOCK).abs().amax(dim=1)  # this rank's block maxima
    every = mine
    if isinstance(param, DTensor):
        blocks = param.numel() // BLOCK
        placements = [Shard(0) if isinstance(p, Shard) else p for p in param.placements]
        every = DTensor.from_local(mine, param.device_mesh, placements, run_check=False, shape=(blocks,),
                                   stride=(1,)).full_tensor()
    mean = every.mean()
    # torchao's double quantization of the scales (NF4Tensor.double_quantize_scalers), with the whole weight's mean
    grouped = (mine - mean).view(-1, group)
    factor = 256 / (2 * grouped.abs().amax(dim=1))
    scalers = (grouped * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8)
    codes = to_nf4(rows.contiguous(), BLOCK, group)  # the 4-bit codes depend on each block's own maximum only
    with torch.no_grad():
        target.quantized_data.copy_(codes.quantized_data)
        target.quantized_scalers.copy_(scalers)
        target.quantization_factor.copy_(factor)
    # empty_like (to_empty) leaves these two on the meta device; FSDP2 reads them from this local tensor
    target.scaler_mean, target.nf4 = mean.to(rows.dtype), codes.nf4


def held_nf4(param: torch.Tensor) -> torch.Tensor:
    """The NF4 tensor a parameter holds: itself, or a DTensor's local tensor. Through DTensor's private
    `_local_tensor`, the one object FSDP2 gathers from: the public to_local() returns a new NF4 object that shares
    the quantized bytes but not the attributes fill() must set (scaler_mean, nf4), so setting them there would
    leave FSDP2 reading the meta placeholders (test_adapters checks the attribute exists)."""
    return param._local_tensor if isinstance(param, DTensor) else param


def dequantized(param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of an NF4 parameter, dequantized to its dtype."""
    return held_nf4(param).get_original_weight()


def is_nf4(param: torch.Tensor) -> bool:
    NF4Tensor, _ = torchao_nf4()
    return isinstance(held_nf4(param), NF4Tensor)


def nf4_bytes(param: torch.Tensor) -> int | None:
    """Bytes this rank holds of an NF4 parameter (codes, scales and their quantization factors), None for any other
    tensor. No NF4 tensor exists before torchao is imported, so a run without QLoRA does not import it here."""
    if "torchao" not in sys.modules:
        return None
    NF4Tensor, _ = torchao_nf4()
    held = held_nf4(param)
    if not isinstance(held, NF4Tensor):
        return None
    names, _ = held.__tensor_flatten__()  # the subclass protocol: the plain tensors it is made of
    return sum(getattr(held, name).untyped_storage().nbytes() for name in names)


def refuse_layout(weights: dict[str, torch.Size], shards: int) -> None:
    """One line naming the first NF4 weight that cannot be split into `shards` row shards."""
    for name, shape in weights.items():
        why = layout_problem(shape, shards)
        if why:
            raise UserError(f"--adapter qlora cannot hold {name} ({' x '.join(map(str, shape))}) in NF4 over "
                            f"{shards} shards: {why}; use --strategy ddp, another number of ranks, or --adapter lora")


def roundtrip(model: torch.nn.Module, targets: list[str]) -> torch.nn.Module:
    """A plain model (from_pretrained's) with the weight of every linear layer of its decoder blocks named in
    targets replaced by that weight's NF4, dequantized: the function QLoRA trains its adapters on, to evaluate or
    compare with. In place; returns the model."""
    from pipeline.model.modeling import decoder_layers

    _, to_nf4 = torchao_nf4()
    with torch.no_grad():
        for layer in decoder_layers(model):
            for name, module in layer.named_modules():
                if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                    whole = to_nf4(module.weight.detach(), BLOCK, scaler_group(module.weight.numel()))
                    module.weight.copy_(whole.get_original_weight())
    return model
