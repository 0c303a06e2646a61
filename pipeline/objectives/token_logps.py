"""Each target token's log-probability through the strategy's output layer (pipeline/model/head.py), with autograd,
without full-width fp32 logits where the head is vocabulary-parallel.

Two paths, as for the causal-LM loss:
- the model's own forward (ddp, fsdp1, manual, fsdp2 without the vocabulary-parallel head): its logits, their
  log-softmax at the targets; this rank's rows only.
- vocabulary-parallel (fsdp2's default): every rank scores every rank's rows against its share of the vocabulary,
  chunk by chunk (pipeline/model/vocab_parallel.py); the log-probabilities of all ranks' rows come back identical on
  every rank, and the backward recomputes each chunk's logits instead of keeping them (a second pass over the head:
  memory for one chunk, not for [tokens, vocab]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.data.batches import Batch
from pipeline.model.head import Head
from pipeline.model.modeling import trunk
from pipeline.model.vocab_parallel import (
    IGNORE,
    chunk_rows,
    gather_rows,
    shifted_labels,
    sum_rows,
    vocab_row_offset,
)


def token_logps(head: Head, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, labels): the log-probability each position gives its next token where that token is a
    target, 0 elsewhere, and the next-token labels (IGNORE where none), both [rows, seq]. On the vocabulary-parallel
    path the rows are every rank's (rank 0's first), the same on every rank; else this rank's. A collective on the
    vocabulary-parallel path."""
    labels = batch.labels if batch.shifted else shifted_labels(batch.labels)
    if not head.vocab_parallel:
        with head.autocasting(batch.input_ids.device):
            logits = head.model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        target = labels.clamp(min=0)
        picked = torch.gather(logits.float().log_softmax(-1), -1, target[..., None]).squeeze(-1)
        if head.sequence_group is not None:  # a slice of each row: the whole rows, as answers() reads them
            return sequence_rows(picked * (labels != IGNORE), head.sequence_group), \
                whole_rows(labels, head.sequence_group)
        return picked * (labels != IGNORE), labels
    if head.sequence_group is not None:  # preflight turns the head off for these under sequence parallelism
        raise ValueError("the vocabulary-parallel head scores whole rows, not sequence-parallel slices")
    h = trunk(head.model)(input_ids=batch.input_ids, position_ids=batch.position_ids,
                          use_cache=False).last_hidden_state
    every = gather_rows(labels, head.group)
    weight = head.model.get_output_embeddings().weight
    start = vocab_row_offset(weight.shape[0], head.group)
    logps = VocabParallelLogps.apply(h.flatten(0, 1), weight.to_local(), every.flatten(), start, head.group)
    return logps.view(every.shape), every


class _SequenceRows(torch.autograd.Function):
    """Each rank's slice of the rows' positions gathered into the whole rows on every rank of the group; backward,
    the gradients every rank's copy received summed, each rank keeping its slice's (so a loss each rank computes
    whole, divided among them, back-propagates once per position: Head.rank_share)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return whole_rows(part, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        width = grad.shape[1] // n
        return grad[:, rank * width:(rank + 1) * width].contiguous(), None


def sequence_rows(part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[rows, seq / n] on each rank of group -> the whole [rows, seq] on each, differentiable (_SequenceRows). A
    collective."""
    return _SequenceRows.apply(part, group)


def whole_rows(part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[rows, seq / n] on each rank of group -> [rows, seq], the slices in rank order (sequence order). A
    collective; no gradient."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class VocabParallelLogps(torch.autograd.Function):
    """The log-probability of each row's target, for every rank's rows against the vocabulary split over the group.
    Forward: per chunk the local log-sum-exp and target logit, combined over the ranks. Backward: each chunk's
    logits recomputed, d logp / d logits = onehot(target) - softmax, times the incoming gradient per row; the rows'
    gradients summed over the ranks' vocabulary shares, each rank keeping its own rows (sum_rows)."""

    @staticmethod
    def forward(ctx, h_local, w_local, labels, vocab_start, group):
        h = gather_rows(h_local, group)
        w = w_local.to(h.dtype)
        rows, v_local = h.shape[0], w.shape[0]
        valid = labels != IGNORE
        target = labels - vocab_start
        mine = valid & (target >= 0) & (target < v_local)
        target = torch.where(mine, target, 0)
        lse = torch.empty(rows, dtype=torch.float32, device=h.device)
        picked = torch.empty(rows, dtype=torch.float32, device=h.device)
        world = 1 if group is None else dist.get_world_size(group)
        step = chunk_rows(h.device.type, v_local, ctx.needs_input_grad[1])
        for a in range(0, rows, step):
            b = min(rows, a + step)
            z = torch.mm(h[a:b], w.t()).float()
            peak = z.amax(1)
            stats = torch.stack([peak + (z - peak[:, None]).exp().sum(1).log(),
                                 z.gather(1, target[a:b, None]).squeeze(1) * mine[a:b]], 1)
            if world > 1:  # every rank's local log-sum-exp and target logit (a collective per chunk)
                every = gather_rows(stats, group).view(world, b - a, 2)
                lse[a:b], picked[a:b] = torch.logsumexp(every[..., 0], 0), every[..., 1].sum(0)
            else:
                lse[a:b], picked[a:b] = stats[:, 0], stats[:, 1]
        ctx.save_for_backward(h, w_local, target, mine, valid, lse)
        ctx.vocab_start, ctx.group = vocab_start, group
        return (picked - lse) * valid

    @staticmethod
    def backward(ctx, grad_out):
        h, w_local, target, mine, valid, lse = ctx.saved_tensors
        w = w_local.to(h.dtype)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(w_local, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        g = (grad_out.float() * valid)
        step = chunk_rows(h.device.type, w.shape[0], ctx.needs_input_grad[1])
        for a in range(0, h.shape[0], step):
            b = min(h.shape[0], a + step)
            z = torch.mm(h[a:b], w.t()).float()
            # d logp / d z = onehot(target) - softmax(z), scaled by each row's incoming gradient
            z.sub_(lse[a:b, None]).exp_().mul_(-g[a:b, None])
            z.scatter_add_(1, target[a:b, None], (g[a:b] * mine[a:b])[:, None])
            d = z.to(h.dtype)
            torch.mm(d, w, out=grad_h[a:b])
            if grad_w is not None:
                grad_w += (d.t() @ h[a:b]).float()
        grad_w = None if grad_w is None else grad_w.to(w_local.dtype)
        return sum_rows(grad_h, ctx.group), grad_w, None, None, None
