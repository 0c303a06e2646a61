"""Which models read shared-prompt rows (a prompt once, its group of completions after it, under a 4D mask; GRPO's
scoring, pipeline/rl/packing.py) as they read plain ones, and what a forward of either layout costs: facts of a
model's config, read by the objective that packs and by the memory estimate that counts it."""

from __future__ import annotations

from dataclasses import dataclass

PACKABLE_KERNELS = ("sdpa", "eager")
"""Attention kernels that take a 4D mask as given (flash attention takes none; flex attention wants a block mask)."""
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}
"""Layer kinds that read the sequence through the mask alone (a window or chunk no shorter than the rows: checked)."""


def packing_refusal(config, positions: int) -> str | None:
    """Why a model of this config cannot score packed rows of up to `positions` positions (prompt plus completion);
    None when it can."""
    config = _text(config)
    kernel = getattr(config, "_attn_implementation", None)
    if kernel not in PACKABLE_KERNELS:
        return f"its attention kernel {kernel} takes no 4D mask"
    if other := _unmasked_layers(config):
        return f"its layers include {', '.join(other)}, which read the sequence in order"
    for what, size in _spans(config):
        if size < positions:
            return f"its {what} ({size}) is shorter than a prompt and its completion ({positions})"
    return None


@dataclass(frozen=True)
class Costs:
    """A forward's cost, as the model's config gives it (FLOPs up to a common factor): per position through the
    layers' matrix products, and per pair of positions the attention scores."""

    per_position: float
    per_pair: float

    @classmethod
    def of(cls, config) -> Costs:
        text = _text(config)
        hidden, layers = text.hidden_size, text.num_hidden_layers
        heads = text.num_attention_heads
        head_dim = _global(text, "head_dim") or hidden // heads
        inner = _global(text, "intermediate_size") or 4 * hidden
        return cls(2 * layers * (4 * hidden * hidden + 3 * hidden * inner), 4 * layers * heads * head_dim)

    def packing_pays(self, prompt: int, completion: int, group: int) -> bool:
        """Whether one row of the prompt and its group (every pair of its positions scored: the mask is dense) costs
        less than the group's rows (each causal)."""
        packed, plain = prompt + group * completion, prompt + completion
        return packed * self.per_position + packed * packed * self.per_pair < \
            group * (plain * self.per_position + plain * plain * self.per_pair / 2)


def packed_span(config) -> int:
    """The most positions (prompt plus completion) whose packed rows this model's layers read as plain ones, whatever
    the kernel: 0 where a layer reads the sequence in order, else its shortest window or chunk (a large number for
    none)."""
    config = _text(config)
    if _unmasked_layers(config):
        return 0
    return min((size for _, size in _spans(config)), default=1 << 62)


def _unmasked_layers(config) -> list[str]:
    """The config's layer kinds that read the sequence otherwise than through the mask."""
    return sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS)


def _global(config, name: str) -> int | None:
    """A config's model-wide value of name; None where it has none, or where it is per layer (Gemma 4's head_dim:
    transformers refuses a global read of it with an error of its own)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError, whose module is internal
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _spans(config) -> list[tuple[str, int]]:
    """The config's position limits on attention: a sliding window, Llama 4's attention chunks."""
    return [(what, size) for name, what in (("sliding_window", "sliding window"),
                                            ("attention_chunk_size", "attention chunk"))
            if isinstance(size := getattr(config, name, None), int) and size > 0]
