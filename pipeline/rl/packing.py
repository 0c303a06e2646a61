"""Shared-prompt rows for GRPO's scoring forwards: the G completions of a group all follow one prompt, so one row can
hold that prompt once and the G completions after it, each attending to the prompt and to itself alone (a 4D mask)
and numbered from the prompt's end as if it followed the prompt alone. The prompt's tokens then run once per group
instead of G times, in the forward and the backward; the log-probabilities are the plain rows' (the same keys, values
and positions reach every completion token).

Hazards:
- Only attention reads a mask: a layer that reads the sequence in order (a recurrent or convolutional layer of a
  hybrid model) would read one completion into the next. packing_refusal (pipeline/model/packed_rows.py) refuses what
  the config says is such a model; GRPOObjective also compares the two layouts on its first rows and keeps the plain
  one if they differ.
- A sliding window (or Llama 4's attention chunks) counts positions, which a 4D mask given as it is leaves out: a
  window shorter than prompt plus completion is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.rl.target_logps import target_logps


@dataclass(frozen=True)
class Packed:
    """A forward's inputs for B prompts of width P, each followed by its G completions of width C."""

    input_ids: torch.Tensor
    """[B, P + G*C]"""
    mask: torch.Tensor
    """[B, 1, L, L], additive in the attention's dtype (0 or its lowest value): SDPA uses it as it is in every layer,
    where a bool mask is converted, and the copy saved for the backward, layer by layer."""
    positions: torch.Tensor
    """[B, L]"""
    keep: torch.Tensor
    """The positions whose logits predict completion tokens: the prompt's last, then each completion's but its last."""
    group: int
    width: int


def pack(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, group: int,
         dtype: torch.dtype) -> Packed:
    """Packed rows from the rollout's: prompt_ids/prompt_mask [B*G, P] (left-padded, each prompt repeated G times in
    a row), completion_ids [B*G, C]. dtype: the attention's (the mask is added to its scores)."""
    device = prompt_ids.device
    prompts, pmask = prompt_ids[::group], prompt_mask[::group].bool()
    b, p = prompts.shape
    c = completion_ids.shape[1]
    length = p + group * c
    block = torch.cat([torch.full((p,), -1, device=device), torch.arange(group, device=device).repeat_interleave(c)])
    offset = torch.cat([torch.arange(p, device=device), torch.arange(c, device=device).repeat(group)])
    prompt_positions = (pmask.long().cumsum(-1) - 1).clamp(min=0)
    after = pmask.sum(-1, keepdim=True) + offset[p:]  # a completion's token j sits at the prompt's length + j
    positions = torch.cat([prompt_positions, after], dim=1)
    index = torch.arange(length, device=device)
    causal = index[:, None] >= index[None, :]
    same = (block[None, :] < 0) | (block[:, None] == block[None, :])  # the prompt's keys, and the row's own block
    real = torch.cat([pmask, torch.ones(b, group * c, dtype=torch.bool, device=device)], dim=1)
    allowed = (causal & same)[None] & real[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool, device=device)  # a padding query keeps one key (no NaN row)
    mask = torch.zeros((b, 1, length, length), dtype=dtype, device=device).masked_fill(~allowed[:, None],
                                                                                       torch.finfo(dtype).min)
    starts = p + torch.arange(group, device=device)[:, None] * c
    keep = torch.cat([torch.tensor([p - 1], device=device), (starts + torch.arange(c - 1, device=device)).flatten()])
    ids = torch.cat([prompts, completion_ids.reshape(b, group * c)], dim=1)
    return Packed(ids, mask, positions, keep, group, c)


def token_logps(logits: torch.Tensor, completion_ids: torch.Tensor, packed: Packed, entropy: bool,
                reuse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each completion token's log-probability [B*G, C] (and, when asked, its position's entropy, without autograd)
    from the kept positions' logits [B, 1 + G*(C-1), V] (float, over the temperature). The prompt's last position is
    shared by the G completions: its log-sum-exp is computed once, and its gradient is one row's. reuse: the backward
    writes the gradient over the logits (target_logps's reuse, with its conditions)."""
    b, g, c = logits.shape[0], packed.group, packed.width
    k = logits.shape[1]
    # the row of the kept logits that predicts each completion token: the shared one first, then the completion's own
    offset = torch.cat([torch.zeros(g, 1, dtype=torch.long, device=logits.device),
                        1 + torch.arange(g * (c - 1), device=logits.device).view(g, c - 1)], dim=1)
    rows = (torch.arange(b, device=logits.device)[:, None, None] * k + offset).flatten()
    picked = target_logps(logits.reshape(b * k, -1), rows, completion_ids.flatten(), reuse).view(b * g, c)
    if not entropy:
        return picked, None
    with torch.no_grad():
        each = row_entropy(logits)  # [B, K]
        shared = each[:, :1, None].expand(b, g, 1)
        return picked, torch.cat([shared, each[:, 1:].reshape(b, g, c - 1)], dim=-1).reshape(b * g, c)


def row_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Each position's entropy of softmax(logits) ([rows, tokens, vocab] -> [rows, tokens]), without autograd, a few
    positions' probabilities at a time (a row's were 0.15 GB of temporaries on a 49k vocabulary)."""
    with torch.no_grad():
        flat = logits.reshape(-1, logits.shape[-1])
        return torch.cat([_entropy(chunk) for chunk in flat.split(ENTROPY_ROWS)]).view(logits.shape[:-1])


ENTROPY_ROWS = 64
"""Positions whose entropy is computed together."""


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logprobs = logits.log_softmax(-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def model_config(model: torch.nn.Module):
    """The transformers config of the model inside whatever wraps it (DDP, FSDP, peft)."""
    from transformers import PretrainedConfig

    return next(m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig))
