"""How much memory one rank needs to train a model: one estimator for MODEL_DOWNLOAD.py's table, the trainer's
preflight and `--strategy auto`.

The trainer keeps fp32 master weights, fp32 gradients and AdamW's two fp32 moments for every parameter it holds
(16 bytes each, whatever the dtype of the model's files), sharded over the ranks by FSDP and `manual`, replicated by
DDP. On top of that: the compute-dtype copies a step gathers (FSDP) or casts (DDP's autocast), a layer's
unsharded gradients on their way to the reduce-scatter, the activations saved for backward, and the logits of the
loss. The figures are peaks per rank above what the process held before the model was built (CUDA: the caching
allocator's peak, without the CUDA context; CPU: resident memory); BENCHMARKS.md compares them with measured peaks.

A preference objective adds no term: its pairs are packed into the same blocks, its log-probabilities come through
the same head (the same logits term), and its reference is either precomputed (full fine-tuning: a few floats per
pair beside the token cache) or the base with the adapters off, a forward without gradient that runs before the
policy's and frees its activations as it goes, so its peak stays under the policy's forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import psutil
import torch

from pipeline.model.nf4 import NF4_BYTES_PER_PARAM
from pipeline.model.packed_rows import Costs, packed_span
from pipeline.model.vocab_parallel import chunk_elements

GIB = 1024**3
STATE_BYTES_PER_PARAM = 16
"""fp32 master weight, fp32 gradient and AdamW's two fp32 moments per parameter."""
FP32_BYTES = 4
CUDA_CONTEXT_BYTES = GIB
"""What the CUDA context and NCCL take on a GPU outside the caching allocator (about 0.5-1 GiB): kept free."""


class ShapeUnknown(Exception):
    """The model's shape cannot be read (a config transformers cannot build): every figure that needs it is left out,
    saying why, and the stage goes on."""


