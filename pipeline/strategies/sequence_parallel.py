"""Sequence parallelism (--sequence-parallel N, DeepSpeed Ulysses as Arctic Long Sequence Training uses it): each
sequence is split by position over a group of N consecutive ranks, which share one batch. Everything but attention
is position-wise, so each rank runs it on its own slice; around attention an all-to-all trades sequence shards for
head shards, so each rank attends over the whole sequence for H/N heads with the family's own kernel, and a second
all-to-all trades back.

What keeps the result the unsplit model's:
- positions: each slice carries its global position ids, so rotary embeddings are the sequence's own;
- the mask: transformers builds none for a kernel it does not know (masking_utils), and the mask the whole sequence
  needs (causal, packed documents kept apart by their restarting positions, sliding windows, chunks) is built here
  from the group's positions, by the rules transformers' masks follow, once per micro-batch and kind;
- the loss: the labels are shifted to next-token targets before the split (a slice's last target is the next rank's
  first token), so each target is counted once, on the rank that holds its position; the gradient reduction over
  every rank already divides by the world size, as the loss scaling assumes;
- grouped-query attention with fewer KV heads than N: each KV head repeated so every rank receives whole ones (ALST).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from pipeline.data.batches import Batch
from pipeline.distributed.collectives import exchange
from pipeline.distributed.runtime import Dist
from pipeline.errors import UserError
from pipeline.model.modeling import untested_family
from pipeline.model.vocab_parallel import shifted_labels

KERNEL = "sequence_parallel"
"""The name the attention is registered under with transformers (AttentionInterface)."""
UNDER = ("sdpa", "eager")
"""The family kernels run inside it: those whose mask is a dense tensor this module can build."""
LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
"""The layer types (config.layer_types) whose attention is split by heads here."""


@dataclass
class Layout:
    """The whole sequence of the micro-batch being computed: what each layer's mask is built from. Set by split()
    and kept until the next one, so activation checkpointing's recompute in backward finds it."""

    positions: torch.Tensor
    """[batch, seq] the global position ids (restarting at each packed document)."""
    masks: dict = field(default_factory=dict)
    """Built masks by (window, chunk, dtype)."""

    @functools.cached_property
    def documents(self) -> torch.Tensor | None:
        """[batch, seq] each token's document index within its row, as transformers finds packed sequences (a
        position that does not follow the previous one starts a document); None when every row is one."""
        first = self.positions[:, :1] - 1
        docs = (torch.diff(self.positions, prepend=first, dim=-1) != 1).cumsum(-1)
        return docs if bool((docs[:, -1] != 0).any()) else None

    def mask(self, window: int | None, chunk: int | None, dtype: torch.dtype | None) -> torch.Tensor | None:
        """[batch, 1, seq, seq]: True where a query may attend to a key (dtype None), or the additive float mask
        eager attention takes; None for plain causal attention over unpacked rows under sdpa (its causal kernel)."""
        if window is None and chunk is None and self.documents is None and dtype is None:
            return None
        key = (window, chunk, dtype)
        if key not in self.masks:
            # by positions, as transformers remaps a packed document's indices to its positions (a chunk starts at
            # the document's position 0); the same as by index within each row otherwise
            q, k = self.positions[:, None, :, None], self.positions[:, None, None, :]
            allowed = k <= q
            if window is not None:
                allowed &= k > q - window
            if chunk is not None:
                allowed &= (k // chunk) == (q // chunk)
            if self.documents is not None:
                allowed &= self.documents[:, None, :, None] == self.documents[:, None, None, :]
            self.masks[key] = allowed if dtype is None else \
                torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                    ~allowed, torch.finfo(dtype).min)
        return self.masks[key]


