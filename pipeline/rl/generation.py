"""Completions generated inside the training processes, by the policy as it is at this step, with a KV cache.

Hazards:
- Under FSDP (and the manual strategy) each forward all-gathers the parameters: a collective. Every rank therefore
  steps its generation until every rank is done (one small all-reduce per token), feeding finished rows padding.
  Over a whole replica's forward (ddp's module, Strategy.replica_head) no rank waits for another: each stops when
  its own rows are done.
- A stop signal: under collective generation the per-token all-reduce carries it, so every rank raises Stopped at
  the same token; over a replica a rank that got one ends its rows at once (the rollout's caller then agrees).
- Exact resume: sampling draws from a generator seeded by (seed, step, rank, micro-batch), never the global RNG, so
  a rerun from a checkpoint repeats the uninterrupted run's completions bitwise (same world size and device).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.model.head import Head
from pipeline.signals import Stopped, StopRequest


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    """Validation's completions: the likeliest token each time (the other settings unused)."""


def seeded(*parts: int) -> torch.Generator:
    """A CPU generator seeded from these integers (seed, step, rank, micro-batch) through a hash, so neighbouring
    tuples give unrelated streams."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _filtered(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The logits with tokens outside top-k and the top-p nucleus set to -inf (the likeliest always kept); the nucleus
    measured in float64."""
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if s.top_p < 1:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        p = ordered.double().softmax(-1)
        drop = p.cumsum(-1) - p >= s.top_p  # the mass before a token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    return logits


def pick(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [rows] from last-position logits [rows, vocab]: greedy, or sampled on the CPU from the filtered
    distribution (the generator lives there: the same draws on any device)."""
    if s.greedy:
        return logits.argmax(-1)
    # inverse transform sampling: one uniform draw per row against the cumulative weights (a tenth of the time
    # torch.multinomial takes over a 49k vocabulary); the weights exp(z - max) in float32, where the exponential is
    # vectorised (float64's took 7 ms per token over 16 x 49k on a core), unnormalised (the draw is scaled by the
    # total instead), summed in float64 so that no tail token is lost to the sum's rounding
    z = logits.float() if s.temperature == 1 else logits.float() / s.temperature
    z = _filtered(z, s)
    cdf = (z - z.amax(-1, keepdim=True)).exp_().double().cumsum(-1).cpu()
    if not torch.isfinite(cdf[:, -1]).all():
        raise RuntimeError("generation met non-finite logits: the policy's weights have diverged")
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype) * cdf[:, -1:]
    token = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    return token.to(logits.device)


@torch.no_grad()
def generate(head: Head, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, s: Sampling, stops: set[int],
             pad_id: int, generator: torch.Generator | None, collective: bool = True,
             repeats: int = 1, limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids [rows, C], mask [rows, C]) for left-padded prompts [rows, P]: each row's tokens up to and
    including its first stop token (TRL's completion mask), C the longest row's length (at most s.max_tokens).
    collective: the head's forward is one, so every rank calls this and steps until every rank's rows are done (C is
    then the longest over the ranks); else this rank steps until its own are. repeats: each prompt comes
    that many times in a row (a GRPO group): its forward runs once, its cache and logits copied to its rows. limits:
    each row's own most tokens (an episode's room left), below s.max_tokens; a row that reaches it is fed padding,
    and its mask runs to the end (the caller cuts it at its limit)."""
    from transformers import DynamicCache

    rows, device = prompt_ids.shape[0], prompt_ids.device
    mask = prompt_mask.long()
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = _next_logits(head, prompt_ids[::repeats], mask[::repeats], positions[::repeats], cache)
    if repeats > 1:
        # index_select on every layer's cache, recurrent states included (what beam search reorders with)
        cache.reorder_cache(torch.arange(rows // repeats, device=device).repeat_interleave(repeats))
        logits = logits.repeat_interleave(repeats, dim=0)
    out = []
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    stop = torch.tensor(sorted(stops), dtype=torch.long, device=device) if stops else None
    for i in range(s.max_tokens):
        token = torch.where(done, pad_id, pick(logits, s, generator))
        out.append(token)
        done |= torch.isin(token, stop) if stop is not None else torch.zeros_like(done)
        if limits is not None:
            done |= limits <= i + 1
        if i == s.max_tokens - 1 or _all_done(done, collective):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = _next_logits(head, token[:, None], mask, mask.sum(-1, keepdim=True) - 1, cache)
    completion = torch.stack(out, dim=1)
    return completion, _through_first_stop(completion, stop)


def _next_logits(head: Head, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """The last position's logits [rows, vocab] after ids, the cache extended by them."""
    with head.autocasting(ids.device):
        return head.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                          use_cache=True, logits_to_keep=1).logits[:, -1]


def _all_done(done: torch.Tensor, collective: bool) -> bool:
    """Whether every rank's rows (collective), or this rank's, have stopped: a host sync per token, and under
    collective one all-reduce (generation is sequential anyway; a rank that stopped alone would leave the others'
    all-gathers waiting), which also carries whether any rank got a stop signal: then Stopped on every rank alike.
    Over a replica, this rank's signal ends its own rows (its caller agrees with the others after)."""
    left = torch.stack([(~done).sum().float(), torch.tensor(float(StopRequest.signum != 0), device=done.device)])
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(left)  # on the device (NCCL on a GPU), as before the stop flag rode along
    rows_left, stop = left.tolist()
    if stop and collective:
        raise Stopped("during generation")
    return rows_left == 0 or bool(stop)


def _through_first_stop(completion: torch.Tensor, stop: torch.Tensor | None) -> torch.Tensor:
    """1 for each token up to and including the row's first stop token, 0 after it."""
    if stop is None:
        return torch.ones_like(completion)
    hit = torch.isin(completion, stop).long()
    before = hit.cumsum(-1) - hit  # stops strictly before this position
    return (before == 0).long()


def padded(rows: list[list[int]], fill: int, device: torch.device, left: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded with fill to the longest ([rows, C]): after them, or before them with left (prompts, which
    generation continues at the last column); and the mask of their real positions."""
    width = max(map(len, rows))
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        out[r, where] = torch.tensor(row, dtype=torch.long)
        real[r, where] = 1
    return out.to(device), real.to(device)
