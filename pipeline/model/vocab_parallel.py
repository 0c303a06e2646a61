"""The vocabulary-parallel embedding and LM head, and the fused chunked cross-entropy of the head.

The embedding and the LM head (one tensor when tied) stay sharded by vocabulary rows on the FSDP mesh and are never
gathered. The embedding looks every rank's ids up in its own rows and the partial embeddings are summed back to
their ranks (reduce-scatter). At the other end, each rank projects the hidden states of every rank's tokens onto its
own vocabulary rows, a few rows of tokens at a time, and the ranks combine per-token softmax statistics (a few
floats per token). Forward and backward of the head run in one pass over each chunk: the gradients are computed
while the chunk's logits are at hand, so no full-width logits (and no separate gradient of them) ever exist.

What moves between ranks per micro-step is the hidden states and token ids (all-gathered, kilobytes to a few MB)
and the hidden-state gradients (reduce-scattered); FSDP instead all-gathers and reduce-scatters the whole
embedding, 0.5 GB per direction for Llama 3's 128k x 1024 in fp32, which on CPU (where gloo's collectives do
not overlap compute) was a third of the step.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from pipeline.distributed.collectives import all_gather_flat, reduce_scatter_flat

IGNORE = -100
LOGIT_TERMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config keys of terms some families apply to the logits (Gemma's soft-capping, Cohere's and Granite's scales): the
vocabulary-parallel head computes plain logits, so a model that sets one of them cannot use it."""


def unsupported_terms(model: nn.Module) -> str:
    """Why the vocabulary-parallel embedding and head would compute another function than the model's own ("" when
    they would not): an input embedding whose forward does more than a lookup (Gemma's scale by sqrt(hidden)), or a
    term on the logits."""
    embed = model.get_input_embeddings()
    if getattr(model.get_output_embeddings(), "out_features", None) == 1:  # pipeline/model/reward_head.py
        return "its output layer is a reward model's score (one output, no vocabulary)"
    if type(embed).forward is not nn.Embedding.forward:
        return f"its input embedding ({type(embed).__name__}) does more than a lookup"
    config = model.config
    terms = [k for k in LOGIT_TERMS if getattr(config, k, None) not in (None, 0, 1, 1.0)]
    return f"its config sets {', '.join(terms)} on the logits" if terms else ""
CHUNK_ELEMENTS = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}
"""Logits per chunk by device type. CPU: 16M (64 MB in fp32); fewer, larger chunks were faster (each chunk re-reads
and re-writes the head's gradient): 0.68 s/step at 16M against 0.75 at 8M and 1.08 at 2M, in a 2-rank training
loop of the CPU bench model (one run each). CUDA: 256M (1 GiB in fp32), about 2,000 token rows against a 128k
vocabulary, so each chunk's three matrix products are large enough to keep the tensor cores busy."""
FROZEN_HEAD_CHUNK_ELEMENTS = {"cpu": 16 * 2**20, "cuda": 64 * 2**20}
"""Logits per chunk where the head does not train (adapters): no weight gradient is re-read and re-written per
chunk, which is what made larger chunks faster, and the runs that freeze it (adapters under fsdp2: LoRA on one
GPU, LoRA and QLoRA over several) are the ones sized by memory: on CUDA 64M logits, about 520 token rows against a
128k vocabulary, a quarter of the transients (the chunk's fp32 logits and its low-precision gradient, 1.5 GiB at
256M)."""


def chunk_elements(device_type: str, head_trains: bool = True) -> int:
    """Logits per chunk of the loss on a device of this type."""
    table = CHUNK_ELEMENTS if head_trains else FROZEN_HEAD_CHUNK_ELEMENTS
    return table.get(device_type, table["cpu"])