class _Regrouped:
    """An attention module as the kernel sees it when KV heads were repeated: its own attributes (training, scaling,
    soft-capping), with the number of query heads per KV head the local heads have (the kernels repeat KV heads by
    module.num_key_value_groups)."""

    def __init__(self, module: nn.Module, groups: int):
        self.inner, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _to_heads(x: torch.Tensor, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[batch, heads, seq/n, dim] on each rank -> [batch, heads/n, seq, dim]: rank r's share of the heads over the
    whole sequence (the slices arrive in rank order, which is sequence order). A collective."""
    b, h, s, d = x.shape
    rows = x.reshape(b, n, h // n, s, d).transpose(0, 1).reshape(-1, d)
    split = [rows.shape[0] // n] * n
    got = exchange(rows, split, split, group).reshape(n, b, h // n, s, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _to_sequence(x: torch.Tensor, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The kernel's output [batch, seq, heads/n, dim] -> [batch, seq/n, heads, dim]: this rank's positions over every
    head. A collective."""
    b, seq, h, d = x.shape
    rows = x.reshape(b, n, seq // n, h, d).transpose(0, 1).reshape(-1, d)
    split = [rows.shape[0] // n] * n
    got = exchange(rows, split, split, group).reshape(n, b, seq // n, h, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, seq // n, n * h, d)


def refusal(config, degree: int, kernel: str) -> str:
    """Why a model of this config, its attention run by kernel, cannot be split over degree ranks here ("" when it
    can). The suite's families only: over transformers' whole registry these rules alone let through 14 families that
    computed another function split (absolute or ALiBi positions from the rank's slice, ...; BENCHMARKS
    sequence_parallel_families)."""
    if why := untested_family(config):
        return why
    bidirectional = getattr(config, "use_bidirectional_attention", None)  # Gemma 3's (True), Gemma 4's ("all")
    if not getattr(config, "is_causal", True) or bidirectional in (True, "all"):  # the mask built here is causal
        return "its config makes attention bidirectional"
    if kernel not in UNDER:
        return f"its attention kernel is {kernel} (the whole sequence's mask is built for {' or '.join(UNDER)})"
    other = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind not in LAYER_KINDS})
    if other:
        return f"its {', '.join(other)} layers run over the whole sequence on one rank (not split by heads)"
    heads = config.num_attention_heads
    if heads % degree:
        return f"its {heads} attention heads do not divide into {degree} groups"
    if getattr(config, "attn_temperature_tuning", False) and 0 in (getattr(config, "no_rope_layers", None) or ()):
        return "its layers without rotary embedding scale queries by the position within the rank's slice"
    return ""


def check_degree(n: int, world: int, seq: int) -> None:
    """The degree against the launch and the blocks: one line before any work."""
    if seq % n:
        raise UserError(f"--sequence-parallel {n} must divide --seq-length ({seq}): each rank takes an equal slice "
                        f"of every sequence; try --seq-length {seq - seq % n or n}")
    if world % n:
        raise UserError(f"--sequence-parallel {n} must divide the number of ranks ({world}): each group of {n} "
                        "consecutive ranks shares one sequence")


def refuse(model: nn.Module, degree: int) -> None:
    """refusal(), as the one line a run stops with."""
    if why := refusal(model.config, degree, model.config._attn_implementation):
        raise UserError(f"--sequence-parallel {degree} cannot split {type(model).__name__}: {why}; use "
                        "--sequence-parallel 1")


class SequenceParallel:
    """This rank's sequence-parallel group and the attention that spans it."""

    def __init__(self, degree: int, d: Dist):
        self.degree = degree
        self.rank = d.rank % degree
        # every rank creates every group, in the same order (new_group is a collective over the world)
        groups = [dist.new_group(list(range(start, start + degree))) for start in range(0, d.world_size, degree)]
        self.group = groups[d.rank // degree]
        self.layout: Layout | None = None
        self.kernel = ""
        """The family's own attention kernel, run inside the split one."""
        self.config = None

    def install(self, model: nn.Module) -> None:
        """The model's attention split over the group from now on (a refusal is one line, the same on every rank)."""
        refuse(model, self.degree)
        self.kernel = model.config._attn_implementation
        from transformers import AttentionInterface

        # one registration per process, pointing at this instance: a second model installed in the same process would
        # take it over (its group, layout and kernel) for both; a process trains one model
        AttentionInterface.register(KERNEL, self._attention)
        self.config = model.config
        model.set_attn_implementation(KERNEL)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """The family's own attention on each rank's whole input, for what is not split (greedy sampling, the
        reference pass). Not re-entrant: it always ends in the split attention."""
        self.config._attn_implementation = self.kernel
        try:
            yield
        finally:
            self.config._attn_implementation = KERNEL

    def split(self, batch: Batch) -> Batch:
        """This rank's slice of every row of the batch: its positions' ids, global position ids and next-token
        targets (the flags and reference values stay whole); the whole rows' layout kept for the attention's
        masks."""
        seq = batch.input_ids.shape[1]
        if seq % self.degree:  # preflight refuses such a --seq-length: a programming error here
            raise ValueError(f"a batch of {seq} positions cannot be split over {self.degree} ranks")
        positions = batch.position_ids
        if positions is None:
            positions = torch.arange(seq, device=batch.input_ids.device).expand(batch.input_ids.shape[0], seq)
        self.layout = Layout(positions)
        part = slice(self.rank * seq // self.degree, (self.rank + 1) * seq // self.degree)
        def mine(x: torch.Tensor | None) -> torch.Tensor | None:  # contiguous: the loss views its targets flat
            return None if x is None else x[:, part].contiguous()

        # flags stay whole: an objective over pairs reads each row's answers from them (token_logps gathers the
        # rows' log-probabilities whole)
        return replace(batch, input_ids=mine(batch.input_ids), labels=mine(shifted_labels(batch.labels)),
                       position_ids=mine(positions), shifted=True)

    def _kernel_for(self, module: nn.Module) -> Callable:
        if self.kernel == "eager":  # each family's own eager function (soft-capping, its own scaling)
            return sys.modules[type(module).__module__].eager_attention_forward
        from transformers import AttentionInterface

        return AttentionInterface()[self.kernel]

    def _limits(self, module: nn.Module, kwargs: dict) -> tuple[int | None, int | None]:
        """The layer's sliding window and chunk size (None: none), as transformers' masks for the layer use them."""
        config, layer = self.config, getattr(module, "layer_idx", None)
        types = getattr(config, "layer_types", None)
        kind = types[layer] if types and layer is not None else "full_attention"
        window = kwargs.get("sliding_window") or (config.sliding_window if kind == "sliding_attention" else None)
        chunk = config.attention_chunk_size if kind == "chunked_attention" else None
        return window, chunk

    def _attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
        """transformers' attention interface: this rank's positions in, this rank's positions out. Four
        all-to-alls over the group (query, key, value, output): every rank of the group must reach them."""
        n, layout = self.degree, self.layout
        if layout is None or query.shape[2] * n != layout.positions.shape[1]:
            raise RuntimeError("sequence-parallel attention called outside a split batch (split() sets its layout; "
                               "whole() runs the family's own)")
        kv_heads = key.shape[1]
        module_seen = module
        if kv_heads % n:  # fewer (or indivisible) KV heads: repeat each so every rank receives whole ones
            repeat = n // math.gcd(kv_heads, n)
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
            module_seen = _Regrouped(module, query.shape[1] // key.shape[1])
        q, k, v = (_to_heads(t, n, self.group) for t in (query, key, value))
        window, chunk = self._limits(module, kwargs)
        mask = layout.mask(window, chunk, q.dtype if self.kernel == "eager" else None)
        out, _ = self._kernel_for(module)(module_seen, q, k, v, mask, **kwargs)
        return _to_sequence(out, n, self.group), None