@dataclass(frozen=True)
class Shape:
    """What the estimates need of a decoder, read from the model transformers builds of the config on the meta device
    (no memory): its own structure, so families whose layers differ (Gemma 4's per-layer head sizes, Qwen 3.5's
    linear-attention layers, DeepSeek's dense first layers) are counted as built, not as a formula of ours would. A
    mixture of experts holds every expert's parameters, and a token's activations are those of the experts it is
    routed to."""

    hidden: int
    intermediate: int
    """Width of the MLP activations per token, averaged over the layers: the MLP's intermediate size (a shared expert's
    included), or experts-per-token x an expert's."""
    kv: int
    """Width of the key (and of the value) projection, averaged over the layers."""
    layers: int
    vocab: int
    tied: bool
    layer_params: int
    """Parameters of the largest decoder layer (what a gathered unit holds at most)."""
    body_params: int = 0
    """Parameters of all decoder layers."""
    total_params: int = 0
    """Every parameter (a tied weight once)."""
    linears: tuple[tuple[str, int, int], ...] = ()
    """(name, in, out) of every linear layer of every decoder block an adapter can target (the blocks' own names; a
    mixture of experts' fused experts are not linear layers, nor is its router)."""
    experts: tuple[tuple[str, int, int, int], ...] = ()
    """(name, experts, rows, columns) of every fused routed-expert weight of every block (a mixture of experts' 3-D
    gate_up_proj and down_proj), which an adapter can target through peft's target_parameters."""
    layer_experts: int = 0
    """Routed-expert parameters of the decoder layer that holds the most (0 for a dense model)."""
    top_k: int = 0
    """Experts each token is routed to (0 for a dense model)."""
    routable: bool = False
    """Whether expert parallelism can split the experts (pipeline/strategies/expert_parallel.unroutable)."""
    tested: bool = False
    """Whether the family is one the suite trains (--expert-parallel auto splits only those)."""
    packs_to: int = 0
    """The longest prompt plus completion GRPO may score in packed rows (pipeline/model/packed_rows.py; 0: never)."""
    costs: Costs | None = None
    """What a position and a pair of positions cost, to tell where packed rows are chosen (with packs_to)."""

    @classmethod
    def of(cls, config) -> Shape:
        """The shape of the model config describes; ShapeUnknown when transformers cannot build it."""
        from torch import nn

        from pipeline.errors import UserError
        from pipeline.model.adapters import default_targets
        from pipeline.model.modeling import decoder_layers, in_routed_experts, meta_model, moe_shape, untested_family
        from pipeline.strategies.expert_parallel import unroutable

        try:
            model = meta_model(config)
            blocks = decoder_layers(model)
        except (UserError, ValueError, KeyError, AttributeError, TypeError, ImportError) as exc:
            raise ShapeUnknown(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
        text = config.get_text_config()
        hidden = text.hidden_size
        sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
        widths = [_widths(block, text, hidden) for block in blocks]
        targets = set(default_targets(model))  # what an adapter may go on: not a router, nor what peft moves
        linears = tuple((name.rsplit(".", 1)[-1], m.in_features, m.out_features) for block in blocks
                        for name, m in block.named_modules()
                        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)
        experts = tuple((name.rsplit(".", 1)[-1], *p.shape) for block in blocks for name, p in block.named_parameters()
                        if p.ndim == 3 and in_routed_experts(name))
        routed = max(sum(p.numel() for name, p in block.named_parameters() if in_routed_experts(name))
                     for block in blocks)
        n = len(blocks)
        return cls(hidden, sum(i for _, i in widths) // n, sum(k for k, _ in widths) // n, n, text.vocab_size,
                   bool(getattr(text, "tie_word_embeddings", False)), max(sizes), sum(sizes),
                   sum(p.numel() for p in model.parameters()), linears, experts, routed, moe_shape(config)[1],
                   bool(experts) and not unroutable(model), not untested_family(config), packed_span(text),
                   Costs.of(text))

    def adapter_params(self, work: Workload) -> int:
        """Trainable parameters of the workload's adapter: r x (in + out) per adapted linear layer (DoRA: + out, its
        magnitude), in every block; 0 without one."""
        if work.adapter == "none":
            return 0
        return sum(work.lora_rank * (i + o) + (o if work.adapter == "dora" else 0)
                   for name, i, o in self.adapted_linears(work)) + \
            sum(work.lora_rank * e * (a + b) for _, e, a, b in self.adapted_experts(work))

    def quantized_params(self, work: Workload) -> int:
        """Base parameters held in NF4 (--adapter qlora: those of every adapted linear layer); 0 otherwise."""
        if work.adapter != "qlora":
            return 0
        return sum(i * o for name, i, o in self.adapted_linears(work))

    def adapted_linears(self, work: Workload) -> list[tuple[str, int, int]]:
        """(name, in, out) of the linear layers of every block the workload's adapter targets."""
        named = {t.strip() for t in work.lora_targets.split(",")} if work.lora_targets else None
        return [(name, i, o) for name, i, o in self.linears if named is None or name in named]

    def adapted_experts(self, work: Workload) -> list[tuple[str, int, int, int]]:
        """(name, experts, rows, columns) of the fused expert weights the workload's adapter targets: all of them by
        default, those named (down_proj or experts.down_proj) otherwise; none under DoRA, which peft's LoRA on a
        fused weight does not take (pipeline/model/adapters.experts_blocked; dropout, which it also refuses, is not
        part of the workload)."""
        if work.adapter in ("none", "dora"):
            return []
        named = {t.strip().removeprefix("experts.") for t in work.lora_targets.split(",")} if work.lora_targets \
            else None
        return [w for w in self.experts if named is None or w[0] in named]

    def trainable_params(self, work: Workload) -> int:
        """What the optimizer updates: every parameter, or an adapter's alone."""
        return self.adapter_params(work) if work.adapter != "none" else self.num_params

    def split_experts(self, work: Workload) -> int:
        """Ranks each layer's routed experts are split over by expert parallelism (1: not split), as
        pipeline/strategies/expert_parallel.degree decides the run's: the degree named, or under auto (0) the shard
        ranks where the family is tested; only where it divides the experts and they can be split."""
        experts = self.experts[0][1] if self.experts else 0
        n = work.expert_parallel or (work.shard_ranks if self.tested else 1)
        return n if n > 1 and experts and experts % n == 0 and self.routable else 1

    @property
    def routed_params(self) -> int:
        """Every decoder layer's routed-expert parameters."""
        return sum(e * a * b for _, e, a, b in self.experts)

    @property
    def root_params(self) -> int:
        """Everything outside the decoder layers (embedding, LM head when untied, the final norm, a per-layer
        embedding table): FSDP's root unit."""
        return self.num_params - self.body_params

    @property
    def num_params(self) -> int:
        return self.total_params


def _widths(block, text, hidden: int) -> tuple[int, int]:
    """(key width, MLP width per token) of one decoder block, from its modules: k_proj's output (else the hidden
    size: attention without one, as MLA or linear attention, counted as wide as the residual), the gated MLPs'
    up projections (a shared expert's included), and of fused experts ([experts, ...] parameters) those a token is
    routed to."""
    from torch import nn

    linear = [(name.rsplit(".", 1)[-1], m) for name, m in block.named_modules() if isinstance(m, nn.Linear)]
    keys = [m.out_features for name, m in linear if name == "k_proj"]
    mlp = sum(m.out_features for name, m in linear if name == "up_proj")
    mlp += sum(m.out_features // 2 for name, m in linear if name == "gate_up_proj")
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None)
    for name, p in block.named_parameters():
        if p.ndim == 3 and ".experts." in f".{name}" and "down" in name.rsplit(".", 1)[-1]:
            experts, a, b = p.shape  # down_proj of every expert: [E, hidden, inter] or [E, inter, hidden]
            mlp += (top_k or experts) * (b if a == hidden else a)
    return keys[0] if keys else hidden, mlp or 4 * hidden


@dataclass(frozen=True)
class Generation:
    """GRPO's rollouts, as they decide memory: the completions of a micro-batch and their lengths."""

    completions: int
    """Per micro-batch: prompts x completions per prompt."""
    prompt: int
    """The longest prompt, in tokens (--max-prompt-length)."""
    completion: int
    """The longest completion (--max-completion-length)."""
    reference: bool = False
    """A frozen copy of the base resident beside the policy (--grpo-beta under full fine-tuning): sharded as the
    policy under fsdp2, whole (fp32) on each rank under the other strategies."""
    group: int = 1
    """Completions per prompt (--num-generations)."""
    packable: bool = False
    """The attention kernel takes packed rows (each prompt once, its group after it): whether the model's layers do
    is Shape.packs_to's."""

    def packed(self, shape: Shape) -> bool:
        """Whether the longest rows are scored packed: the model takes them and they cost less (GRPOObjective.logps)."""
        return self.packable and shape.packs_to >= self.prompt + self.completion and \
            shape.costs.packing_pays(self.prompt, self.completion, self.group)

    def packed_rows(self) -> tuple[int, int]:
        """(rows, positions per row) of a micro-batch's packed scoring: a prompt and its group's completions each."""
        return self.completions // self.group, self.prompt + self.group * self.completion

    def scored_tokens(self, shape: Shape) -> int:
        """The positions of a micro-batch's scoring forward: packed rows where they are chosen, else plain."""
        if self.packed(shape):
            rows, length = self.packed_rows()
            return rows * length
        return self.completions * (self.prompt + self.completion)

    def mask_bytes(self, shape: Shape, compute_bytes: int) -> int:
        """Packed rows' 4D mask, one for every layer: rows x positions squared in the compute dtype."""
        if not self.packed(shape):
            return 0
        rows, length = self.packed_rows()
        return rows * length**2 * compute_bytes


@dataclass(frozen=True)
class Workload:
    """What decides the memory of one rank, besides the model."""

    strategy: str
    """fsdp2, fsdp1, ddp or manual."""
    sharding: str
    """Resolved --sharding (not auto)."""
    world_size: int
    local_world_size: int
    compute_bytes: int
    """2 for bf16/fp16 compute, 4 for fp32."""
    batch_size: int
    seq_length: int
    grad_accum: int = 1
    activation_checkpointing: bool = False
    vocab_parallel: bool = False
    cpu_offload: bool = False
    device: str = "cuda"
    adapter: str = "none"
    """--adapter: none (every parameter trains), lora or dora (a frozen base in the compute dtype), or qlora (the
    adapted layers' base weights in NF4)."""
    lora_rank: int = 16
    lora_targets: str = ""
    generation: Generation | None = None
    """GRPO: the micro-batch is its completions, each a prompt and a completion (batch_size and seq_length are
    theirs), and a generation comes before each step."""
    resident_bytes: int = 0
    """Other models every rank holds through every moment (GRPO's reward models, whole, in the compute dtype)."""
    selective_checkpointing: bool = False
    expert_parallel: int = 1
    """--expert-parallel's degree (1: off; 0: auto, where the settings allow it): each layer's routed experts split
    over that many ranks, never gathered, tokens sent to them by all-to-all (Shape.split_experts resolves it)."""
    tiled_mlp: bool = False
    """--tiled-mlp on: no layer keeps its MLP's intermediate activations; one chunk's (about hidden-size tokens per
    sequence) exist at a time, while it is recomputed."""
    offload_activations: bool = False
    """--offload-activations on a GPU: what the forward saves held in host memory, one layer's on the device."""
    sequence_parallel: int = 1
    """--sequence-parallel's degree: each rank holds 1/N of every sequence's positions, so of its activations and
    logits (attention's all-to-all buffers are the size of the q, k, v and output it already counts)."""

    @property
    def shard_ranks(self) -> int:
        """Ranks a sharded parameter is split over: every rank, one node's under HYBRID_SHARD, none under NO_SHARD."""
        return shard_ranks(self.sharding, self.world_size, self.local_world_size)


def shard_ranks(sharding: str, world_size: int, local_world_size: int) -> int:
    """Ranks FSDP splits each parameter over under a sharding (build_mesh's last dimension)."""
    return {"NO_SHARD": 1, "HYBRID_SHARD": local_world_size}.get(sharding, world_size)


@dataclass(frozen=True)
class Estimate:
    """Peak bytes per rank, by what holds them. Two moments compete for the peak: the end of the forward (saved
    activations and the loss's logits on top of the resident state) and AdamW's step (the whole fp32 state)."""

    weights: int
    """fp32 master weights and AdamW's two moments this rank keeps on the device (none with --cpu-offload), and the
    models resident beside them (GRPO's frozen reference and reward models)."""
    gradients: int
    """Gradients alive at the end of the forward: DDP's buckets (kept between steps), the unsharded ones kept
    through gradient accumulation (sharded strategies), and a layer's on its way to the reduce-scatter. Sharded
    fp32 gradients only exist from the backward to the step, when the activations are being freed."""
    copies: int
    """Compute-dtype copies of parameters alive at the peak: gathered units (FSDP), autocast's cache (DDP)."""
    activations: int
    """Saved for backward by the decoder layers, for one micro-batch."""
    logits: int
    """The loss: full-width logits, their fp32 copy, log-softmax and gradient (or the vocabulary-parallel chunks)."""
    update: int
    """AdamW's step: weights, moments and fp32 gradients (the trainer's fused AdamW needs no per-parameter
    temporaries)."""
    generation: int = 0
    """GRPO's generation, a third moment: the resident weights, the model gathered whole (a sharding strategy keeps
    it gathered through the generation), the KV cache of a micro-batch's completions and their last logits."""

    PARTS = ("weights", "gradients", "copies", "activations", "logits", "update")

    @property
    def forward(self) -> int:
        """The end of the forward: everything but the step."""
        return self.weights + self.gradients + self.copies + self.activations + self.logits

    @property
    def total(self) -> int:
        return max(self.forward, self.update, self.generation)

    def gib(self) -> dict[str, float]:
        """GiB by part, and the total (the generation's moment only where there is one)."""
        names = (*self.PARTS, *(("generation",) if self.generation else ()), "total")
        return {name: round(getattr(self, name) / GIB, 3) for name in names}

    def describe(self) -> str:
        parts = self.gib()
        total = parts.pop("total")
        return f"{total:.2f} GiB ({', '.join(f'{k} {v:.2f}' for k, v in parts.items())})"


# Per token and decoder layer, the elements autograd saves, in widths of the layer (checked against fp32 peaks on
# CPU, BENCHMARKS.md section 10; bf16 only with activation checkpointing, on one H100, section 6): the norms' inputs
# and outputs, q/k/v, attention output, residuals (about 8 hidden widths and 2 KV widths) and the MLP's gate, up,
# activation and product (4 intermediate widths).
HIDDEN_WIDTHS, KV_WIDTHS, INTERMEDIATE_WIDTHS = 8, 2, 4


def layer_activation_bytes(shape: Shape, tokens: int, compute_bytes: int) -> int:
    """One decoder layer's (its widths averaged over the layers: times shape.layers, every layer's)."""
    return tokens * (HIDDEN_WIDTHS * shape.hidden + KV_WIDTHS * shape.kv + INTERMEDIATE_WIDTHS * shape.intermediate) \
        * compute_bytes


# Under --selective-checkpointing a layer keeps its input, q, the attention's and o's outputs and the MLP's down
# output (5 hidden widths), k and v (2 KV widths) and the gate and up outputs (2 intermediate widths).
SELECTIVE_WIDTHS = (5, 2, 2)


def selective_layer_bytes(shape: Shape, tokens: int, compute_bytes: int) -> int:
    """What one decoder layer keeps under --selective-checkpointing (averaged over the layers, as above)."""
    hidden, kv, intermediate = SELECTIVE_WIDTHS
    return tokens * (hidden * shape.hidden + kv * shape.kv + intermediate * shape.intermediate) * compute_bytes


def adapter_activation_bytes(shape: Shape, work: Workload, tokens: int) -> int:
    """What an adapter saves per decoder layer (averaged over the layers) beyond the base layer's: DoRA scales both
    the base output and the low-rank output by its magnitude, so autograd keeps both (two output widths per adapted
    linear layer: 0.30 GiB on SmolLM2's shape at 256 tokens, where DoRA's measured peak is 0.31 GiB above LoRA's in
    fp32, BENCHMARKS.md section 16; under bf16 autocast the fp32 magnitude may make those outputs fp32, not
    measured). LoRA's own, a rank-wide middle, is too small to count."""
    if work.adapter != "dora":
        return 0
    return tokens * 2 * sum(o for _, _, o in shape.adapted_linears(work)) // shape.layers * work.compute_bytes


def expert_parallel_bytes(shape: Shape, work: Workload, tokens: int) -> int:
    """Expert parallelism, per layer: this rank's experts cast to the compute dtype for its products, which autograd
    keeps for the backward (none in fp32, where the cast is the weight itself), and the rows the all-to-all brings
    in (each token's top-k copies, about as many as it sends). Recomputed, like the rest, under checkpointing."""
    n = shape.split_experts(work)
    if n == 1:
        return 0
    cast = shape.layer_experts // n * work.compute_bytes if work.compute_bytes < 4 else 0
    return cast + tokens * shape.top_k * shape.hidden * work.compute_bytes


def merged_expert_bytes(shape: Shape, work: Workload) -> int:
    """LoRA on fused expert weights (peft's ParamWrapper) computes each forward's weight as W + B A for every expert
    of the layer, and autograd keeps that copy for the backward: a layer's experts in the compute dtype, averaged over
    the layers (measured: 25.2 MB of fp32 experts saved 26.2 MB more than the same model with attention adapters
    only). A product's output that checkpointing of either kind recomputes (baddbmm is not among the operators
    selective checkpointing keeps; not measured under it)."""
    # under expert parallelism a rank adds the update to its own experts only
    return sum(e * a * b for _, e, a, b in shape.adapted_experts(work)) // shape.layers // shape.split_experts(work) \
        * work.compute_bytes


class StrategyTerms(Protocol):
    """What the estimate asks of a strategy: the terms in which strategies differ (base.Strategy implements them)."""

    def shards(self, work: Workload) -> int:
        """Ranks each parameter is split over."""

    def gradient_bytes(self, shape: Shape, work: Workload) -> int:
        """Gradients alive at the end of the forward (Estimate.gradients)."""

    def copy_bytes(self, shape: Shape, work: Workload) -> int:
        """Compute-dtype copies of parameters alive at the peak (Estimate.copies)."""

    def gathered_layers(self, shape: Shape, work: Workload) -> int:
        """Decoder layers gathered whole at the forward's peak (sharded strategies)."""


def estimate(shape: Shape, work: Workload, terms: StrategyTerms) -> Estimate:
    """Peak bytes per rank for one optimizer step of this workload, under the strategy whose terms are given
    (pipeline/strategies/registry.estimate looks them up by work.strategy)."""
    c, n = work.compute_bytes, shape.num_params
    shards = terms.shards(work)
    held = 0 if work.cpu_offload else n // shards  # parameters this rank keeps fp32 state for
    gen = work.generation
    tokens = work.batch_size * work.seq_length // work.sequence_parallel if gen is None else gen.scored_tokens(shape)
    # GRPO scores the completions' positions alone: their logits, not the prompts'
    logit_tokens = tokens if gen is None else gen.completions * (gen.completion + 1)
    layer = layer_activation_bytes(shape, tokens, c)
    # --tiled-mlp: no layer keeps its MLP's intermediates, one chunk's exist while it is recomputed
    untiled = INTERMEDIATE_WIDTHS * shape.intermediate * tokens * c if work.tiled_mlp else 0
    chunk = INTERMEDIATE_WIDTHS * shape.intermediate * min(tokens, work.batch_size * shape.hidden) * c \
        if work.tiled_mlp else 0
    layer -= untiled
    per_layer = layer + adapter_activation_bytes(shape, work, tokens)
    merged = merged_expert_bytes(shape, work) + expert_parallel_bytes(shape, work, tokens)
    if work.activation_checkpointing:  # each layer's input, and one layer recomputed at a time
        activations = shape.layers * tokens * shape.hidden * c + per_layer + merged
    elif work.selective_checkpointing:  # the products' and attention's outputs, and one layer recomputed at a time
        kept = selective_layer_bytes(shape, tokens, c) - (untiled // 2)  # (the gate and up outputs: half of them)
        activations = shape.layers * (per_layer - layer + kept) + per_layer + merged
    else:
        activations = shape.layers * (per_layer + merged)
    if work.offload_activations:  # what is saved waits in host memory: one layer's on the device at a time
        activations = per_layer + merged
    activations += chunk
    activations += gen.mask_bytes(shape, c) if gen else 0
    logits = logits_bytes(shape, work, logit_tokens, shards)
    if work.adapter != "none":
        # a frozen base in the compute dtype (no gradient, no state); the adapter's fp32 weights, gradients and
        # moments, which the strategy shards like the base; the gathered units as under full fine-tuning, but no
        # autocast cache (the base already is in the compute dtype)
        base, adapter = held * c, 0 if work.cpu_offload else shape.adapter_params(work) // shards
        copies = terms.copy_bytes(shape, work) if shards > 1 else 0
        if quantized := shape.quantized_params(work):
            # QLoRA: the adapted layers' weights held and gathered as 4-bit codes, and one of them dequantized to
            # the compute dtype at a time (torchao's F.linear), the largest at the peak
            saved = c - NF4_BYTES_PER_PARAM
            base -= int(quantized // shards * saved)
            if shards > 1:
                copies -= int(terms.gathered_layers(shape, work) * quantized // shape.layers * saved)
            copies += max(i * o for _, i, o in shape.adapted_linears(work)) * c
        base += work.resident_bytes
        return Estimate(base + 12 * adapter, FP32_BYTES * shape.adapter_params(work), copies, activations, logits,
                        base + STATE_BYTES_PER_PARAM * adapter,
                        base + 12 * adapter + generation_bytes(shape, work, shards) if gen else 0)
    # GRPO's frozen reference, resident through every moment: sharded in the compute dtype under fsdp2, else whole
    # in fp32 (run under autocast, as ddp runs the policy); its reward models, whole in the compute dtype
    ref = (n * c // shards if work.strategy == "fsdp2" else n * FP32_BYTES) if gen and gen.reference else 0
    ref += work.resident_bytes
    generating = 12 * held + ref + generation_bytes(shape, work, shards) if gen else 0
    return Estimate(12 * held + ref, terms.gradient_bytes(shape, work), terms.copy_bytes(shape, work), activations,
                    logits, STATE_BYTES_PER_PARAM * held + ref, generating)


def generation_bytes(shape: Shape, work: Workload, shards: int) -> int:
    """What a GRPO generation adds to the resident weights: the model gathered whole in the compute dtype (sharded
    strategies, Strategy.gathered), each layer's keys and values for every completion's prompt and completion, and
    the last position's logits with their fp32 softmax and cumulative sum."""
    gen = work.generation
    gathered = shape.num_params * work.compute_bytes if shards > 1 else 0
    cache = 2 * shape.layers * shape.kv * gen.completions * (gen.prompt + gen.completion) * work.compute_bytes
    return gathered + cache + gen.completions * shape.vocab * (work.compute_bytes + 8)


def logits_bytes(shape: Shape, work: Workload, tokens: int, shards: int) -> int:
    """The loss's peak: without vocabulary parallelism the logits (compute dtype), their fp32 upcast, the saved
    log-softmax and its gradient; with it, every rank's hidden states gathered (fp32) and one chunk of logits with
    its softmax and gradient."""
    if not work.vocab_parallel:
        return tokens * shape.vocab * (work.compute_bytes + (4 if work.compute_bytes < 4 else 0) + 8)
    rows = tokens * work.world_size
    chunk = min(rows * -(-shape.vocab // shards), chunk_elements(work.device, work.adapter == "none"))
    return rows * shape.hidden * 4 + 3 * chunk * 4


def device_bytes(device_type: str, local_world_size: int, local_rank: int = 0) -> int:
    """Memory one rank may plan for: the GPU's, less the CUDA context; on CPU the host's RAM shared by this node's
    ranks."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(local_rank).total_memory - CUDA_CONTEXT_BYTES
    return psutil.virtual_memory().total // max(local_world_size, 1)