def chunk_rows(device_type: str, vocab_local: int, head_trains: bool) -> int:
    """Token rows per chunk against a vocabulary share of vocab_local (at least one)."""
    return max(1, chunk_elements(device_type, head_trains) // max(vocab_local, 1))


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets of [batch, seq] labels (the model-input convention: a token's own id or IGNORE): each
    position's target is the next label; the last position of a row has none."""
    out = torch.full_like(labels, IGNORE)
    out[:, :-1] = labels[:, 1:]
    return out


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's x stacked along dim 0 (a collective; all ranks pass the same shape)."""
    world = _world(group)
    if world == 1:
        return x
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    all_gather_flat(out, x.contiguous(), group=group)
    return out


def sum_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The inverse of _gather_rows: x summed over ranks, each rank keeping its own block of rows (a collective)."""
    world = _world(group)
    if world == 1:
        return x
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    reduce_scatter_flat(out, x, group=group)
    return out


def chunk_stats(z: torch.Tensor, target: torch.Tensor, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of logits' local log-sum-exp and target logit (0 where this rank does not hold the target), stacked
    [rows, 2], and each row's largest logit; fp32 math whatever z's dtype."""
    zf = z.float()
    peak = zf.amax(1)
    picked = zf.gather(1, target[:, None]).squeeze(1) * mine
    return torch.stack([peak + (zf - peak[:, None]).exp().sum(1).log(), picked], 1), peak


def chunk_grads(z: torch.Tensor, peak: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, mine: torch.Tensor,
                scale: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot(target)) / count in z's dtype, with the eager path's arithmetic:
    exp(z - peak) * (exp(peak - lse) * valid / count), less 1/count at each row's target where this rank holds it
    (scale is valid / count)."""
    p = (z.float() - peak[:, None]).exp() * (torch.exp(peak - lse) * scale)[:, None]
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == target[:, None]
    return (p - hit * (mine / count)[:, None]).to(z.dtype)


@functools.cache
def compiled_chunk_math():
    """chunk_stats and chunk_grads through torch.compile (built on first use): each becomes one or two fused
    kernels that read the chunk's logits in their own dtype, where the eager path writes them out in fp32, then
    reads and writes them again per operation (on an H200, 1B model, batch 8 x 2048: 42 ms a step of elementwise
    work and copies against the compiled Trainer's 6 ms for its whole loss, BENCHMARKS.md's gpu_profile)."""
    return torch.compile(chunk_stats), torch.compile(chunk_grads)


def head_pass(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, vocab_start: int,
              group: dist.ProcessGroup | None, with_grads: bool, num_items: float, weight_grad: bool = True,
              compiled: bool = False):
    """Summed cross-entropy of all rows of h against labels, over num_items, with the vocabulary split across the
    group, this rank holding rows [vocab_start, vocab_start + len(w)) of it; with the gradients of h (this rank's
    vocabulary share only: the caller sums them over ranks) and of w. One collective per chunk: every rank must run
    the same number of chunks, so every rank passes the same number of rows. weight_grad False: no gradient of w (a
    frozen head, under adapters: a vocabulary x hidden product per chunk saved). compiled (with gradients): the
    per-chunk softmax math through torch.compile (--compile on), else in place in eager mode."""
    rows, v_local = h.shape[0], w.shape[0]
    valid = labels != IGNORE
    count = max(float(num_items), 1.0)
    target = labels - vocab_start
    mine = valid & (target >= 0) & (target < v_local)
    target = torch.where(mine, target, 0)
    w_c = w.to(h.dtype)
    grad_h = torch.empty_like(h) if with_grads else None
    grad_w = torch.zeros_like(w, dtype=torch.float32) if with_grads and weight_grad else None
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    step = chunk_rows(h.device.type, v_local, weight_grad)
    if with_grads and compiled:
        return _compiled_pass(h, w_c, labels, target, mine, valid, count, group, step, grad_h, grad_w)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        z = torch.mm(h[a:b], w_c.t()).float()
        peak = z.amax(1)
        picked = z.gather(1, target[a:b, None]).squeeze(1) * mine[a:b]
        z.sub_(peak[:, None]).exp_()
        stats = torch.stack([peak + z.sum(1).log(), picked], 1)  # local log-sum-exp, target logit (or 0)
        lse, picked = _over_ranks(stats, group)
        total += ((lse - picked) * valid[a:b]).sum(dtype=torch.float64)
        if with_grads:
            # d loss / d logits = (softmax - onehot(target)) / count, written over z in place
            z.mul_((torch.exp(peak - lse) * valid[a:b] / count)[:, None])
            # minus 1/count at each row's target column, where this rank holds it (a scatter, not an indexed
            # assignment through nonzero(), which would wait for the GPU once per chunk)
            z.scatter_add_(1, target[a:b, None], (mine[a:b] / -count).to(z.dtype)[:, None])
            _backprop(z.to(h.dtype), w_c, h[a:b], grad_h[a:b], grad_w)
    return (total / count).float(), grad_h, grad_w


def _over_ranks(stats: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's log-sum-exp and target logit over the whole vocabulary, from each rank's share of them ([rows, 2]:
    local log-sum-exp, target logit or 0). A collective where the vocabulary is split."""
    world = _world(group)
    if world == 1:
        return stats[:, 0], stats[:, 1]
    every = gather_rows(stats, group).view(world, stats.shape[0], 2)
    return torch.logsumexp(every[..., 0], 0), every[..., 1].sum(0)


def _backprop(d: torch.Tensor, w_c: torch.Tensor, h: torch.Tensor, grad_h: torch.Tensor,
              grad_w: torch.Tensor | None) -> None:
    """A chunk's logit gradients d through the head: into grad_h (its rows), and added to grad_w when the head
    trains."""
    torch.mm(d, w_c, out=grad_h)
    if grad_w is None:
        return
    if d.dtype == grad_w.dtype:
        grad_w.addmm_(d.t(), h)
    else:  # the low-precision product added with type promotion: no fp32 copy of it is written first
        grad_w += d.t() @ h


def _compiled_pass(h, w_c, labels, target, mine, valid, count, group, step, grad_h, grad_w):
    """head_pass's loop with gradients, its per-chunk math compiled (compiled_chunk_math)."""
    stats_fn, grads_fn = compiled_chunk_math()
    rows = h.shape[0]
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    # tensors, not Python numbers: a float argument would be a constant of the compiled code, recompiled per step
    count_t = torch.tensor(count, dtype=torch.float32, device=h.device)
    mine_f, valid_f = mine.float(), valid.float()
    for a in range(0, rows, step):
        b = min(rows, a + step)
        z = torch.mm(h[a:b], w_c.t())
        stats, peak = stats_fn(z, target[a:b], mine_f[a:b])
        lse, picked = _over_ranks(stats, group)
        total += ((lse - picked) * valid[a:b]).sum(dtype=torch.float64)
        d = grads_fn(z, peak, lse, target[a:b], mine_f[a:b], valid_f[a:b] / count_t, count_t)
        _backprop(d, w_c, h[a:b], grad_h[a:b], grad_w)
    return (total / count).float(), grad_h, grad_w


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Loss of this rank's hidden states h_local against the global batch's labels; gradients computed in forward."""

    @staticmethod
    def forward(ctx, h_local, w_local, labels, vocab_start, group, num_items, compiled=False):
        weight_grad = ctx.needs_input_grad[1]
        loss, grad_h, grad_w = head_pass(gather_rows(h_local, group), w_local, labels, vocab_start, group, True,
                                         num_items, weight_grad, compiled)
        # every rank's tokens got gradient from every rank's vocabulary share: sum, keep this rank's rows
        ctx.save_for_backward(sum_rows(grad_h, group), *([grad_w.to(w_local.dtype)] if weight_grad else []))
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, *grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w[0] * grad_out if grad_w else None, None, None, None, None, None


class _VocabParallelLookup(torch.autograd.Function):
    """Embeddings of this rank's ids [batch, seq] from vocabulary-sharded rows: every rank looks up every rank's
    ids in its own rows (zeros elsewhere) and the partial embeddings are summed back to their ranks."""

    @staticmethod
    def forward(ctx, ids_local, w_local, vocab_start, padding_idx, group):
        local = gather_rows(ids_local, group) - vocab_start
        mine = (local >= 0) & (local < w_local.shape[0])
        local = torch.where(mine, local, 0)
        out = sum_rows(torch.nn.functional.embedding(local, w_local) * mine[..., None], group)
        if padding_idx is not None:  # nn.Embedding's padding row gets no gradient
            mine = mine & (local != padding_idx - vocab_start)
        ctx.save_for_backward(local, mine)
        ctx.rows, ctx.group = w_local.shape[0], group
        return out

    @staticmethod
    def backward(ctx, grad_local):
        local, mine = ctx.saved_tensors
        grad = gather_rows(grad_local.contiguous(), ctx.group)
        # this rank's rows only, and a plain zeros + index_add: DTensor's sharded embedding backward zero-fills a
        # gradient of the whole vocabulary first (131 MB per step for the CPU bench model) and then slices it
        grad_w = grad.new_zeros((ctx.rows, grad.shape[-1]))
        # every position adds into its row, ids of other ranks a zero gradient into row 0: boolean indexing would
        # call nonzero(), which waits for the GPU (105 ms of queued work per step on the 1B GPU bench)
        grad_w.index_add_(0, local.flatten(), (grad * mine[..., None].to(grad.dtype)).flatten(0, -2))
        return None, grad_w, None, None, None


class VocabParallelEmbedding(nn.Module):
    """The model's input embedding with its weight sharded by vocabulary rows (Shard(0)) on a 1-D mesh; the
    parameter keeps its name (`weight`), so state dicts and checkpoints are those of the plain model."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None, group: dist.ProcessGroup | None):
        super().__init__()
        self.weight, self.padding_idx, self.group = weight, padding_idx, group
        self.vocab_start = vocab_row_offset(weight.shape[0], group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """A collective: every rank calls it with the same shape."""
        return _VocabParallelLookup.apply(ids, self.weight.to_local(), self.vocab_start, self.padding_idx,
                                          self.group)


def vocab_row_offset(vocab: int, group: dist.ProcessGroup | None) -> int:
    """First vocabulary row this rank holds: DTensor's Shard(0) splits like torch.chunk (ceil-sized pieces)."""
    if group is None:
        return 0
    return min(vocab, -(-vocab // dist.get_world_size(group)) * dist.get_rank(group))


def argmax_token(h: torch.Tensor, w: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The id of the highest logit of one hidden state h (hidden,) against the whole vocabulary, this rank holding
    rows [vocab_start, vocab_start + len(w)) of the head: each rank's best, then the best of those (of equal logits
    the lowest id, as argmax over the whole row picks). A collective; a rank holding no rows takes part. Returns a
    1-element int64 tensor, the same on every rank."""
    logits = (w.to(h.dtype) @ h).float()  # the head may be fp32 (full fine-tuning) under a bf16 forward
    if group is None:  # the whole vocabulary here
        return logits.argmax().view(1)
    if len(logits):
        best = logits.argmax()
        mine = torch.stack([logits[best], (best + vocab_start).float()])  # ids below 2**24: exact in fp32
    else:
        mine = torch.tensor([-torch.inf, torch.inf], device=h.device)
    every = [torch.empty_like(mine) for _ in range(_world(group))]
    dist.all_gather(every, mine, group=group)
    scores = torch.stack(every)
    order = torch.argsort(scores[:, 1])
    return scores[order[scores[order, 0].argmax()], 1].long().view(1)
