"""Bytes one rank moves through collectives per optimizer step: the two patterns the strategies are made of, which
`--strategy auto` weighs when more than one strategy fits (each strategy's `traffic_bytes` picks its pattern).

Ring collectives move (W-1)/W of their buffer per rank: a reduce-scatter or an all-gather of B bytes costs
B(W-1)/W, an all-reduce twice that. Where collectives block the step (gloo on CPU) the step time follows these bytes
(BENCHMARKS.md section 11); on GPU they overlap the compute, and the figure is what is left to hide.
"""

from __future__ import annotations

from pipeline.strategies.memory import FP32_BYTES, Shape, Workload


def ring(w: Workload) -> float:
    return (w.world_size - 1) / w.world_size


def replicated_bytes(shape: Shape, w: Workload) -> int:
    """A whole replica per rank (DDP, NO_SHARD): one all-reduce of the fp32 gradients (an adapter's alone), at the
    sync step."""
    return int(2 * ring(w) * FP32_BYTES * shape.trainable_params(w))


def sharded_bytes(shape: Shape, w: Workload) -> int:
    """FSDP's pattern: parameters all-gathered for use, gradients reduce-scattered. HYBRID_SHARD is counted as
    FULL_SHARD over every rank (its replicas' all-reduce left out): auto never chooses it."""
    body = shape.body_params
    root = shape.hidden if w.vocab_parallel else shape.root_params  # a vocab-parallel head is never gathered
    # layers are gathered for the forward and again for the backward unless kept (SHARD_GRAD_OP); the root stays
    # gathered from its forward to its backward. Gathers happen every micro-step, the reduce-scatter once
    gathers = (2 if w.sharding in ("FULL_SHARD", "HYBRID_SHARD") else 1) * body + root
    reduced = shape.adapter_params(w) if w.adapter != "none" else body + root  # gradients: trained ones only
    moved = w.grad_accum * w.compute_bytes * gathers + FP32_BYTES * reduced
    if w.vocab_parallel:
        # every rank's hidden states and embeddings cross the vocabulary shards: two gathers and two reduce-scatters
        # of (world x tokens x hidden) per micro-step
        moved += w.grad_accum * 4 * w.world_size * w.batch_size * w.seq_length * shape.hidden * w.compute_bytes
    return int(ring(w) * moved)
