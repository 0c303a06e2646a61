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
    split = shape.split_experts(w)
    body = shape.body_params - (shape.routed_params if split > 1 else 0)  # split experts are never gathered
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
    moved = ring(w) * moved
    if split > 1:
        # each MoE layer sends every token's top-k rows to their experts' ranks and takes the outputs back, in the
        # forward and again (gradients) in the backward, a third time where checkpointing recomputes the forward;
        # (n-1)/n of them leave the rank when the routing is balanced
        passes = 3 if w.activation_checkpointing or w.selective_checkpointing else 2
        rows = w.batch_size * w.seq_length * shape.top_k * sum(1 for _ in moe_layers(shape))
        moved += w.grad_accum * passes * 2 * rows * shape.hidden * w.compute_bytes * (split - 1) / split
    return int(moved)


def moe_layers(shape: Shape) -> range:
    """The decoder layers with routed experts (each holds one gate_up_proj-like weight and one down_proj-like)."""
    names = {name for name, *_ in shape.experts}
    return range(len(shape.experts) // max(len(names), 1))
